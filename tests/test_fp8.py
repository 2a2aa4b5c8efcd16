"""FP8 for inference (issue #60): fp8 KV caches that decoding, the append and the paged prefill
read and write in the kernels, and the fp8 attention forward with flash-attention 3's
descales.

Truth: float64 attention on the dequantized values (stored × descale). The k× rule's baseline
computes the same way in low precision: the naive reference in q's dtype on the dequantized
cache (decoding), and for the fp8 forward the naive computation with P rounded to
float8_e4m3fn as the kernels round it (docs/api.md). The append's bytes are checked against
fusedattn.fp8.quantize, itself checked against an exhaustive nearest-even search over every
fp8 value.
"""

import itertools

import pytest
import torch

import fusedattn
from fusedattn import reference
from fusedattn.fp8 import FP8_MAX, dequantize_heads, quantize
from fusedattn.ops.decode.api import CHECK_VALUES_ENV
from fusedattn.reference.attention import attention_p_rounded
from fusedattn.testing import assert_close_kx

# every test on the kernel device: the Triton cases on a GPU's when there is one (their inputs
# drawn there, from generators on that device), else the CPU's interpreter
pytestmark = pytest.mark.usefixtures("kernel_device")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]


def backend_cases(cases) -> list:
    """(backend, case) params, Triton's marked `kernels`; torch's SDPA has no softcap."""
    return [
        pytest.param(b, c, id=f"{b}-{c}", marks=[pytest.mark.kernels] if b == "triton" else [])
        for b, c in itertools.product(("reference", "torch", "triton"), cases)
        if not (b == "torch" and c == "softcap")
    ]


