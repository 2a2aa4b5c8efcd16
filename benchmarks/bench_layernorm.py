"""LayerNorm: fusedattn backends vs the naive path vs F.layer_norm, in GB/s.

    python benchmarks/bench_layernorm.py [--quick] [--out DIR]

GPU inputs are 256 MB so the 50-60 MB L2 of an H100/H200 does not flatter the numbers.
"""

from __future__ import annotations

import harness
import torch
import torch.nn.functional as F

import fusedattn
from fusedattn import reference

GPU_INPUT_BYTES = 256 * 2**20


def cases(quick: bool, device: torch.device) -> list[tuple[int, int, torch.dtype]]:
    """(M, N, dtype) rows x normalized size."""
    if device.type != "cuda":
        return [(256, N, torch.float32) for N in (512, 1024, 4096)]
    sizes = (1024, 4096, 8192) if quick else (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
    return [(GPU_INPUT_BYTES // (2 * N), N, torch.bfloat16) for N in sizes]


def implementations(device, quick: bool = True) -> dict:
    """{impl: fn(x, weight, bias) -> y}; torch.compile's kernel in full GPU runs."""
    impls = {
        "naive": lambda x, w, b: reference.layer_norm(x, x.shape[-1:], w, b),
        "torch": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b),
    }
    if device.type == "cuda" and not quick:
        compiled = torch.compile(F.layer_norm)
        impls["torch-compile"] = lambda x, w, b: compiled(x, x.shape[-1:], w, b)
    for backend in harness.kernel_backends("layer_norm", device):
        impls[f"fusedattn-{backend}"] = lambda x, w, b, be=backend: fusedattn.layer_norm(
            x, x.shape[-1:], w, b, backend=be
        )
    return impls


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    impls = implementations(device, quick)
    rows = []
    for M, N, dtype in cases(quick, device):
        x = torch.randn(M, N, device=device, dtype=dtype)
        w = torch.randn(N, device=device, dtype=dtype)
        b = torch.randn(N, device=device, dtype=dtype)

        def check(name, x=x, w=w, b=b):
            xs = x[:64]
            with torch.no_grad():
                return harness.correctness(
                    impls[name](xs, w, b),
                    reference.layer_norm(xs.double(), xs.shape[-1:], w.double(), b.double()),
                    reference.layer_norm(xs, xs.shape[-1:], w, b),
                )

        def work(mode, M=M, N=N, x=x):
            size = x.element_size()
            # weight + bias, and fp32 mean + rstd per row saved for backward
            nbytes = harness.rowwise_bytes(
                M, N, size, mode=mode, param_vectors=2, stat_bytes_per_row=8
            )
            return None, nbytes

        rows += harness.measure(
            env, device, op="layer_norm", impls=impls, leaves=[x, w, b], check=check,
            fields=dict(dtype=str(dtype)[6:], M=M, N=N), work=work,
        )  # fmt: skip
    harness.add_speedups(rows)
    return rows


if __name__ == "__main__":
    harness.cli(run, "layernorm.csv")
