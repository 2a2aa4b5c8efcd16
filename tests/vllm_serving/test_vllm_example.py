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


def test_the_batch_invariance_example_gives_the_same_bits_in_every_batch_on_vllm():
    """examples/batch_invariant.py --engine vllm: a prompt's greedy tokens and their
    log-probabilities are equal bit for bit alone and in two other batches with
    fusedattn.batch_invariant on (the example asserts it), and differ with it off."""
    example = EXAMPLE.parent / "batch_invariant.py"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FUSEDATTN_", "VLLM_", "TRITON_INTERPRET"))}  # fmt: skip
    result = subprocess.run([sys.executable, str(example), "--engine", "vllm"], env=env,
                            capture_output=True, text=True, timeout=600)  # fmt: skip
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    assert "equal bit for bit in all 3 batches" in result.stdout
    assert "with the switch off the log-probabilities differ" in result.stdout