def generator(seed: int) -> torch.Generator:
    """A seeded generator on the default device (under kernel_device: a GPU's or the CPU)."""
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def nearest_even(x: torch.Tensor, dtype) -> torch.Tensor:
    """The fp8 value of every x by brute force: the nearest finite value, ties to the even
    code, saturating at the largest finite one; NaN stays NaN."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(dtype).double()
    finite = torch.isfinite(values)
    values, codes = values[finite], codes[finite]
    limit = FP8_MAX[dtype]
    xc = x.double().clamp(-limit, limit)
    dist = (xc[:, None] - values[None, :]).abs()
    best = dist.min(dim=1, keepdim=True).values
    tie_even = (dist == best) & (codes[None, :] % 2 == 0)
    choice = torch.where(
        tie_even.any(1), tie_even.float().argmax(1), (dist == best).float().argmax(1)
    )
    out = values[choice]
    return torch.where(x.isnan(), x.double(), out)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_quantize_rounds_to_nearest_even_and_saturates(dtype):
    """fusedattn.fp8.quantize against the brute-force search: random values, every midpoint
    between neighbouring fp8 values (the ties), values past the largest (saturated, never
    inf), NaN kept."""
    g = generator(0)
    grid = torch.arange(256, dtype=torch.uint8).view(dtype).double()
    grid = grid[torch.isfinite(grid)].unique()
    limit = FP8_MAX[dtype]
    x = torch.cat([
        torch.randn(300, generator=g) * 30, torch.randn(100, generator=g) * limit,
        (grid[1:] + grid[:-1]) / 2, grid, torch.tensor([limit * 1.01, -limit * 7, 3e38, 1e-12]),
        torch.tensor([float("nan")]),
    ]).float()  # fmt: skip
    got = quantize(x, torch.tensor(1.0), dtype).double()
    want = nearest_even(x, dtype)
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got[~got.isnan()], want[~want.isnan()])
    assert torch.isfinite(got[~x.isnan()]).all()


# ---- the append -------------------------------------------------------------------------------


def new_rows(B, Tnew, Hkv, D, dtype, seed):
    g = generator(seed)
    x = torch.randn(B, Tnew, Hkv, D, generator=g) * 3
    x[0, 0, 0, :4] = torch.tensor([1e9, -1e9, float("nan"), -0.0])  # saturation, NaN, -0
    x[-1, -1, -1, :2] = torch.tensor([1e-30, -1e-30])  # flushed to ±0 (the sign kept)
    return x.to(dtype)


def descales(kind, B, Hkv, seed):
    g = generator(seed)
    if kind == "tensor":
        return torch.tensor(0.05), torch.tensor([0.03])
    return torch.rand(B, Hkv, generator=g) * 0.1 + 0.01, torch.rand(
        B, Hkv, generator=g
    ) * 0.1 + 0.01


def fp8_cache(B, S, Hkv, D, dtype, layout, page_size=4, seed=0):
    """(k_cache, v_cache, block_table): fp8 caches of random values, in a layout."""
    g = generator(seed)
    k = (torch.randn(B, S, Hkv, D, generator=g) * 50).to(dtype)
    v = (torch.randn(B, S, Hkv, D, generator=g) * 50).to(dtype)
    if layout == "contiguous":
        return k, v, None
    if layout == "hf":
        return (
            k.transpose(1, 2).contiguous().transpose(1, 2),
            v.transpose(1, 2).contiguous().transpose(1, 2),
            None,
        )
    pages = -(-S // page_size)
    table = torch.randperm(B * pages + 2, generator=g)[: B * pages].view(B, pages).to(torch.int32)
    kp = torch.zeros(B * pages + 2, page_size, Hkv, D).to(dtype)
    vp = torch.zeros(B * pages + 2, page_size, Hkv, D).to(dtype)
    for b, p in itertools.product(range(B), range(pages)):
        rows = slice(p * page_size, min((p + 1) * page_size, S))
        kp[table[b, p], : rows.stop - rows.start] = k[b, rows]
        vp[table[b, p], : rows.stop - rows.start] = v[b, rows]
    return kp, vp, table


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "hf", "paged"])
@pytest.mark.parametrize("kind", ["tensor", "per_head"])
@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=pytest.mark.kernels)],
                         ids=["torch-writes", "append-kernel"])  # fmt: skip
def test_the_append_writes_x_over_descale_nearest_even_saturated(dtype, layout, kind, src, kernel):
    """New rows written into an fp8 cache as x / descale rounded to nearest-even, saturating,
    NaN kept, the sign of a flushed zero kept, bit for bit; nothing else in the cache changes
    (both writers: torch's indexed writes on a CPU, the append kernel on a GPU)."""
    from fusedattn.ops.shared.decode_launch import append

    B, S, Hkv, D, Tnew = 3, 12, 2, 16, 2
    kc, vc, table = fp8_cache(B, S, Hkv, D, dtype, layout)
    before_k, before_v = kc.view(torch.uint8).clone(), vc.view(torch.uint8).clone()
    k, v = new_rows(B, Tnew, Hkv, D, src, 1), new_rows(B, Tnew, Hkv, D, src, 2)
    kd, vd = descales(kind, B, Hkv, 3)
    seqlens = torch.tensor([0, 5, S - Tnew], dtype=torch.int32)  # first slot, middle, full
    append(kc, vc, k, v, seqlens, table, kd, vd, kernel=kernel)
    for cache, before, x, d in ((kc, before_k, k, kd), (vc, before_v, v, vd)):
        expect = before.clone()
        scale = d.reshape(1) if d.numel() == 1 else d[:, None, :, None]
        bytes_ = quantize(x, scale, dtype).view(torch.uint8)
        for b in range(B):
            for t in range(Tnew):
                pos = int(seqlens[b]) + t
                if table is None:
                    expect[b, pos] = bytes_[b, t]
                else:
                    expect[table[b, pos // 4], pos % 4] = bytes_[b, t]
        got = cache.view(torch.uint8)
        nan = cache.float().isnan() & expect.view(dtype).float().isnan()  # any NaN code
        assert torch.equal(got[~nan], expect[~nan])


# ---- decoding and the paged prefill over an fp8 cache ------------------------------------------


def dequantized_cache(cache, descale, block_table, B):
    """The cache's values (float64) per sequence: (B, S, Hkv, D) for a contiguous one, each
    sequence's pages in order for a paged one."""
    x = cache[:B] if block_table is None else cache[block_table.long()].flatten(1, 2)
    return dequantize_heads(x.transpose(1, 2), descale, torch.float64).transpose(1, 2)


DECODE_CASES = {
    "plain": dict(),
    "causal_tq3": dict(is_causal=True, Tq=3),
    "window": dict(window_size=(5, 0), Tq=2),
    "softcap": dict(softcap=8.0),
    "sinks": dict(sinks=True),
    "alibi": dict(alibi_slopes=True, is_causal=True),
    "mqa": dict(Hkv=1),
    "leftpad": dict(leftpad=True),
}


def decode_case(backend, dtype, layout, q_dtype, case, kind="per_head", page_size=4,
                q_scale=1.0):  # fmt: skip
    kw = dict(DECODE_CASES[case])
    Tq, Hkv = kw.pop("Tq", 1), kw.pop("Hkv", 2)
    B, S, Hq, D = 3, 13, 4, 16
    kc, vc, table = fp8_cache(B, S, Hkv, D, dtype, layout, page_size)
    kd, vd = descales(kind, B, Hkv, 4)
    g = generator(5)
    q = torch.randn(B, Tq, Hq, D, generator=g) * q_scale
    seqlens = torch.tensor([0, 7, S], dtype=torch.int32)  # empty, partial, full
    qd = None
    if kw.pop("sinks", False):
        kw["sinks"] = torch.randn(Hq, generator=g)
    if kw.pop("alibi_slopes", False):
        kw["alibi_slopes"] = torch.rand(B, Hq, generator=g) * 0.3
    if kw.pop("leftpad", False):
        kw["cache_leftpad"] = torch.tensor([0, 2, 6], dtype=torch.int32)
    if q_dtype in (E4M3, E5M2):
        qd = torch.rand(B, Hkv, generator=g) * 0.05 + 0.01
        q8 = quantize(q, qd.repeat_interleave(Hq // Hkv, 1)[:, None, :, None], q_dtype)
        q_in, q_val = (
            q8,
            q8.double() * qd.double().repeat_interleave(Hq // Hkv, 1)[:, None, :, None],
        )
    else:
        q_in, q_val = q.to(q_dtype), q.to(q_dtype).double()
    with torch.no_grad():
        got = fusedattn.attention_with_kvcache(
            q_in, kc, vc, cache_seqlens=seqlens, block_table=table, q_descale=qd, k_descale=kd,
            v_descale=vd, backend=backend, **kw,
        )  # fmt: skip
    keys, values = dequantized_cache(kc, kd, table, B), dequantized_cache(vc, vd, table, B)
    k64 = {n: (t.double() if torch.is_tensor(t) and t.is_floating_point() and n != "alibi_slopes" else t)
           for n, t in kw.items()}  # fmt: skip
    truth = reference.attention_with_kvcache(q_val, keys, values, cache_seqlens=seqlens, **k64)
    low = torch.bfloat16 if q_dtype in (E4M3, E5M2) else q_dtype
    k_low = {n: (t.to(low) if torch.is_tensor(t) and t.is_floating_point() and n != "alibi_slopes" else t)
             for n, t in kw.items()}  # fmt: skip
    if low != torch.float32 and "alibi_slopes" in k_low:
        k_low.pop("alibi_slopes")  # the half baseline would round the bias: fp32 baseline
        low = torch.float32
        k_low = {n: (t.float() if torch.is_tensor(t) and t.is_floating_point() and n != "alibi_slopes" else t)
                 for n, t in kw.items()}  # fmt: skip
    base = reference.attention_with_kvcache(q_val.to(low), keys.to(low), values.to(low),
                                            cache_seqlens=seqlens, **k_low)  # fmt: skip
    want_dtype = torch.bfloat16 if q_dtype in (E4M3, E5M2) else q_dtype
    assert got.dtype == want_dtype and got.shape == (B, Tq, Hq, D)
    assert_close_kx(got, truth.to(torch.float64), base.to(want_dtype), name="out")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "hf", "paged"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_decoding_reads_an_fp8_cache_in_every_layout(backend, layout, dtype):
    decode_case(backend, dtype, layout, torch.bfloat16, "causal_tq3")


@pytest.mark.parametrize(("backend", "case"), backend_cases(DECODE_CASES))
def test_decoding_over_an_fp8_cache_with_every_variant(backend, case):
    decode_case(backend, E4M3, "paged", torch.bfloat16, case)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32, E4M3], ids=str)
@pytest.mark.parametrize("kind", ["tensor", "per_head"])
def test_decoding_with_every_q_dtype_and_descale_kind(backend, q_dtype, kind):
    """q in float16, float32 (the output in q's dtype) or fp8 with q_descale (bfloat16 out),
    over a cache descaled per tensor or per (sequence, kv head)."""
    decode_case(backend, E4M3, "contiguous", q_dtype, "plain", kind)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "q_dtype,q_scale",
    [(torch.bfloat16, 0.0), (torch.bfloat16, 1e-5), (torch.bfloat16, 5e4), (torch.float16, 3e3)],
    ids=str,
)
def test_decoding_over_an_fp8_cache_with_a_q_of_any_magnitude(backend, q_dtype, q_scale):
    """The Triton kernel multiplies in fp16 over an fp8 cache, q scaled by a power of two
    into fp16's range: a bf16 q of 5e4 (past fp16's 65504 once multiplied by its randn),
    of 1e-5 (fp16's subnormals unscaled) and of zeros give what the float64 reference gives."""
    decode_case(backend, E4M3, "contiguous", q_dtype, "causal_tq3", q_scale=q_scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 4])
def test_decoding_appends_then_reads_its_own_fp8_rows(backend, page_size):
    """A decode step with k, v: the new rows are quantized into the cache and attended, as if
    they had been in the cache already."""
    B, S, Hkv, Hq, D = 2, 9, 2, 4, 16
    kc, vc, table = fp8_cache(B, S, Hkv, D, E4M3, "paged", page_size)
    kd, vd = descales("per_head", B, Hkv, 6)
    g = generator(7)
    q = torch.randn(B, 1, Hq, D, generator=g).bfloat16()
    k, v = (torch.randn(B, 1, Hkv, D, generator=g).bfloat16() for _ in range(2))
    seqlens = torch.tensor([3, S - 1], dtype=torch.int32)
    ref_k, ref_v = kc.clone(), vc.clone()
    with torch.no_grad():
        got = fusedattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                               block_table=table, k_descale=kd, v_descale=vd,
                                               is_causal=True, backend=backend)  # fmt: skip
        want = reference.attention_with_kvcache(q, ref_k, ref_v, k, v, cache_seqlens=seqlens,
                                                block_table=table, k_descale=kd, v_descale=vd,
                                                is_causal=True)  # fmt: skip
    assert torch.equal(kc.view(torch.uint8), ref_k.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), ref_v.view(torch.uint8))
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, E4M3], ids=str)
def test_the_paged_prefill_reads_an_fp8_cache(backend, q_dtype):
    """varlen_attention with a block table over an fp8 cache (chunked prefill, prefix hits):
    each sequence's queries bottom-right of its keys, against the float64 truth."""
    B, Hkv, Hq, D, page = 2, 2, 4, 16, 4
    k_lens, q_lens = [9, 6], [3, 6]
    kc, vc, table = fp8_cache(B, 12, Hkv, D, E4M3, "paged", page)
    kd, vd = descales("per_head", B, Hkv, 8)
    g = generator(9)
    q = torch.randn(sum(q_lens), Hq, D, generator=g)
    cu_q = torch.tensor([0, q_lens[0], sum(q_lens)], dtype=torch.int32)
    cu_k = torch.tensor([0, k_lens[0], sum(k_lens)], dtype=torch.int32)
    qd = None
    q_in = q.bfloat16()
    if q_dtype == E4M3:
        qd = torch.rand(B, Hkv, generator=g) * 0.05 + 0.01
        rows = torch.repeat_interleave(torch.arange(B), torch.tensor(q_lens))
        scale = qd.repeat_interleave(Hq // Hkv, 1)[rows][:, :, None]
        q_in = quantize(q, scale, E4M3)
    q_val = q_in.double() if qd is None else q_in.double() * scale.double()
    kw = dict(is_causal=True, causal_alignment="bottom_right", enable_gqa=True)
    with torch.no_grad():
        got = fusedattn.varlen_attention(q_in, kc, vc, cu_q, cu_k, 6, 9, block_table=table,
                                         q_descale=qd, k_descale=kd, v_descale=vd,
                                         backend=backend, **kw)  # fmt: skip
    keys = dequantized_cache(kc, kd, table, B)
    values = dequantized_cache(vc, vd, table, B)
    k_packed = torch.cat([keys[b, : k_lens[b]] for b in range(B)])
    v_packed = torch.cat([values[b, : k_lens[b]] for b in range(B)])
    truth = reference.varlen_attention(q_val, k_packed, v_packed, cu_q, cu_k, 6, 9, **kw)
    base = reference.varlen_attention(q_val.bfloat16(), k_packed.bfloat16(), v_packed.bfloat16(),
                                      cu_q, cu_k, 6, 9, **kw)  # fmt: skip
    assert got.dtype == torch.bfloat16
    assert_close_kx(got, truth, base, name="out")


# ---- the fp8 forward ----------------------------------------------------------------------------


def fp8_inputs(B, Hq, Hkv, Tq, Tk, D, seed=0):
    g = generator(seed)
    q, k, v = (torch.randn(B, h, t, D, generator=g) for h, t in ((Hq, Tq), (Hkv, Tk), (Hkv, Tk)))
    ds = [torch.rand(B, Hkv, generator=g) * 0.01 + 0.004 for _ in range(3)]
    out = []
    for x, d in zip((q, k, v), ds, strict=True):
        scale = d.repeat_interleave(x.shape[1] // Hkv, 1)[:, :, None, None]
        out.append(quantize(x, scale, E4M3))
    return out, ds


FORWARD_CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "window": dict(window_size=(6, 1)),
    "softcap": dict(softcap=5.0),
    "key_padding": dict(key_padding_mask=True),
    "bottom_right": dict(is_causal=True, causal_alignment="bottom_right"),
    "sinks": dict(sinks=True),
    "alibi": dict(alibi_slopes=True, is_causal=True, causal_alignment="bottom_right"),
}


@pytest.mark.parametrize(("backend", "case"), backend_cases(FORWARD_CASES))
@pytest.mark.parametrize("Tq,Tk", [(37, 37), (5, 70)], ids=str)
def test_the_fp8_forward_against_float64_on_the_dequantized_values(backend, case, Tq, Tk):
    """attention with q, k, v in float8_e4m3fn and their descales (per sequence and kv head,
    GQA 2:1): bfloat16 output within the k× rule of the float64 truth, the yardstick rounding
    P to fp8 as the kernels do (the reference and torch backends keep P exact: a smaller
    error, the same rule); the lse within fp32 rounding."""
    B, Hq, Hkv, D = 2, 4, 2, 32
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(B, Hq, Hkv, Tq, Tk, D)
    kw = dict(FORWARD_CASES[case])
    if kw.get("key_padding_mask"):
        kpm = torch.zeros(B, Tk, dtype=torch.bool)
        kpm[1, Tk // 2 :] = True
        kw["key_padding_mask"] = kpm
    if kw.get("sinks"):
        kw["sinks"] = torch.tensor([0.5, -1.0, 2.0, 0.0])
    if kw.get("alibi_slopes"):
        kw["alibi_slopes"] = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    got, lse = fusedattn.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                                   enable_gqa=True, return_lse=backend != "torch" or None,
                                   backend=backend, **kw) if backend != "torch" else (
        fusedattn.attention(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd,
                            enable_gqa=True, backend=backend, **kw), None)  # fmt: skip
    qv, kv_, vv = (dequantize_heads(x, d, torch.float64) for x, d in ((q8, qd), (k8, kd), (v8, vd)))
    truth, lse_truth = reference.attention(qv, kv_, vv, enable_gqa=True, return_lse=True, **kw)
    base = attention_p_rounded(qv.float(), kv_.float(), vv.float(), **kw).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (B, Hq, Tq, D)
    assert_close_kx(got, truth, base, name="out")
    if lse is not None:
        torch.testing.assert_close(lse.double(), lse_truth.double(), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "backend", ["reference", pytest.param("triton", marks=pytest.mark.kernels)]
)
@pytest.mark.parametrize("out_dtype", [None, torch.float16])
def test_the_fp8_varlen_forward(backend, out_dtype):
    """varlen_attention with packed fp8 q, k, v (a descale per sequence and kv head): each
    sequence as its own fp8 attention, the output in out_dtype (bfloat16 by default)."""
    B, Hq, Hkv, D = 2, 4, 2, 32
    lens = [9, 20]
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(B, Hq, Hkv, max(lens), max(lens), D, seed=1)
    pack = lambda x: torch.cat([x[b, :, : lens[b]].transpose(0, 1) for b in range(B)])  # noqa: E731
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    got = fusedattn.varlen_attention(pack(q8), pack(k8), pack(v8), cu, cu, max(lens), max(lens),
                                     is_causal=True, enable_gqa=True, q_descale=qd, k_descale=kd,
                                     v_descale=vd, out_dtype=out_dtype, backend=backend)  # fmt: skip
    assert got.dtype == (out_dtype or torch.bfloat16)
    for b in range(B):
        one = [x[b : b + 1, :, : lens[b]] for x in (q8, k8, v8)]
        ds = [d[b : b + 1] for d in (qd, kd, vd)]
        want = fusedattn.attention(*one, is_causal=True, enable_gqa=True, q_descale=ds[0],
                                   k_descale=ds[1], v_descale=ds[2], out_dtype=out_dtype,
                                   backend=backend)  # fmt: skip
        rows = slice(sum(lens[:b]), sum(lens[: b + 1]))
        torch.testing.assert_close(got[rows].float(), want[0].transpose(0, 1).float(),
                                   atol=1e-2, rtol=1e-2)  # fmt: skip


# ---- bad input -----------------------------------------------------------------------------------


def bad_decode_calls():
    q = torch.randn(2, 1, 4, 16, dtype=torch.bfloat16)
    kc = torch.zeros(2, 8, 2, 16, dtype=E4M3)
    d = torch.full((2, 2), 0.1)
    seq = torch.tensor([1, 2], dtype=torch.int32)
    base = dict(q=q, k_cache=kc, v_cache=kc.clone(), cache_seqlens=seq, k_descale=d, v_descale=d)
    k = torch.randn(2, 1, 2, 16, dtype=torch.bfloat16)
    return {
        "k_descale is required": dict(k_descale=None),
        "v_descale must be float32": dict(v_descale=d.double()),
        "k_descale must be one value": dict(k_descale=torch.ones(3, 2)),
        "k_descale must be positive and finite": dict(k_descale=torch.tensor([[0.1, -1.0]] * 2)),
        "v_descale must be positive and finite": dict(v_descale=torch.tensor(float("nan"))),
        "k_descale must be positive and finite ": dict(k_descale=torch.tensor(float("inf"))),
        "k_cache and v_cache must be of one fp8 type": dict(v_cache=kc.to(torch.float32).to(E5M2)),
        "q_descale is required": dict(q=q.float().to(E4M3)),
        "q_descale is given but": dict(q_descale=d),
        "an fp8 q reads an fp8 cache": dict(
            q=q.float().to(E4M3),
            k_cache=q.new_zeros(2, 8, 2, 16),
            v_cache=q.new_zeros(2, 8, 2, 16),
            k_descale=None,
            v_descale=None,
        ),
        "k_descale is given but the cache is": dict(
            k_cache=q.new_zeros(2, 8, 2, 16), v_cache=q.new_zeros(2, 8, 2, 16)
        ),
        "written into an fp8 cache) must be": dict(k=k.to(torch.int32), v=k),
        "inference only": dict(q=q.clone().requires_grad_()),
    }, base


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(bad_decode_calls()[0]))
def test_bad_fp8_decode_input_is_named_before_anything_is_written(backend, name, monkeypatch):
    # the descales' values are checked on the host: on a GPU the Triton path reads them only
    # when FUSEDATTN_CHECK_VALUES=1 asks (no sync by default), as the lengths
    monkeypatch.setenv(CHECK_VALUES_ENV, "1")
    cases, base = bad_decode_calls()
    kw = base | cases[name]
    kw.setdefault("k", torch.randn(2, 1, 2, 16, dtype=torch.bfloat16))
    kw.setdefault("v", torch.randn(2, 1, 2, 16, dtype=torch.bfloat16))
    before = kw["k_cache"].clone()
    with pytest.raises(
        (TypeError, ValueError), match=name.strip().replace("(", r"\(").replace(")", r"\)")
    ):
        fusedattn.attention_with_kvcache(backend=backend, **kw)
    assert torch.equal(kw["k_cache"].view(torch.uint8) if kw["k_cache"].element_size() == 1
                       else kw["k_cache"], before.view(torch.uint8) if before.element_size() == 1
                       else before)  # fmt: skip


