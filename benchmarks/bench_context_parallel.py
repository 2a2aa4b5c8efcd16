"""What cutting a sequence costs the kernels under context parallelism (issue #34): on one GPU,
every block call that W ranks of a causal zigzag ring make (the blocks of all ranks and all
steps, no communication), timed against one call on the whole sequence.

    python benchmarks/bench_context_parallel.py [--quick] [--out DIR]

T = 32k (1k with --quick or on a CPU), D = 128, Hq 32 / Hkv 8, bf16, W = 4 and 8; forward and
forward+backward. The ratio (sum of block times / whole-sequence time) is the compute
efficiency of the cut: the issue's bar is at most 1.1. Rows: op "cp-blocks", impl
"fusedattn-triton W=<W>" and "fusedattn-triton whole", mask = "zigzag causal".
"""

from __future__ import annotations

import harness
import torch

import fusedattn
from fusedattn import distributed as cp


def blocks_of(world, rank, T, causal=True):
    cfg = cp._Config(world=world, rank=rank, T=T, layout="zigzag", window=(-1, 0 if causal else -1))
    return [(owner, blocks) for owner in range(world) if (blocks := cp._blocks_against(owner, cfg))]


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    backend = "triton" if device.type == "cuda" else None
    if backend is None:
        print("  cp-blocks: the Triton kernels time on a GPU only (the interpreter is not timed)")
        return []
    T = 1024 if quick else 32768
    B, Hq, Hkv, D = 1, 32, 8, 128
    q = torch.randn(B, Hq, T, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, T, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = {
        m: harness.attention_flops(B, Hq, T, T, D, causal=True, mode=m) for m in ("fwd", "fwd+bwd")
    }
    rows = []
    whole = {}
    for mode in ("fwd", "fwd+bwd"):
        leaves = [t.detach().requires_grad_(mode != "fwd") for t in (q, k, v)]

        def call(leaves=leaves, mode=mode):
            out = fusedattn.attention(*leaves, is_causal=True, enable_gqa=True, backend="triton")
            if mode != "fwd":
                out.sum().backward()

        whole[mode] = harness.time_ms(call, device=device)
        rows.append(harness.make_row(env, op="cp-blocks", mode=mode, impl="fusedattn-triton whole",
                                     dtype="bfloat16", B=B, H=Hq, Tq=T, Tk=T, D=D, causal=True,
                                     mask="zigzag causal", ms=whole[mode],
                                     tflops=harness.tflops(flops[mode], whole[mode])))  # fmt: skip
        harness.progress(rows[-1])
    for world in (4, 8):
        for mode in ("fwd", "fwd+bwd"):
            total = 0.0  # every block of every rank, one after the other
            for rank in range(world):
                cfg = cp._Config(world=world, rank=rank, T=T, layout="zigzag", window=(-1, 0),
                                 scale=None, scale_value=D**-0.5, softcap=0.0, enable_gqa=True,
                                 backend="triton")  # fmt: skip
                for _owner, blocks in blocks_of(world, rank, T):
                    for blk in blocks:  # the block's rows and keys, at their global positions
                        nq = blk.rows.stop - blk.rows.start
                        nk = blk.keys.stop - blk.keys.start
                        qb = q[:, :, blk.q_global : blk.q_global + nq]
                        kb = k[:, :, blk.k_global : blk.k_global + nk]
                        vb = v[:, :, blk.k_global : blk.k_global + nk]

                        def call(qb=qb, kb=kb, vb=vb, window=blk.window, cfg=cfg, mode=mode):
                            out, lse = cp._block_forward(qb, kb, vb, window, cfg)
                            if mode != "fwd":
                                cp._block_backward(out.to(qb.dtype), qb, kb, vb, out, lse,
                                                   window, cfg)  # fmt: skip

                        total += harness.time_ms(call, device=device)
            ratio = total / whole[mode]
            rows.append(harness.make_row(
                env, op="cp-blocks", mode=mode, impl=f"fusedattn-triton W={world}",
                dtype="bfloat16", B=B, H=Hq, Tq=T, Tk=T, D=D, causal=True, mask="zigzag causal",
                ms=total, tflops=harness.tflops(flops[mode], total),
                note=f"sum of every rank's block calls / one whole call: {ratio:.3f}",
            ))  # fmt: skip
            harness.progress(rows[-1])
    return rows


if __name__ == "__main__":
    harness.cli(run, "context_parallel.csv")
