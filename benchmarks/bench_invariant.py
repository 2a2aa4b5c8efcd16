"""What batch invariance costs (issue #73). Decoding: attention_with_kvcache with
fusedattn.batch_invariant off and on, Llama-3-8B's heads (Hq 32, Hkv 8, D 128), bf16,
contiguous caches of 8k and 32k keys, batch 1, 8 and 64, in GB/s of K/V read and % of the copy
rate measured in the same run. Each "on" row also checks the property on the card's compiled
kernels: sequence 0 decoded alone gives the bits it gets inside the batch.

The projections: fusedattn.linear's batch-invariant Triton matmul against torch's F.linear
(cuBLAS) on Llama-3-8B's shapes (4096 -> 4096, 4096 -> 14336, 14336 -> 4096), M = 1, 8, 64
rows (decode steps) and 4096 (a prefill), in TFLOP/s and GB/s of weight read; each "on" row
checks that row 0 alone has the bits it has among the M.

Targets (issue #73): decode on <= 10 % slower than off at B >= 8; at B = 1, 32k, >= 70 % of the
copy rate. The matmul has none in the issue: its price is measured, and stated in
docs/batch_invariance.md. On a CPU (the interpreter; its speed means nothing) --quick runs the structure on a tiny
cache.

    python benchmarks/bench_invariant.py [--quick] [--out DIR]
"""

from __future__ import annotations

import harness
import torch

import fusedattn

HQ, HKV, D = 32, 8, 128


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    hq, hkv, dim = (HQ, HKV, D) if on_gpu else (4, 2, 16)
    shapes = [(b, L) for L in (8192, 32768) for b in (1, 8, 64)] if on_gpu else [(1, 96), (4, 96)]
    if quick and on_gpu:
        shapes = [(1, 32768), (8, 32768)]
    copy = harness.copy_gbps(device) if on_gpu else None
    rows = []
    for B, L in shapes:
        if on_gpu and B * L * hkv * dim * 2 * 2 > 40 * 2**30:
            continue
        g = torch.Generator(device=device).manual_seed(0)
        k = torch.randn(B, L, hkv, dim, device=device, dtype=dtype, generator=g)
        v = torch.randn(B, L, hkv, dim, device=device, dtype=dtype, generator=g)
        q = torch.randn(B, 1, hq, dim, device=device, dtype=dtype, generator=g)
        seqlens = torch.full((B,), L, dtype=torch.int32, device=device)
        nbytes = B * L * hkv * dim * 2 * k.element_size()
        times = {}
        for mode in ("off", "on"):
            with fusedattn.batch_invariant(mode == "on"):

                def call(q=q, k=k, v=v, seqlens=seqlens):
                    return fusedattn.attention_with_kvcache(q, k, v, cache_seqlens=seqlens,
                                                            backend="triton")  # fmt: skip

                times[mode] = harness.time_ms(call, device=device)
                note = ""
                if mode == "on":
                    alone = fusedattn.attention_with_kvcache(
                        q[:1], k[:1], v[:1], cache_seqlens=seqlens[:1], backend="triton"
                    )
                    same = torch.equal(alone, call()[:1])
                    note = f"sequence 0 alone == in the batch: {same}; "
                    note += f"{times['on'] / times['off']:.3f}x the switch off"
            gbps = harness.gbps(nbytes, times[mode])
            rows.append(harness.make_row(
                env, op="decode-invariant", mode="fwd", impl=f"fusedattn-triton {mode}",
                dtype=str(dtype).replace("torch.", ""), B=B, H=hq, Tq=1, Tk=L, D=dim,
                mask="contiguous", ms=times[mode], gbps=gbps,
                pct_of_copy=100.0 * gbps / copy if copy else None, note=note,
            ))  # fmt: skip
            harness.progress(rows[-1])
    return rows + matmul_rows(quick, device, env)


LLAMA_PROJECTIONS = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (in_features, out_features)


def matmul_rows(quick: bool, device: torch.device, env: dict) -> list[dict]:
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    shapes = LLAMA_PROJECTIONS if on_gpu else [(96, 80)]
    counts = (1, 8, 64, 4096) if on_gpu else (1, 8)
    if quick and on_gpu:
        shapes, counts = shapes[:1], (8, 4096)
    rows = []
    for in_f, out_f in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        w = torch.randn(out_f, in_f, device=device, dtype=dtype, generator=g) / in_f**0.5
        for M in counts:
            x = torch.randn(M, in_f, device=device, dtype=dtype, generator=g)
            times = {}
            for impl, backend in (("torch F.linear", "torch"), ("fusedattn-triton on", "triton")):

                def call(x=x, w=w, backend=backend):
                    return fusedattn.linear(x, w, backend=backend)

                times[impl] = harness.time_ms(call, device=device)
                note = f"K={in_f}"
                if backend == "triton":
                    same = torch.equal(fusedattn.linear(x[:1], w, backend="triton"), call()[:1])
                    note += f"; row 0 alone == among the {M}: {same}; "
                    note += f"{times[impl] / times['torch F.linear']:.3f}x torch's time"
                rows.append(harness.make_row(
                    env, op="linear-invariant", mode="fwd", impl=impl,
                    dtype=str(dtype).replace("torch.", ""), M=M, N=out_f, ms=times[impl],
                    tflops=harness.tflops(2.0 * M * in_f * out_f, times[impl]),
                    gbps=harness.gbps(w.numel() * w.element_size(), times[impl]), note=note,
                ))  # fmt: skip
                harness.progress(rows[-1])
    return rows


if __name__ == "__main__":
    harness.cli(run, "invariant.csv")
