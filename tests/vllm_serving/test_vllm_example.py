"""examples/vllm_serve.py as a user runs it (its own process, vLLM's engine core in another)."""

import os
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "vllm_serve.py"


def test_the_vllm_example_serves_on_fusedattn():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FUSEDATTN_VLLM", "VLLM_"))}  # fmt: skip
    result = subprocess.run([sys.executable, str(EXAMPLE)], env=env, capture_output=True,
                            text=True, timeout=600)  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "fusedattn's vLLM backend serves 2 attention layers" in output, output[-4000:]
    assert sum(line.startswith("request:") for line in result.stdout.splitlines()) == 3
