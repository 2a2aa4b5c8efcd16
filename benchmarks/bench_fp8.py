"""FP8 (issue #60): decoding over an fp8 KV cache and the fp8 attention forward, each against
its bf16 twin and SDPA in the same run.

    python benchmarks/bench_fp8.py [--quick] [--out DIR]

decode rows (op "decode", mask = the cache layout, contiguous or paged16): the Triton decode
kernel over an e4m3 cache (`fusedattn-triton-fp8`) against the same kernel over the bf16 cache
(`fusedattn-triton`) and SDPA's flash and cuDNN backends over the bf16 cache, each also
replayed from a CUDA graph (`-graph`: the kernels' time without the host's, as a serving
stack runs a step). Llama-3-8B's heads (Hq 32, Hkv 8, D 128), batch 1, 8 and 64, caches of
8k, 32k and 128k keys (up to 24 GB of bf16 K/V). GB/s count the cache bytes each impl reads
(an fp8 cache's are half a bf16 one's), % of the copy rate measured in the same run; an fp8
row's note gives its speedup over the bf16 kernel at the same point. The cache has one
descale (a per-(sequence, kv head) descale costs the kernel the same single load).

forward rows (op "attention", mask "fp8"): attention with q, k, v in e4m3 and a descale per
(sequence, head) (`fusedattn-triton-fp8`), forward only, against the bf16 Triton forward and
SDPA's flash and cuDNN backends on the same shapes: D 64 and 128, T 1k to 16k with B·T = 16k
tokens, H 16, causal or not; TFLOP/s of the usual count (4·B·H·T²·D, halved causal).

`pass`: fp8 rows against float64 on the dequantized values, the yardstick computing as the
kernel does (decode: the naive path on the dequantized cache in bf16; the forward: P rounded
to e4m3, fusedattn.reference.attention.attention_p_rounded); bf16 rows as in bench_decode and
bench_attention. On a CPU a smoke run times the torch backend (which dequantizes) at tiny
sizes: what runs there is the harness, not the speed.
"""

from __future__ import annotations

import functools
import itertools

import bench_decode
import harness
import torch

import fusedattn
from fusedattn import reference
from fusedattn.fp8 import FORWARD_DTYPE, amax_descale, dequantize_heads, quantize
from fusedattn.reference.attention import attention_p_rounded

E4M3 = FORWARD_DTYPE
HQ, HKV, D = bench_decode.HQ, bench_decode.HKV, bench_decode.D
GRAPHED = ("fusedattn-triton", "fusedattn-triton-fp8", "sdpa-flash", "sdpa-cudnn")


def decode_cases(quick: bool, device: torch.device) -> list[tuple[int, int, str]]:
    """(B, L, layout)."""
    if device.type != "cuda":
        return [(2, 256, "contiguous"), (2, 256, "paged16")]
    lengths = (8192, 32768) if quick else (8192, 32768, 131072)
    out = []
    for B, L in itertools.product((1, 8, 64), lengths):
        if B * L * HKV * D * 2 * 2 > 24 * 2**30:  # the bf16 twin and the baselines need it
            continue
        out.append((B, L, "contiguous"))
        if not quick or L == 32768:
            out.append((B, L, "paged16"))
    return out