def test_bad_fp8_forward_input_is_named():
    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 2, 2, 5, 5, 16)
    ok = dict(q_descale=qd, k_descale=kd, v_descale=vd)
    cases = [
        ("q_descale is required", (q8, k8, v8), dict(ok, q_descale=None)),
        ("all in torch.float8_e4m3fn", (q8, k8.float().bfloat16(), v8), ok),
        ("all in torch.float8_e4m3fn", (q8.float().to(E5M2), k8, v8), ok),
        ("out_dtype must be one of", (q8, k8, v8), dict(ok, out_dtype=E4M3)),
        ("out_dtype is for fp8 inputs", (q8.float(), k8.float(), v8.float()), dict(out_dtype=torch.float16)),
        ("q_descale is given but no input is fp8", (q8.float(),) * 3, dict(q_descale=qd)),
        ("dropout_p must be 0", (q8, k8, v8), dict(ok, dropout_p=0.1)),
        ("k_descale must be float32", (q8, k8, v8), dict(ok, k_descale=kd.half())),
    ]  # fmt: skip
    for match, tensors, kw in cases:
        with pytest.raises((TypeError, ValueError), match=match):
            fusedattn.attention(*tensors, backend="reference", **kw)


# ---- compile, compat ----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.kernels)])
def test_fp8_decoding_and_forward_compile_whole(backend):
    """torch.compile(fullgraph=True) records an fp8 decode step (its append included) and an
    fp8 forward as custom ops: eager's result, no graph break."""
    B, S, Hkv, D = 2, 8, 2, 16
    kc, vc, _ = fp8_cache(B, S, Hkv, D, E4M3, "contiguous")
    kd, vd = descales("per_head", B, Hkv, 1)
    q = torch.randn(B, 1, 4, D).bfloat16()
    k, v = (torch.randn(B, 1, Hkv, D).bfloat16() for _ in range(2))
    seqlens = torch.tensor([2, 5], dtype=torch.int32)

    def step(q, kc, vc, k, v):
        return fusedattn.attention_with_kvcache(q, kc, vc, k, v, cache_seqlens=seqlens,
                                                k_descale=kd, v_descale=vd, backend=backend)  # fmt: skip

    eager_caches = (kc.clone(), vc.clone())
    with torch.no_grad():
        want = step(q, *eager_caches, k, v)
        # aot_eager: the custom ops' fake kernels and functionalization, without inductor's
        # C++ build of the graph (15 of this test's 20 s; test_swap compiles with inductor)
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, kc, vc, k, v)
    torch.testing.assert_close(got, want)
    assert torch.equal(kc.view(torch.uint8), eager_caches[0].view(torch.uint8))
    (q8, k8, v8), (qd, kd2, vd2) = fp8_inputs(1, 2, 2, 9, 9, 16)
    if backend == "triton":

        def fwd(q, k, v):
            return fusedattn.attention(q, k, v, q_descale=qd, k_descale=kd2, v_descale=vd2,
                                       is_causal=True, backend=backend)  # fmt: skip

        compiled = torch.compile(fwd, fullgraph=True, backend="aot_eager")
        torch.testing.assert_close(compiled(q8, k8, v8), fwd(q8, k8, v8))


