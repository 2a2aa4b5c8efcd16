"""Every script in examples/ runs as a user would run it, in its CPU configuration (issue #33):
a fresh interpreter, the default (tiny) sizes, exit status 0, and the line it ends with. The
scripts check themselves (a loss that falls, packed logits equal to unpacked ones)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # processes started per test: not in the quick subset

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SCRIPTS = {
    "swap_transformer.py": "loss ",
    "hf_llama.py": "pattern:",
    "bert_padded.py": "loss ",
    "packed_sequences.py": "step ",
    "context_parallel.py": "losses equal to the single-process run",
    "fp8_cache.py": "greedy picks equal to the bf16 cache's",
    "document_mask.py": "step ",
    "learnable_relative_bias.py": "step ",
    "batch_invariant.py": "log-probabilities equal bit for bit in all 3 batches",
}


# Arguments a script runs with here: the context-parallel example's Ulysses path (its ring
# path is the default a user runs first; tests/test_distributed.py and test_fsdp.py check it).
ARGS = {"context_parallel.py": ["--cp", "ulysses"]}

# needs vLLM, which pins its own torch: tests/vllm_serving/test_vllm_example.py runs it (make test-vllm)
VLLM_SCRIPTS = {"vllm_serve.py"}


def test_every_example_is_listed_here():
    listed = set(SCRIPTS) | VLLM_SCRIPTS
    assert {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")} == listed


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_example_runs_on_the_cpu(script):
    if script in ("hf_llama.py", "packed_sequences.py", "fp8_cache.py", "batch_invariant.py"):
        pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET",)}
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU configuration, on a GPU machine too
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), *ARGS.get(script, [])], cwd=EXAMPLES, env=env,
        capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    assert (
        SCRIPTS[script] in result.stdout.strip().splitlines()[-1]
        or SCRIPTS[script] in result.stdout
    )
