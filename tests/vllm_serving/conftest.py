"""vLLM's CPU build serving small random models on fusedattn (fusedattn.integrations.vllm),
against vLLM's own CPU attention in the same process. These tests need vLLM, which pins its
own torch: `make test-vllm` builds .venv-vllm for them (`make test` runs it); in any other
environment tests/conftest.py leaves this folder out.
"""

import os
import sys

# Before vLLM is imported: one process (the engine core in this one, so the tests can count
# fusedattn's calls and patch the scheduler), a 1 GiB KV-cache budget on the CPU.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