def fp8_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the cache in e4m3, its one descale): max |x| maps to 448."""
    descale = amax_descale(cache, tuple(range(cache.dim())), E4M3).reshape(())
    chunks = [quantize(part, descale, E4M3) for part in cache.split(1024)]  # bounded fp32 temps
    return torch.cat(chunks), descale


def decode_rows(quick: bool, device: torch.device, env: dict) -> list[dict]:
    on_gpu = device.type == "cuda"
    dtype = torch.bfloat16 if on_gpu else torch.float32
    heads, dim, hq = (HKV, D, HQ) if on_gpu else (2, 64, 4)
    kernels = harness.kernel_backends("attention_with_kvcache", device)
    backends = [b for b in kernels if b == "triton"] or ["torch"]  # the CPU smoke: torch
    rows = []
    for B, L, layout in decode_cases(quick, device):
        torch.manual_seed(0)
        k_cache, v_cache, table = bench_decode.make_cache(B, L, layout, device, dtype, heads, dim)
        k8, kd = fp8_cache(k_cache)
        v8, vd = fp8_cache(v_cache)
        q = torch.randn(B, 1, hq, dim, device=device, dtype=dtype)
        kw = dict(cache_seqlens=L, block_table=table)
        impls, read = {}, {}
        for b in backends:
            impls[f"fusedattn-{b}"] = functools.partial(
                fusedattn.attention_with_kvcache, q, k_cache, v_cache, backend=b, **kw
            )
            impls[f"fusedattn-{b}-fp8"] = functools.partial(
                fusedattn.attention_with_kvcache, q, k8, v8, k_descale=kd, v_descale=vd,
                backend=b, **kw,
            )  # fmt: skip
        if layout == "contiguous":
            k, v = (bench_decode.dense(c, table, B, L) for c in (k_cache, v_cache))
            base = bench_decode.baselines(q, k, v, 1, device, quick=True)
            impls |= {n: fn for n, fn in base.items() if n.startswith("sdpa-") or n == "sdpa"}
            impls.pop("sdpa-math", None)
            impls.pop("sdpa-efficient", None)
        if on_gpu:
            for name in GRAPHED:
                if name in impls:
                    with torch.inference_mode():
                        impls[name]()
                        impls[f"{name}-graph"] = harness.cuda_graph(impls[name])
        for name in impls:
            read[name] = B * L * heads * 2 * dim * (1 if "-fp8" in name else k_cache.element_size())
        checks = decode_checks(q, k_cache, v_cache, k8, v8, kd, vd, table, L)
        fields = dict(op="decode", mode="fwd", dtype=str(dtype)[6:], B=B, H=hq, Tq=1, Tk=L,
                      D=dim, causal=False, mask=layout)  # fmt: skip
        measured = {}
        for name, fn in impls.items():
            try:
                with torch.inference_mode():
                    verdict = harness.correctness(fn()[:1], *checks["-fp8" in name])
                    ms, spread = harness.time_stats(fn, device=device)
            except (RuntimeError, ValueError) as exc:
                print(f"  decode {name}: not run for B={B} L={L} {layout}: "
                      f"{str(exc).splitlines()[0][:100]}")  # fmt: skip
                continue
            measured[name] = ms
            speed = harness.gbps(read[name], ms)
            copy = env.get("copy_gbps")
            twin = measured.get(name.replace("-fp8", ""))
            note = [f"{twin / ms:.2f}x the bf16 cache's speed" if "-fp8" in name and twin else ""]
            note.append(harness.noisy(spread).lstrip("; "))
            row = harness.make_row(
                env, impl=name, ms=ms, gbps=speed, spread=spread,
                pct_of_copy=100.0 * speed / copy if copy else None,
                note="; ".join(n for n in note if n) or None, **fields, **{"pass": verdict},
            )  # fmt: skip
            harness.progress(row)
            rows.append(row)
        del k_cache, v_cache, k8, v8, impls
        if on_gpu:
            torch.cuda.empty_cache()
    return rows


def decode_checks(q, k_cache, v_cache, k8, v8, kd, vd, table, L) -> dict:
    """{fp8?: (truth, yardstick)} for the first sequence: float64 and the naive path in q's
    dtype, on the bf16 cache or on the fp8 cache's dequantized values."""
    first = q[:1]
    out = {}
    for fp8, (k, v) in ((False, (k_cache, v_cache)), (True, (k8, v8))):
        one = dict(q=first, k=k, v=v, table=None if table is None else table[:1])
        pair = bench_decode.dense_first(one, L, dtype=torch.float64)
        if fp8:
            pair = [t.float() * d.double() for t, d in zip(pair, (kd, vd), strict=True)]
        with torch.inference_mode():
            truth = reference.attention_with_kvcache(first.double(), *(t.double() for t in pair),
                                                     cache_seqlens=L)  # fmt: skip
            base = reference.attention_with_kvcache(first, *(t.to(q.dtype) for t in pair),
                                                    cache_seqlens=L)  # fmt: skip
        out[fp8] = (truth, base)
    return out