def test_compat_takes_flash_attention_3s_descales():
    """fusedattn.compat.flash_attn: fp8 q, k, v with q/k/v_descale (flash-attention 3's
    meaning), and an fp8 cache with k/v_descale in flash_attn_with_kvcache."""
    from fusedattn.compat import flash_attn as fa

    (q8, k8, v8), (qd, kd, vd) = fp8_inputs(1, 2, 2, 7, 7, 16)
    out = fa.flash_attn_func(*(t.transpose(1, 2) for t in (q8, k8, v8)), causal=True,
                             q_descale=qd, k_descale=kd, v_descale=vd)  # fmt: skip
    want = fusedattn.attention(q8, k8, v8, is_causal=True, q_descale=qd, k_descale=kd,
                               v_descale=vd, causal_alignment="bottom_right")  # fmt: skip
    torch.testing.assert_close(out, want.transpose(1, 2))
    kc, vc, _ = fp8_cache(2, 8, 2, 16, E4M3, "contiguous")
    d = torch.full((2, 2), 0.1)
    q = torch.randn(2, 1, 4, 16).bfloat16()
    got = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=5, k_descale=d, v_descale=d)
    want = fusedattn.attention_with_kvcache(q, kc, vc, cache_seqlens=5, k_descale=d, v_descale=d)
    torch.testing.assert_close(got, want)
