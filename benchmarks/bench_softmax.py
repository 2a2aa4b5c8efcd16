"""Softmax: fusedattn backends vs the naive path vs torch.softmax, plain and masked, in GB/s.

    python benchmarks/bench_softmax.py [--quick] [--out DIR]

The masked case takes a dense bool mask (1 byte per element, counted in the forward bytes);
torch's path for it is the usual masked_fill + softmax. Liger-Kernel's softmax (no mask) is
measured when it is importable (bench_layernorm.py says how it reaches the GPU machine).
"""

from __future__ import annotations

import importlib.util

import harness
import torch

import fusedattn
from fusedattn import reference

GPU_INPUT_BYTES = 256 * 2**20


def cases(quick: bool, device: torch.device) -> list[tuple[int, int, torch.dtype, str]]:
    """(M, N, dtype, mask) rows x row length."""
    if device.type != "cuda":
        return [(256, N, torch.float32, m) for N in (512, 4096) for m in ("none", "bool")]
    sizes = (
        (1024, 4096, 8192, 32768) if quick else (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
    )
    return [
        (GPU_INPUT_BYTES // (2 * N), N, torch.bfloat16, m) for N in sizes for m in ("none", "bool")
    ]


def implementations(device, quick: bool = True) -> dict:
    """{impl: fn(x, keep) -> y}; keep is None or a bool mask (True = keep); torch.compile's
    kernel in full GPU runs."""

    def torch_softmax(x, keep):
        if keep is not None:
            x = x.masked_fill(~keep, float("-inf"))
        return torch.softmax(x, dim=-1)

    impls = {"naive": lambda x, keep: reference.softmax(x, -1, mask=keep), "torch": torch_softmax}
    if device.type == "cuda":
        # donated buffers refuse the harness's retain_graph=True (a name of its own: `import
        # torch....` here would make torch local to this function)
        from torch._functorch import config as functorch_config

        functorch_config.donated_buffer = False
        impls["torch-compile"] = torch.compile(torch_softmax)
        if importlib.util.find_spec("liger_kernel") is not None:
            from liger_kernel.ops.softmax import LigerSoftmaxFunction

            def liger(x, keep):
                if keep is not None:
                    raise ValueError("Liger's softmax takes no mask")
                return LigerSoftmaxFunction.apply(x)

            impls["liger"] = liger
    for backend in harness.kernel_backends("softmax", device):
        impls[f"fusedattn-{backend}"] = lambda x, keep, be=backend: fusedattn.softmax(
            x, -1, mask=keep, backend=be
        )
    return impls


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    impls = implementations(device, quick)
    rows = []
    for M, N, dtype, mask in cases(quick, device):
        x = torch.randn(M, N, device=device, dtype=dtype) * 4
        keep = torch.rand(M, N, device=device) > 0.1 if mask == "bool" else None

        def check(name, x=x, keep=keep):
            xs, ks = x[:64], None if keep is None else keep[:64]
            with torch.no_grad():
                return harness.correctness(
                    impls[name](xs, ks),
                    reference.softmax(xs.double(), -1, mask=ks),
                    reference.softmax(xs, -1, mask=ks),
                )

        def work(mode, M=M, N=N, x=x, keep=keep):
            size = x.element_size()
            nbytes = harness.rowwise_bytes(M, N, size, mode=mode)
            if keep is not None and mode != "bwd":
                nbytes += M * N  # the bool mask, read once in the forward
            return None, nbytes

        rows += harness.measure(
            env, device, op="softmax",
            impls={n: (lambda x, fn=fn, keep=keep: fn(x, keep)) for n, fn in impls.items()},
            leaves=[x], check=check,
            fields=dict(dtype=str(dtype)[6:], M=M, N=N, mask=mask), work=work,
        )  # fmt: skip
    harness.add_speedups(rows)
    return rows


if __name__ == "__main__":
    harness.cli(run, "softmax.csv")