def forward_cases(quick: bool, device: torch.device) -> list[tuple[int, int, int, bool]]:
    """(B, T, D, causal), H 16."""
    if device.type != "cuda":
        return [(1, 128, 64, False), (1, 128, 64, True)]
    lengths = (4096,) if quick else (1024, 4096, 16384)
    dims = (128,) if quick else (64, 128)
    return [(16384 // T, T, d, c) for T, d, c in itertools.product(lengths, dims, (False, True))]


def forward_rows(quick: bool, device: torch.device, env: dict) -> list[dict]:
    on_gpu = device.type == "cuda"
    H = 16 if on_gpu else 2
    dtype = torch.bfloat16 if on_gpu else torch.float32
    kernels = harness.kernel_backends("attention", device)
    fp8_backends = [b for b in kernels if b == "triton"] or ["torch"]
    rows = []
    for B, T, dim, causal in forward_cases(quick, device):
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, T, dim, device=device, dtype=dtype) for _ in range(3))
        quantized = []
        for x in (q, k, v):  # a descale per (sequence, head)
            d = amax_descale(x, (2, 3), E4M3)
            quantized.append((quantize(x, d[:, :, None, None], E4M3), d))
        (q8, qd), (k8, kd), (v8, vd) = quantized
        impls = {  # the bf16 twin first: an fp8 row's note compares with it
            f"fusedattn-{b}": functools.partial(
                fusedattn.attention, q, k, v, is_causal=causal, backend=b
            )
            for b in kernels
        }
        for b in fp8_backends:
            impls[f"fusedattn-{b}-fp8"] = functools.partial(
                fusedattn.attention, q8, k8, v8, is_causal=causal, q_descale=qd, k_descale=kd,
                v_descale=vd, backend=b,
            )  # fmt: skip
        for name, ctx in bench_decode_sdpa(device):
            impls[name] = functools.partial(_sdpa, ctx, q, k, v, causal)
        checks = forward_checks(q, k, v, (q8, qd), (k8, kd), (v8, vd), causal)
        flops = harness.attention_flops(B, H, T, T, dim, causal=causal, mode="fwd")
        fields = dict(op="attention", mode="fwd", dtype=str(dtype)[6:], B=B, H=H, Tq=T, Tk=T,
                      D=dim, causal=causal, mask="fp8")  # fmt: skip
        measured = {}
        for name, fn in impls.items():
            try:
                with torch.inference_mode():
                    verdict = harness.correctness(fn()[:1, :2], *checks["-fp8" in name])
                    ms, spread = harness.time_stats(fn, device=device)
            except (RuntimeError, ValueError) as exc:
                print(f"  attention {name}: not run for {fields}: {str(exc).splitlines()[0][:100]}")
                continue
            measured[name] = ms
            twin = measured.get(name.replace("-fp8", ""))
            note = [f"{twin / ms:.2f}x the bf16 kernel's speed" if "-fp8" in name and twin else ""]
            note.append(harness.noisy(spread).lstrip("; "))
            row = harness.make_row(
                env, impl=name, ms=ms, tflops=harness.tflops(flops, ms), spread=spread,
                note="; ".join(n for n in note if n) or None, **fields, **{"pass": verdict},
            )  # fmt: skip
            harness.progress(row)
            rows.append(row)
        del q, k, v, q8, k8, v8, impls
        if on_gpu:
            torch.cuda.empty_cache()
    return rows


def bench_decode_sdpa(device):
    """SDPA's flash and cuDNN backends on a GPU (the fastest bf16 ones), the default on a CPU."""
    import contextlib

    if device.type != "cuda":
        return [("sdpa", contextlib.nullcontext)]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return [("sdpa-flash", lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)),
            ("sdpa-cudnn", lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))]  # fmt: skip


def _sdpa(ctx, q, k, v, causal):
    with ctx():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def forward_checks(q, k, v, q8, k8, v8, causal) -> dict:
    """{fp8?: (truth, yardstick)} on batch 0, heads 0-1: float64 and the naive path in q's
    dtype (bf16 inputs), or on the dequantized values with P rounded as the kernel rounds it."""
    sl = (slice(0, 1), slice(0, 2))
    with torch.inference_mode():
        qs, ks, vs = (t[sl] for t in (q, k, v))
        plain = (reference.attention(qs.double(), ks.double(), vs.double(), is_causal=causal),
                 reference.attention(qs, ks, vs, is_causal=causal))  # fmt: skip
        values = [dequantize_heads(x[sl], d[sl], torch.float64) for x, d in (q8, k8, v8)]
        truth = reference.attention(*values, is_causal=causal)
        base = attention_p_rounded(*(t.float() for t in values), is_causal=causal)
    return {False: plain, True: (truth, base.to(torch.bfloat16))}


def run(quick: bool, device: torch.device, env: dict) -> list[dict]:
    return decode_rows(quick, device, env) + forward_rows(quick, device, env)


if __name__ == "__main__":
    harness.cli(run, "fp8.csv")
