"""What each context-parallel strategy costs the kernels (issues #34, #72). On one GPU, no
communication timed:

- op "cp-blocks": every block call that W ranks of a causal zigzag ring make (all ranks, all
  steps), against one call on the whole sequence; T = 32k (1k with --quick), W = 4 and 8. The
  ratio (sum of block times / whole-sequence time) is the cut's compute efficiency (bar: 1.1).
- op "cp-ulysses": the one call a Ulysses rank makes, the whole sequence on Hq/W query heads
  and the K/V heads its queries read (Hkv/W, or one repeated head where W > Hkv), at W = 2, 4
  and 8 and T = 32k, 64k, 128k (32k with --quick); W x that time against the whole call is the
  ratio. The note gives the all-to-all bytes per rank, computed, not timed: forward
  (W - 1)/W · T/W · (2·Hq·D + 2·Hkv'·D) · 2 B in bf16 (q, k, v out, the output back), the
  backward the same again.

D = 128, Hq 32 / Hkv 8, bf16, forward and forward+backward. USP's local work is the ring's
blocks on H/U heads: the cp-blocks rows at W = R, scaled by 1/U. On a CPU (gloo, 2 processes)
op "cp-gloo" times each strategy's whole call with its real collectives on a small sequence:
that the paths run; their speed there means nothing.

    python benchmarks/bench_context_parallel.py [--quick] [--out DIR]
"""

from __future__ import annotations

import harness
import torch

import fusedattn
from fusedattn import distributed as cp


def blocks_of(world, rank, T, causal=True):
    cfg = cp._Config(world=world, rank=rank, T=T, layout="zigzag", window=(-1, 0 if causal else -1))
    return [(owner, blocks) for owner in range(world) if (blocks := cp._blocks_against(owner, cfg))]


def gloo_worker(rank, world, init_file):
    """Each strategy's whole call on 2 gloo ranks (the torch backend), forward, timed."""
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    T, H, D = 512, 4, 32
    q, k, v = (cp.shard_sequence(torch.randn(1, H, T, D, generator=g), 2) for _ in range(3))
    times = {}
    for strategy in ("ring", "allgather", "ulysses"):
        call = lambda s=strategy: cp.context_parallel_attention(  # noqa: E731
            q, k, v, is_causal=True, strategy=s, backend="torch"
        )
        call()
        start = time.perf_counter()
        for _ in range(5):
            call()
        times[strategy] = (time.perf_counter() - start) / 5 * 1e3
    dist.destroy_process_group()
    if rank == 0:
        torch.save(times, init_file + ".times")


def run_gloo(env: dict) -> list[dict]:
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        torch.multiprocessing.spawn(gloo_worker, args=(2, init_file), nprocs=2)
        times = torch.load(init_file + ".times")
    rows = []
    note = "CPU, gloo: the path runs, the speed means nothing"
    for strategy, ms in times.items():
        rows.append(harness.make_row(env, op="cp-gloo", mode="fwd", impl=f"{strategy} W=2",
                                     dtype="float32", B=1, H=4, Tq=512, Tk=512, D=32,
                                     causal=True, mask="zigzag causal", ms=ms, note=note))  # fmt: skip
        harness.progress(rows[-1])
    return rows


def ulysses_bytes(T: int, world: int, Hq: int, Hkv: int, D: int, element: int = 2) -> float:
    """Bytes one rank sends in a Ulysses forward: q, k, v out and the output back, each
    (W - 1)/W of the rank's shard (K/V heads repeated to lcm(Hkv, W) where W > Hkv)."""
    from fusedattn.distributed import ulysses

    kv_heads = Hkv * ulysses.kv_repeats(Hkv, world)
    n = T // world
    return (world - 1) / world * n * (2 * Hq * D + 2 * kv_heads * D) * element


