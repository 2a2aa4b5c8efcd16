"""RMSNorm: fusedattn backends vs the naive path vs F.rms_norm (eager, torch.compile) vs
Liger-Kernel, in GB/s and % of the measured copy bandwidth (bench_layernorm.py's cases).

    python benchmarks/bench_rmsnorm.py [--quick] [--out DIR]
"""

from __future__ import annotations

import harness
import torch
from bench_layernorm import run_norm


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    return run_norm("rms_norm", quick, device, env)


if __name__ == "__main__":
    harness.cli(run, "rmsnorm.csv")
