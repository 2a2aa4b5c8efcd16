"""The CUDA attention's two backwards side by side: "split" (dQ kernel + dK/dV kernel) and
"fused" (one pass per key block, per-split fp32 dQ partials, a summing kernel), with SDPA's
flash backend in the same run: backward TFLOP/s (2.5x the forward's FLOPs, the flash-attention
papers' count) for bf16, H=16, B*T = 16k tokens, D=64 and 128, causal and not, with and
without key padding (those rows count T^2 FLOPs: nominal, the same for both). Each fused
result is checked against the split one first (max_err_vs_split). Decides
attention_launch.cuh's kFusedBackwardByDefault (issue #13). No tuning build needed.

    python3 scripts/tune_cuda_backward.py [--out DIR] [--lengths 1024,4096]
"""

import argparse
import csv
import os
from pathlib import Path

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedattn
from fusedattn import masks
from fusedattn.ops.attention import cuda_args as flash_attention
from fusedattn.ops.core.kernels import extension

ENV = flash_attention.CUDA_BACKWARD_ENV


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def planned_splits(q, k, v, causal, kpm):
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    return extension().attention_bwd_dq_splits(
        q, k, v, out, lse, None, kpm, causal, q.shape[-1] ** -0.5, 0.0, None,
        flash_attention.CUDA_BACKWARD_KERNELS["fused"],
    )  # fmt: skip


def tune_case(T, D, causal, padded) -> list[dict]:
    B, H = max(1, 16384 // T), 16
    q, k, v = (
        torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for _ in range(3)
    )
    grad = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    kpm = None
    if padded:  # lengths uniform in [T/2, T], as bench_attention's key_padding rows
        lengths = torch.randint(T // 2, T + 1, (B,), generator=torch.Generator().manual_seed(0))
        kpm = masks.padding_mask_from_lengths(lengths, T).cuda()
    flops = 2.5 * 4 * B * H * T * T * D / (2 if causal else 1)
    rows = []

    def record(name, ms, err=0.0, splits=""):
        tflops = flops / ms / 1e9
        rows.append(dict(T=T, B=B, H=H, head_dim=D, causal=causal, key_padding=padded,
                         backward=name, dq_splits=splits, ms=round(ms, 4),
                         tflops=round(tflops, 1), max_err_vs_split=err))  # fmt: skip
        print(f"T={T:5} D={D:3} causal={causal!s:5} padded={padded!s:5} {name:10} {ms:8.3f} ms "
              f"{tflops:7.1f} TFLOP/s  splits={splits}  max|diff| vs split {err:.3g}")  # fmt: skip

    if not padded:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            record("sdpa-flash", bench(lambda: torch.autograd.grad(out, (q, k, v), grad,
                                                                   retain_graph=True)))  # fmt: skip
    out = fusedattn.attention(q, k, v, is_causal=causal, key_padding_mask=kpm, backend="cuda")

    def backward():
        return torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)

    want = None
    for name in ("split", "fused"):
        os.environ[ENV] = name
        grads = backward()
        if want is None:
            want = grads
        err = max(
            (a.float() - b.float()).abs().max().item() for a, b in zip(grads, want, strict=True)
        )
        splits = (
            planned_splits(q.detach(), k.detach(), v.detach(), causal, kpm)
            if name == "fused"
            else 0
        )
        record(name, bench(backward), err, splits)
    os.environ.pop(ENV, None)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    parser.add_argument("--lengths", default="1024,4096")
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    path = Path(args.out) / "tune_cuda_backward.csv" if args.out else None
    for T in (int(x) for x in args.lengths.split(",")):
        for D in (128, 64):
            for causal in (False, True):
                for padded in (False, True):
                    rows += tune_case(T, D, causal, padded)
                    if path:  # after every case: a step cut by its limit keeps its rows
                        with path.open("w", newline="") as f:
                            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
                            writer.writeheader()
                            writer.writerows(rows)
    if path:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
