"""LayerNorm and RMSNorm: fusedattn backends vs the naive path vs torch (F.layer_norm /
F.rms_norm, eager and torch.compile) vs Liger-Kernel, in GB/s and % of the measured copy
bandwidth.

    python benchmarks/bench_layernorm.py [--quick] [--out DIR]     (bench_rmsnorm.py likewise)

GPU inputs are 256 MB so the 50-60 MB L2 of an H100/H200 does not flatter the numbers.
Liger-Kernel is measured when it is importable (the GPU machine has no network: gpu-check
installs a wheel carried in .whl/); its RMSNorm runs with casting_mode="gemma" (all in fp32,
one rounding: F.rms_norm's semantics) and in_place=False (the harness reuses dy).
"""

from __future__ import annotations

import importlib.util

import harness
import torch
import torch.nn.functional as F

import fusedattn
from fusedattn import reference

GPU_INPUT_BYTES = 256 * 2**20
EPS = 1e-6


def cases(quick: bool, device: torch.device) -> list[tuple[int, int, torch.dtype]]:
    """(M, N, dtype) rows x normalized size."""
    if device.type != "cuda":
        return [(256, N, torch.float32) for N in (512, 1024, 4096)]
    sizes = (
        (1024, 4096, 8192, 32768) if quick else (512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
    )
    return [(GPU_INPUT_BYTES // (2 * N), N, torch.bfloat16) for N in sizes]


def liger_impls(op: str) -> dict:
    """Liger-Kernel's autograd functions for op, when it is installed."""
    if importlib.util.find_spec("liger_kernel") is None:
        print(f"  {op}: liger not measured: liger_kernel is not installed")
        return {}
    if op == "layer_norm":
        from liger_kernel.ops.layer_norm import LigerLayerNormFunction

        return {"liger": lambda x, w, b: LigerLayerNormFunction.apply(x, w, b, EPS)}
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return {"liger": lambda x, w, b: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "gemma", False)}


def implementations(op: str, device, quick: bool = True) -> dict:
    """{impl: fn(x, weight, bias) -> y} for op "layer_norm" or "rms_norm" (bias unused)."""
    if op == "layer_norm":
        naive = lambda x, w, b: reference.layer_norm(x, x.shape[-1:], w, b, EPS)  # noqa: E731
        eager = lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, EPS)  # noqa: E731
        ours = lambda x, w, b, be: fusedattn.layer_norm(x, x.shape[-1:], w, b, EPS, backend=be)  # noqa: E731
    else:
        naive = lambda x, w, b: reference.rms_norm(x, x.shape[-1:], w, EPS)  # noqa: E731
        eager = lambda x, w, b: F.rms_norm(x, x.shape[-1:], w, EPS)  # noqa: E731
        ours = lambda x, w, b, be: fusedattn.rms_norm(x, x.shape[-1:], w, EPS, backend=be)  # noqa: E731
    impls = {"naive": naive, "torch": eager}
    if device.type == "cuda":
        # The harness times the backward with retain_graph=True (one forward, many backwards),
        # which AOTAutograd's donated buffers refuse. (A name of its own: `import torch....`
        # here would make torch local to this function.)
        from torch._functorch import config as functorch_config

        functorch_config.donated_buffer = False
        compiled = torch.compile(eager)
        impls["torch-compile"] = lambda x, w, b: compiled(x, w, b)
        impls |= liger_impls(op)
    for backend in harness.kernel_backends(op, device):
        impls[f"fusedattn-{backend}"] = lambda x, w, b, be=backend: ours(x, w, b, be)
    return impls


def run_norm(op: str, quick: bool, device: torch.device, env: dict) -> list[dict]:
    impls = implementations(op, device, quick)
    naive = impls["naive"]
    rows = []
    for M, N, dtype in cases(quick, device):
        x = torch.randn(M, N, device=device, dtype=dtype)
        w = torch.randn(N, device=device, dtype=dtype)
        b = torch.randn(N, device=device, dtype=dtype)
        leaves = [x, w, b] if op == "layer_norm" else [x, w]

        def check(name, x=x, w=w, b=b):
            xs = x[:64]
            with torch.no_grad():
                return harness.correctness(
                    impls[name](xs, w, b), naive(xs.double(), w.double(), b.double()),
                    naive(xs, w, b),
                )  # fmt: skip

        def work(mode, M=M, N=N, x=x):
            # the parameters, and the fp32 statistics per row saved for backward (LayerNorm:
            # mean and rstd; RMSNorm: rstd)
            params, stats = (2, 8) if op == "layer_norm" else (1, 4)
            nbytes = harness.rowwise_bytes(
                M, N, x.element_size(), mode=mode, param_vectors=params, stat_bytes_per_row=stats
            )
            return None, nbytes

        rows += harness.measure(
            env, device, op=op, leaves=leaves, check=check,
            impls={n: (lambda *t, fn=fn, b=b: fn(t[0], t[1], t[2] if len(t) > 2 else b))
                   for n, fn in impls.items()},
            fields=dict(dtype=str(dtype)[6:], M=M, N=N), work=work,
        )  # fmt: skip
    harness.add_speedups(rows)
    return rows


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    return run_norm("layer_norm", quick, device, env)


if __name__ == "__main__":
    harness.cli(run, "layernorm.csv")
