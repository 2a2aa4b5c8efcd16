"""MLA decoding (issue #83): `fusedattn.mla_attention_with_kvcache` over a paged latent cache
(DeepSeek's 512 + 64 columns, one new query), against the copy rate and the tensor-core peak
measured in the same run, and vLLM's TRITON_MLA kernel where vLLM is importable.

Grid (GPU): Hq = 16 (memory-bound, as at TP 8) and 128 (compute-bound, TP 1); B = 1, 8, 64,
128; caches of 4k and 32k keys per sequence; bf16 and fp8 (e4m3) caches; pages of 64 and 16.
Columns: ms, GB/s of latent read (B x L x 576 x bytes) and its share of the copy rate in the
note, TFLOP/s at 2176 FLOP per key x head x query (2 x (576 + 512)). Targets (issue #83):
memory-bound rows >= 80 % of the copy rate; Hq = 128 >= 330 TFLOP/s; fp8 >= 1.7x bf16 at
B >= 8.

On a CPU only the structure runs (one tiny call per path through the interpreter or the torch
backend; its speed means nothing), so CI runs the script.

    python benchmarks/bench_mla.py [--quick] [--out DIR]
"""

from __future__ import annotations

import harness
import torch

import fusedattn

DL, DR = 512, 64
FLOP_PER_KEY = 2 * (DL + DR + DL)  # QK over 576 columns, PV over 512