def run_ulysses(quick, device, env, q, k, v, whole_ms) -> list[dict]:
    """The one attention call of a Ulysses rank, W = 2, 4, 8, against the whole call."""
    from fusedattn.distributed import ulysses

    rows = []
    B, Hq, T, D = q.shape
    Hkv = k.shape[1]
    for world in (2, 4, 8):
        r = ulysses.kv_repeats(Hkv, world)
        kv = (Hkv * r) // world
        qh = q[:, : Hq // world].contiguous()
        kh = k.repeat_interleave(r, 1)[:, :kv].contiguous()
        vh = v.repeat_interleave(r, 1)[:, :kv].contiguous()
        for mode in ("fwd", "fwd+bwd"):
            leaves = [t.detach().requires_grad_(mode != "fwd") for t in (qh, kh, vh)]

            def call(leaves=leaves, mode=mode):
                out = fusedattn.attention(*leaves, is_causal=True, enable_gqa=True,
                                          backend="triton")  # fmt: skip
                if mode != "fwd":
                    out.sum().backward()

            ms = harness.time_ms(call, device=device)
            sent = ulysses_bytes(T, world, Hq, Hkv, D) * (1 if mode == "fwd" else 2)
            flops = harness.attention_flops(B, Hq // world, T, T, D, causal=True, mode=mode)
            rows.append(harness.make_row(
                env, op="cp-ulysses", mode=mode, impl=f"fusedattn-triton W={world}",
                dtype="bfloat16", B=B, H=Hq, Tq=T, Tk=T, D=D, causal=True, mask="causal", ms=ms,
                tflops=harness.tflops(flops, ms),
                note=f"W x one rank's call / one whole call: {world * ms / whole_ms[mode]:.3f}; "
                     f"all-to-all bytes per rank {sent / 2**20:.1f} MiB (computed)",
            ))  # fmt: skip
            harness.progress(rows[-1])
    return rows


def whole_call_ms(device, env, q, k, v, rows, op, mask="causal") -> dict:
    """One call on the whole sequence, fwd and fwd+bwd (a row each)."""
    B, Hq, T, D = q.shape
    whole = {}
    for mode in ("fwd", "fwd+bwd"):
        leaves = [t.detach().requires_grad_(mode != "fwd") for t in (q, k, v)]

        def call(leaves=leaves, mode=mode):
            out = fusedattn.attention(*leaves, is_causal=True, enable_gqa=True, backend="triton")
            if mode != "fwd":
                out.sum().backward()

        whole[mode] = harness.time_ms(call, device=device)
        flops = harness.attention_flops(B, Hq, T, T, D, causal=True, mode=mode)
        rows.append(harness.make_row(env, op=op, mode=mode, impl="fusedattn-triton whole",
                                     dtype="bfloat16", B=B, H=Hq, Tq=T, Tk=T, D=D, causal=True,
                                     mask=mask, ms=whole[mode],
                                     tflops=harness.tflops(flops, whole[mode])))  # fmt: skip
        harness.progress(rows[-1])
    return whole


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    if device.type != "cuda":
        print("  cp-blocks, cp-ulysses: the Triton kernels time on a GPU only (the interpreter "
              "is not timed); cp-gloo: each strategy's call on 2 gloo ranks")  # fmt: skip
        return run_gloo(env)
    rows = []
    for T in (32768,) if quick else (32768, 65536, 131072):
        q = torch.randn(1, 32, T, 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, 8, T, 128, device=device, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        whole = whole_call_ms(device, env, q, k, v, rows, "cp-ulysses")
        rows += run_ulysses(quick, device, env, q, k, v, whole)
        del q, k, v
    return rows + run_blocks(quick, device, env)


def run_blocks(quick: bool, device: torch.device, env: dict) -> list[dict]:
    T = 1024 if quick else 32768
    B, Hq, Hkv, D = 1, 32, 8, 128
    q = torch.randn(B, Hq, T, D, device=device, dtype=torch.bfloat16)
    k = torch.randn(B, Hkv, T, D, device=device, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    flops = {
        m: harness.attention_flops(B, Hq, T, T, D, causal=True, mode=m) for m in ("fwd", "fwd+bwd")
    }
    rows = []
    whole = whole_call_ms(device, env, q, k, v, rows, "cp-blocks", "zigzag causal")
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
