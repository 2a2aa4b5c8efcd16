"""Time the Triton LayerNorm, RMSNorm and softmax kernels under candidate warp counts and row
paths (issue #14) and say which win, against the device copy and eager torch in the same run.

    python scripts/tune_norms.py [--out DIR] [--n 1024,4096,8192,16384,32768]

For each op and row length N (bf16, 256 MB inputs so the L2 does not flatter anyone): the
forward at every warp count of WARPS (the shipped choice marked), and forward+backward with
the shipped config and, for rows the backward can hold in registers or loop over, both of its
paths; GB/s of the bytes each must move (harness.rowwise_bytes) and % of the copy bandwidth
measured in the same run; the largest difference from the shipped config's output (a warp
count changes the reduction order only: a large difference is a bug). Writes
tune_norms.csv into DIR.

The candidates come from the sm_90 static screen (scripts/static_norms.py,
benchmarks/results/sm90-static/norms.csv): fewer warps per row, fewer instructions per
element, until registers spill. Without a GPU it runs a tiny dry run in the interpreter (the
same code path, no timing worth reading).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

WARPS = (4, 8, 16)
OPS = ("layer_norm", "rms_norm", "softmax")
GPU_INPUT_BYTES = 256 * 2**20


@contextlib.contextmanager
def forced_config(op: str, warps: int | None = None, backward_one_pass: bool | None = None):
    """The op's kernel config with `warps` and, for the LayerNorm/RMSNorm backward, its row
    path forced (None: as shipped; looped: blocks of LOOP_BLOCK_N)."""
    from fusedattn.triton_kernels import layernorm as LN
    from fusedattn.triton_kernels import softmax as SM

    module, name = (SM, "softmax_config") if op == "softmax" else (LN, "layer_norm_config")
    original = getattr(module, name)
    saved_bwd = getattr(module, "MAX_ONE_PASS_BWD_N", None)

    def patched(n, max_one_pass_n=module.MAX_ONE_PASS_N):
        cfg = original(n, max_one_pass_n)
        if warps is not None and cfg.one_pass:
            cfg = dataclasses.replace(cfg, num_warps=warps)
        return cfg

    setattr(module, name, patched)
    if backward_one_pass is not None and saved_bwd is not None:
        module.MAX_ONE_PASS_BWD_N = (
            module.MAX_ONE_PASS_N if backward_one_pass else module.LOOP_BLOCK_N
        )
    try:
        yield
    finally:
        setattr(module, name, original)
        if saved_bwd is not None:
            module.MAX_ONE_PASS_BWD_N = saved_bwd


def call(op: str, x, w, b):
    import fusedattn

    n = x.shape[-1]
    if op == "layer_norm":
        return fusedattn.layer_norm(x, (n,), w, b, 1e-6, backend="triton")
    if op == "rms_norm":
        return fusedattn.rms_norm(x, (n,), w, 1e-6, backend="triton")
    return fusedattn.softmax(x, -1, backend="triton")


def eager(op: str, x, w, b):
    import torch.nn.functional as F

    n = x.shape[-1]
    if op == "layer_norm":
        return F.layer_norm(x, (n,), w, b, 1e-6)
    if op == "rms_norm":
        return F.rms_norm(x, (n,), w, 1e-6)
    return x.softmax(-1)


def tune(op: str, n: int, device, copy_gbps) -> list[dict]:
    import harness
    import torch

    from fusedattn.triton_kernels import layernorm as LN
    from fusedattn.triton_kernels import softmax as SM

    gpu = device.type == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    M = GPU_INPUT_BYTES // (2 * n) if gpu else 4
    x = torch.randn(M, n, device=device, dtype=dtype, requires_grad=True)
    w = torch.randn(n, device=device, dtype=dtype, requires_grad=True) if op != "softmax" else None
    b = (
        torch.randn(n, device=device, dtype=dtype, requires_grad=True)
        if op == "layer_norm"
        else None
    )
    dy = torch.randn(M, n, device=device, dtype=dtype)
    params = [t for t in (w, b) if t is not None]
    size = x.element_size()
    stats = 8 if op == "layer_norm" else 4 if op == "rms_norm" else 0
    moved = {mode: harness.rowwise_bytes(M, n, size, mode=mode, param_vectors=len(params),
                                         stat_bytes_per_row=stats)
             for mode in ("fwd", "fwd+bwd")}  # fmt: skip
    config = (SM.softmax_config if op == "softmax" else LN.layer_norm_config)(n)
    rows = []

    def record(mode, variant, fn, reference=None):
        out = fn()
        err = 0.0
        if reference is not None:
            got = out if torch.is_tensor(out) else torch.cat([g.flatten() for g in out])
            err = (got.float() - reference.float()).abs().max().item()
        ms, spread = harness.time_stats(fn, device=device)
        gbps = harness.gbps(moved[mode], ms)
        row = dict(op=op, N=n, M=M, mode=mode, variant=variant, ms=round(ms, 4),
                   gbps=round(gbps, 1),
                   pct_of_copy=round(100 * gbps / copy_gbps, 1) if copy_gbps else None,
                   max_diff=f"{err:.3g}", note=harness.noisy(spread).lstrip("; "))  # fmt: skip
        print("  " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        rows.append(row)
        return out

    def fwd():
        with torch.no_grad():
            return call(op, x, w, b)

    def fwd_bwd():
        return torch.autograd.grad(call(op, x, w, b), [x, *params], dy)

    record("fwd", "eager torch", lambda: eager(op, x.detach(), w, b))
    shipped = record("fwd", f"shipped ({config.num_warps}w)", fwd)
    for warps in WARPS:
        if config.one_pass and warps != config.num_warps:
            with forced_config(op, warps=warps):
                record("fwd", f"{warps}w", fwd, shipped)
    record("fwd+bwd", "eager torch",
           lambda: torch.autograd.grad(eager(op, x, w, b), [x, *params], dy))  # fmt: skip
    grads = record("fwd+bwd", "shipped", fwd_bwd)
    reference = torch.cat([g.flatten() for g in grads])
    if op != "softmax" and config.one_pass and n > LN.LOOP_BLOCK_N:  # the backward's two paths
        for one_pass in (True, False):
            with forced_config(op, backward_one_pass=one_pass):
                label = "bwd one-pass" if one_pass else "bwd looped"
                record("fwd+bwd", label, fwd_bwd, reference)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--n", default="1024,4096,8192,16384,32768")
    parser.add_argument("--ops", default=",".join(OPS))
    args = parser.parse_args(argv)
    import harness
    import torch

    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if gpu else "cpu")
    copy = harness.copy_gbps(device)
    print(f"device copy: {copy} GB/s", flush=True)
    sizes = [int(n) for n in args.n.split(",")] if gpu else [64, 4100]  # both backward paths
    rows = []
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "tune_norms.csv"
    fields = ["op", "N", "M", "mode", "variant", "ms", "gbps", "pct_of_copy", "max_diff", "note"]
    for op in args.ops.split(","):
        for n in sizes:
            rows += tune(op, n, device, copy)
            with path.open("w", newline="") as f:  # after every case: a cut step keeps the rest
                writer = csv.DictWriter(f, fieldnames=fields)
                writer.writeheader()
                writer.writerows(rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