def _case(B, Hq, L, page, dtype, device, fp8=False):
    pages_per_seq = -(-L // page)
    g = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn(B * pages_per_seq, page, DL + DR, device=device, dtype=torch.bfloat16,
                        generator=g)  # fmt: skip
    descale = None
    if fp8:
        descale = torch.tensor(cache.abs().amax().item() / 448.0, device=device)
        cache = fusedattn.fp8.quantize(cache, descale, torch.float8_e4m3fn)
    table = torch.randperm(B * pages_per_seq, device=device, generator=g).int().view(B, -1)
    q = torch.randn(B, 1, Hq, DL + DR, device=device, dtype=dtype, generator=g)
    seqlens = torch.full((B,), L, device=device, dtype=torch.int32)
    return q, cache, table, seqlens, descale


def _vllm_triton_mla(q, cache, table, seqlens, scale):
    """vLLM's TRITON_MLA decode kernel on the same cache, or None where vLLM is missing."""
    try:
        from vllm.v1.attention.ops.triton_decode_attention import decode_attention_fwd
    except Exception:  # any import failure: no baseline
        return None
    B, _, Hq, _ = q.shape
    o = torch.empty(B, Hq, DL, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    splits = 8
    logits = torch.empty(B, Hq, splits, DL + 1, dtype=torch.float32, device=q.device)
    kv = cache.unsqueeze(2)

    def call():
        decode_attention_fwd(q[:, 0], kv, kv[..., :DL], o, lse, table, seqlens, logits,
                             splits, scale, cache.shape[1], is_mla=True)  # fmt: skip

    return call


def gpu_rows(env, device, quick: bool) -> list[dict]:
    rows = []
    copy = harness.copy_gbps(device)
    grid = [(Hq, B, L, page, fp8) for Hq in (16, 128) for B in (1, 8, 64, 128)
            for L in (4096, 32768) for page in (64, 16) for fp8 in (False, True)]  # fmt: skip
    if quick:
        grid = [g for g in grid if g[1] in (1, 64) and g[2] == 4096 and g[3] == 64]
    for Hq, B, L, page, fp8 in grid:
        if B * L * (DL + DR) * (1 if fp8 else 2) > 40 * 2**30:
            continue  # past the card's memory with room to spare
        q, cache, table, seqlens, descale = _case(B, Hq, L, page, torch.bfloat16, device, fp8)
        scale = (DL + DR) ** -0.5

        def ours(q=q, cache=cache, seqlens=seqlens, table=table, descale=descale):
            return fusedattn.mla_attention_with_kvcache(
                q, cache, cache_seqlens=seqlens, block_table=table, head_dim_v=DL,
                kv_descale=descale, backend="triton",
            )  # fmt: skip

        impls = {"fusedattn-triton": ours}
        if not fp8:
            baseline = _vllm_triton_mla(q, cache, table, seqlens, scale)
            if baseline is not None:
                impls["vllm-triton-mla"] = baseline
        nbytes = B * L * (DL + DR) * cache.element_size()
        for impl, fn in impls.items():
            ms = harness.time_ms(fn, device=device)
            gbps = harness.gbps(nbytes, ms)
            share = f"{100 * gbps / copy:.0f} % of copy ({copy:.0f} GB/s)" if copy else ""
            rows.append(harness.make_row(
                env, op="mla-decode", mode="fwd", impl=impl, dtype="bfloat16", B=B, H=Hq,
                Tq=1, Tk=L, D=DL + DR, mask=f"paged{page}" + (" fp8" if fp8 else ""), ms=ms,
                gbps=gbps, tflops=harness.tflops(B * Hq * L * FLOP_PER_KEY, ms), note=share,
            ))  # fmt: skip
            harness.progress(rows[-1])
    return rows


def _sparse_indices(table, B, Tq, L, page, topk, device):
    """Each query's topk distinct keys of its sequence's L, as cache slots (block x page +
    offset): what DeepSeek-V3.2's indexer hands the kernel."""
    g = torch.Generator(device=device).manual_seed(1)
    pos = torch.rand(B * Tq, L, device=device, generator=g).argsort(dim=-1)[:, :topk]
    pos = pos.view(B, Tq, topk)
    pages = table.long().gather(1, (pos // page).view(B, -1)).view(B, Tq, topk)
    return (pages * page + pos % page).int()


def sparse_rows(env, device, quick: bool) -> list[dict]:
    """DeepSeek sparse attention (issue #85): decode over each query's 2048 listed keys at
    B = 1, 32, 128, Hq = 16 and 128, Tq = 1 and 2 (MTP), caches of 8k and 32k, bf16, fp8
    (e4m3, per-tensor descale) and DeepSeek's 656-byte rows; and the sparse prefill at Sq = Skv = 8k, Hq = 128. GB/s over
    the rows actually gathered (B x Tq x topk x 576 x bytes) against the copy rate, TFLOP/s at
    2176 FLOP per listed key x head x query. Targets: fp8 decode at B = 128, Hq = 128, Tq = 2
    >= 200 TFLOP/s; memory-bound rows >= 70 % of the copy rate over the gathered bytes."""
    rows = []
    copy = harness.copy_gbps(device)
    topk, page = 2048, 64
    grid = [(Hq, B, Tq, L, fmt) for Hq in (16, 128) for B in (1, 32, 128) for Tq in (1, 2)
            for L in (8192, 32768) for fmt in ("bf16", "fp8", "ds656")]  # fmt: skip
    if quick:
        grid = [g for g in grid if g[1] in (1, 128) and g[3] == 8192]
    for Hq, B, Tq, L, fmt in grid:
        fp8 = fmt == "fp8"
        q, cache, table, seqlens, descale = _case(B, Hq, L, page, torch.bfloat16, device, fp8)
        if fmt == "ds656":  # DeepSeek's 656-byte rows, read in place
            cache = fusedattn.fp8.quantize_mla_ds(cache)
        q = torch.randn(B, Tq, Hq, DL + DR, device=device, dtype=torch.bfloat16)
        indices = _sparse_indices(table, B, Tq, L, page, topk, device)

        def ours(q=q, cache=cache, seqlens=seqlens, table=table, descale=descale, idx=indices):
            return fusedattn.mla_attention_with_kvcache(
                q, cache, cache_seqlens=seqlens, block_table=table, head_dim_v=DL,
                kv_descale=descale, indices=idx, backend="triton",
            )  # fmt: skip

        ms = harness.time_ms(ours, device=device)
        nbytes = B * Tq * topk * cache.shape[-1] * cache.element_size()
        gbps = harness.gbps(nbytes, ms)
        share = f"{100 * gbps / copy:.0f} % of copy ({copy:.0f} GB/s)" if copy else ""
        rows.append(harness.make_row(
            env, op="mla-sparse-decode", mode="fwd", impl="fusedattn-triton", dtype="bfloat16",
            B=B, H=Hq, Tq=Tq, Tk=L, D=DL + DR, mask=f"topk{topk} paged{page} {fmt}", ms=ms,
            gbps=gbps,
            tflops=harness.tflops(B * Tq * Hq * topk * FLOP_PER_KEY, ms), note=share,
        ))  # fmt: skip
        harness.progress(rows[-1])
    S, Hq = (2048, 128) if quick else (8192, 128)
    q = torch.randn(S, Hq, DL + DR, device=device, dtype=torch.bfloat16)
    kv = torch.randn(S, 1, DL + DR, device=device, dtype=torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(2)
    idx = torch.rand(S, S, device=device, generator=g).argsort(dim=-1)[:, None, :topk].int()
    ms = harness.time_ms(lambda: fusedattn.mla_sparse_attention(q, kv, idx, head_dim_v=DL),
                         device=device)  # fmt: skip
    rows.append(harness.make_row(
        env, op="mla-sparse-prefill", mode="fwd", impl="fusedattn-triton", dtype="bfloat16",
        B=1, H=Hq, Tq=S, Tk=S, D=DL + DR, mask=f"topk{topk}", ms=ms,
        tflops=harness.tflops(S * Hq * topk * FLOP_PER_KEY, ms),
        note="FlashMLA's sparse prefill: 640 TFLOP/s on an H800 (published)",
    ))  # fmt: skip
    harness.progress(rows[-1])
    return rows


def cpu_rows(env, device) -> list[dict]:
    """One tiny call per path (CPU: the structure, not a speed)."""
    rows = []
    for backend in ("torch", "reference"):
        q, cache, table, seqlens, _ = _case(2, 4, 40, 16, torch.float32, device)
        cache = cache.float()

        def call(backend=backend, q=q, cache=cache, table=table, seqlens=seqlens):
            return fusedattn.mla_attention_with_kvcache(
                q, cache, cache_seqlens=seqlens, block_table=table, head_dim_v=DL,
                backend=backend,
            )  # fmt: skip

        ms = harness.time_ms(call, device=device)
        rows.append(harness.make_row(
            env, op="mla-decode", mode="fwd", impl=f"fusedattn-{backend}", dtype="float32",
            B=2, H=4, Tq=1, Tk=40, D=DL + DR, mask="paged16", ms=ms,
            note="CPU: the path runs; its speed means nothing",
        ))  # fmt: skip
        harness.progress(rows[-1])
    return rows


def run(quick: bool, device: torch.device, env: dict, part: str = "dense") -> list[dict]:
    """part: "dense" (issue #83's grid) or "sparse" (issue #85's)."""
    if device.type != "cuda":
        return cpu_rows(env, device)
    return sparse_rows(env, device, quick) if part == "sparse" else gpu_rows(env, device, quick)


if __name__ == "__main__":
    harness.cli(run, "mla.csv", parts={"dense": "mla.csv", "sparse": "mla_sparse.csv"})
