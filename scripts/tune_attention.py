"""Tile variants of the CUDA attention (bf16; D=128 forward and backward, D=64 forward) side by
side, with SDPA's flash backend in the same run: TFLOP/s at B=4, H=16, T=4096 (ENVIRONMENT.md's
comparison point), causal and not. Needs a tuning build (FUSEDATTN_TUNING=1 at build time);
each variant is checked against the policy's output before it is timed.

    python3 scripts/tune_attention.py [--out DIR]

The variants are listed in csrc/attention/attention_launch.cuh (FUSEDATTN_TUNE_FWD / _DQ /
_DKDV); 0 is the shipped policy.
"""

import argparse
import csv
import os
from pathlib import Path

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedattn

FWD = {  # per head dim
    128: {
        0: "128x64 4w (policy)",
        1: "128x32 4w",
        2: "64x64 4w",
        3: "128x64 8w",
        4: "64x64 4w 3blk",
    },
    64: {0: "128x64 4w (policy)", 5: "128x128 4w", 6: "128x128 8w"},
}
DQ = {0: "64x64 4w (policy)", 1: "64x32 4w", 2: "128x64 8w", 3: "64x32 4w 3blk"}
DKDV = {0: "64x64 4w (policy)", 1: "64k x 32q 4w", 2: "128k x 64q 8w"}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def backward(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad, retain_graph=True)


def tune_case(q, k, v, grad, causal: bool, with_backward: bool) -> list[dict]:
    B, H, T, D = q.shape
    fwd_flops = 4 * B * H * T * T * D / (2 if causal else 1)
    bwd_flops = 2.5 * fwd_flops  # the flash-attention papers' count
    rows = []

    def record(kind, name, ms, flops, err=0.0):
        tflops = flops / ms / 1e9
        rows.append(dict(head_dim=D, causal=causal, kind=kind, variant=name, ms=round(ms, 4),
                         tflops=round(tflops, 1), max_err_vs_policy=err))  # fmt: skip
        print(f"D={D} causal={causal!s:5} {kind:4} {name:24} {ms:8.3f} ms {tflops:7.1f} TFLOP/s"
              f"  max|diff| vs policy {err:.3g}")  # fmt: skip

    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out = sdpa(q, k, v, is_causal=causal)
        record("fwd", "sdpa-flash", bench(lambda: sdpa(q, k, v, is_causal=causal)), fwd_flops)
        record("bwd", "sdpa-flash", bench(lambda: backward(out, (q, k, v), grad)), bwd_flops)

    def attention():
        return fusedattn.attention(q, k, v, is_causal=causal, backend="cuda")

    os.environ.update(FUSEDATTN_TUNE_FWD="0", FUSEDATTN_TUNE_DQ="0", FUSEDATTN_TUNE_DKDV="0")
    want = attention()
    want_grads = backward(want, (q, k, v), grad)
    for variant, name in FWD[D].items():
        os.environ["FUSEDATTN_TUNE_FWD"] = str(variant)
        err = (attention() - want).abs().max().item()
        record("fwd", name, bench(attention), fwd_flops, err)
    os.environ["FUSEDATTN_TUNE_FWD"] = "0"
    if not with_backward:
        return rows
    for env, variants in (("FUSEDATTN_TUNE_DQ", DQ), ("FUSEDATTN_TUNE_DKDV", DKDV)):
        label = env.rsplit("_", 1)[-1].lower()
        for variant, name in variants.items():
            os.environ[env] = str(variant)
            grads = backward(want, (q, k, v), grad)
            err = max((a - b).abs().max().item() for a, b in zip(grads, want_grads, strict=True))
            ms = bench(lambda: backward(want, (q, k, v), grad))
            record("bwd", f"{label} {name}", ms, bwd_flops, err)
        os.environ[env] = "0"
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    for head_dim in (128, 64):  # backward variants at D=128 only
        shape = (4, 16, 4096, head_dim)  # B, H, T, D
        q, k, v = (
            torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        for causal in (False, True):
            rows += tune_case(q, k, v, grad, causal, with_backward=head_dim == 128)
    if args.out:
        path = Path(args.out) / "tune_attention.csv"
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
