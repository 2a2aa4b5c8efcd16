"""MLA decoding (issue #83): `fusedattn.mla_attention_with_kvcache` on the Triton kernel
(interpreter here, compiled on a GPU), the torch and reference backends, against a float64
reference over the gathered latent rows under the k× rule: DeepSeek's 512 + 64 and a small
64 + 16, 1 to 16 heads, 1 to 4 queries (causal bottom-right or not), lengths 0, 1 and not
multiples of the page, page sizes 1 to 64 with shuffled block tables, contiguous / paged /
vLLM-layout caches, NaN in unused slots, fp8 caches, the append, the split count, batch
invariance, compile, and the refusals."""

from __future__ import annotations

import random

import pytest
import torch

import fusedattn
from fusedattn import reference
from fusedattn.testing import assert_close_kx

pytestmark = pytest.mark.usefixtures("kernel_device")
kernels = pytest.mark.kernels
BACKENDS = ["reference", "torch", pytest.param("triton", marks=kernels)]


def make_cache(lengths, D, page_size, dtype, *, layout="paged4", capacity=None, seed=0):
    """A latent cache holding random rows at each sequence's positions [0, L_b) and NaN in
    every other slot (spare pages too): (cache, block_table or None)."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    capacity = capacity or max(max(lengths), 1) + 5
    if layout == "contiguous":
        cache = torch.full((B, capacity, 1, D), float("nan"))
        for b, n in enumerate(lengths):
            cache[b, :n] = torch.randn(n, 1, D, generator=g)
        return cache.to(dtype).to(torch.get_default_device()), None
    per_seq = -(-capacity // page_size)
    order = list(range(B * per_seq + 2))  # two pages nobody owns
    random.Random(seed).shuffle(order)
    table = torch.tensor(order[: B * per_seq], dtype=torch.int32).view(B, per_seq)
    cache = torch.full((B * per_seq + 2, page_size, 1, D), float("nan"))
    for b, n in enumerate(lengths):
        for pos in range(n):
            cache[table[b, pos // page_size], pos % page_size] = torch.randn(1, D, generator=g)
    cache = cache.to(dtype).to(torch.get_default_device())
    if layout == "paged3":  # (num_pages, page_size, D): vLLM's MLA layout
        cache = cache[:, :, 0]
    return cache, table.to(torch.get_default_device())


def check(backend, B=2, Tq=1, Hq=3, Dl=64, Dr=16, lengths=(37, 0), page_size=16,
          dtype=torch.float32, layout="paged4", is_causal=False, split_q=False, **kw):  # fmt: skip
    D = Dl + Dr
    cache, table = make_cache(list(lengths)[:B], D, page_size, dtype, layout=layout)
    q = (torch.randn(B, Tq, Hq, D) * 2).to(dtype).to(cache.device)
    call = dict(cache_seqlens=torch.tensor(lengths[:B], dtype=torch.int32).to(cache.device),
                block_table=table, head_dim_v=Dl, is_causal=is_causal, return_lse=True, **kw)  # fmt: skip
    query = (q[..., :Dl], q[..., Dl:]) if split_q else q
    out, lse = fusedattn.mla_attention_with_kvcache(query, cache, backend=backend, **call)
    exact = {n: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
             for n, v in call.items()}  # fmt: skip
    want, want_lse = reference.mla_attention_with_kvcache(q.double(), cache.double(), **exact)
    base, _ = reference.mla_attention_with_kvcache(q, cache, **call)
    assert out.shape == (B, Tq, Hq, Dl) and out.dtype == dtype and lse.shape == (B, Hq, Tq)
    assert torch.isfinite(out).all(), "a NaN in an unused slot reached the output"
    assert_close_kx(out, want, base, name="out")
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=1e-4, atol=1e-4)
    return out, lse


@kernels
@pytest.mark.parametrize(
    "Hq,Tq,is_causal", [(1, 1, False), (3, 2, True), (16, 1, False), (16, 4, True)]
)
def test_triton_small_latent_matches_float64(Hq, Tq, is_causal):
    check("triton", Hq=Hq, Tq=Tq, is_causal=is_causal, lengths=(37, 5))


@kernels
@pytest.mark.parametrize("Hq,Tq,is_causal,split_q", [(3, 1, False, False), (16, 2, True, True)])
def test_triton_deepseek_dims_match_float64(Hq, Tq, is_causal, split_q):
    """512 + 64 (DeepSeek-V2/V3's absorbed decode), q as one tensor and as (q_nope, q_pe)."""
    check("triton", Hq=Hq, Tq=Tq, Dl=512, Dr=64, lengths=(21, 40), page_size=16,
          is_causal=is_causal, split_q=split_q)  # fmt: skip


@kernels
@pytest.mark.parametrize("page_size", [1, 16, 61, 64])
def test_triton_page_sizes_lengths_and_layouts(page_size):
    """Lengths 0, 1 and not multiples of the page, a shuffled table, NaN everywhere unused."""
    check("triton", B=4, lengths=(0, 1, 63, 70), page_size=page_size, Hq=3, Tq=2,
          is_causal=True)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "paged3", "paged4"])
def test_every_backend_every_layout(backend, layout):
    if backend != "torch":
        check(backend, lengths=(37, 9), layout=layout)
        return
    # SDPA returns no lse (the torch backend refuses return_lse): its output alone
    cache, table = make_cache([37, 9], 80, 16, torch.float32, layout=layout)
    q = torch.randn(2, 1, 3, 80)
    call = dict(cache_seqlens=torch.tensor([37, 9], dtype=torch.int32), block_table=table,
                head_dim_v=64)  # fmt: skip
    out = fusedattn.mla_attention_with_kvcache(q, cache, backend="torch", **call)
    want = reference.mla_attention_with_kvcache(q.double(), cache.double(), **call)
    base = reference.mla_attention_with_kvcache(q, cache, **call)
    assert torch.isfinite(out).all()
    assert_close_kx(out, want, base)


@kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_half_precision_with_sinks(dtype):
    sinks = torch.randn(3)
    check("triton", dtype=dtype, lengths=(45, 0), sinks=sinks.to(torch.get_default_device()))


@kernels
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_triton_fp8_cache_against_the_dequantized_one(fp8):
    """An fp8 latent cache with one descale: the kernel over the stored bytes equals the
    float64 reference over stored x descale (the same rows)."""
    cache, table = make_cache([33, 7], 80, 16, torch.float32)
    descale = torch.tensor(0.05)
    stored = fusedattn.fp8.quantize(torch.nan_to_num(cache, nan=0.0), descale, fp8)
    stored.view(torch.uint8)[cache.isnan()] = 0x7F  # unused slots stay NaN in the fp8 cache
    q = torch.randn(2, 1, 3, 80).to(torch.bfloat16)
    lengths = torch.tensor([33, 7], dtype=torch.int32)
    call = dict(cache_seqlens=lengths, block_table=table, head_dim_v=64)
    out = fusedattn.mla_attention_with_kvcache(q, stored, kv_descale=descale, backend="triton",
                                               **call)  # fmt: skip
    dequantized = stored.double() * 0.05
    want = reference.mla_attention_with_kvcache(q.double(), dequantized, **call)
    base = reference.mla_attention_with_kvcache(q, stored, kv_descale=descale, **call)
    assert torch.isfinite(out).all()
    assert_close_kx(out, want, base)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_append_writes_the_latent_and_rope_columns_in_place(backend):
    cache, table = make_cache([10, 30], 80, 8, torch.float32)
    before = cache.clone()
    seqlens = torch.tensor([10, 30], dtype=torch.int32)
    kv_c, k_pe = torch.randn(2, 2, 64), torch.randn(2, 2, 16)
    q = torch.randn(2, 2, 3, 80)
    kw = dict(cache_seqlens=seqlens, block_table=table, head_dim_v=64, is_causal=True)
    out = fusedattn.mla_attention_with_kvcache(q, cache, kv_c, k_pe, backend=backend, **kw)
    for b in range(2):
        for t in range(2):
            pos = int(seqlens[b]) + t
            row = cache[table[b, pos // 8], pos % 8, 0]
            assert torch.equal(row, torch.cat([kv_c[b, t], k_pe[b, t]]))
            before[table[b, pos // 8], pos % 8, 0] = row
    assert torch.equal(cache.nan_to_num(7.0), before.nan_to_num(7.0)), "wrote elsewhere"
    want = reference.mla_attention_with_kvcache(q.double(), cache.double(),
                                                cache_seqlens=seqlens + 2, block_table=table,
                                                head_dim_v=64, is_causal=True)  # fmt: skip
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@kernels
def test_the_split_count_changes_nothing_but_the_last_bits():
    def run(n):
        torch.manual_seed(3)
        return check("triton", lengths=(70, 33), num_splits=n)[0]

    outs = [run(n) for n in (1, 3)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-6)
    again = run(3)
    assert torch.equal(again, outs[1]), "deterministic: the same inputs give the same bits"


@kernels
def test_batch_invariance_a_sequence_alone_and_in_a_batch():
    """Under fusedattn.batch_invariant a sequence's output is the same bits alone and among
    others of other lengths (splits at fixed positions, ordered combine)."""
    torch.manual_seed(5)
    cache, table = make_cache([90, 17, 140], 80, 16, torch.float32, capacity=160)
    q = torch.randn(3, 1, 3, 80)
    kw = dict(head_dim_v=64, backend="triton")
    with fusedattn.batch_invariant():
        batch = fusedattn.mla_attention_with_kvcache(
            q, cache, cache_seqlens=torch.tensor([90, 17, 140], dtype=torch.int32),
            block_table=table, **kw,
        )  # fmt: skip
        alone = fusedattn.mla_attention_with_kvcache(
            q[:1], cache, cache_seqlens=torch.tensor([90], dtype=torch.int32),
            block_table=table[:1], **kw,
        )  # fmt: skip
        with pytest.raises(ValueError, match=r"num_splits=2: fusedattn\.batch_invariant"):
            fusedattn.mla_attention_with_kvcache(q, cache, cache_seqlens=90, block_table=table,
                                                 num_splits=2, **kw)  # fmt: skip
    assert torch.equal(batch[:1], alone)


def test_bad_input_is_refused_by_name_before_anything_is_written():
    cache, table = make_cache([10, 3], 80, 8, torch.float32)
    q = torch.randn(2, 1, 3, 80)
    lengths = torch.tensor([10, 3], dtype=torch.int32)
    kw = dict(cache_seqlens=lengths, block_table=table, head_dim_v=64)
    snapshot = cache.clone()
    cases = [
        (dict(head_dim_v=81), "head_dim_v must be in \\[1, D\\]"),
        (dict(cache_seqlens=lengths.long()), "cache_seqlens must be int32"),
        (dict(kv_descale=torch.tensor(1.0)), "descales belong to fp8 caches"),
        (dict(cache_seqlens=torch.tensor([10, 60], dtype=torch.int32)), "cache_seqlens\\[1\\]"),
        (dict(block_table=table.long()), "block_table must be int32"),
        (dict(num_splits=-1), "num_splits must be >= 0"),
    ]
    for change, message in cases:
        with pytest.raises((ValueError, TypeError), match=message):
            fusedattn.mla_attention_with_kvcache(q, cache, **(kw | change))
    with pytest.raises(ValueError, match="kv_c and k_pe are appended together"):
        fusedattn.mla_attention_with_kvcache(q, cache, torch.randn(2, 1, 64), **kw)
    with pytest.raises(ValueError, match="kv_cache rows must have q's D = 72"):
        fusedattn.mla_attention_with_kvcache(torch.randn(2, 1, 3, 72), cache, **kw)
    with pytest.raises(ValueError, match="no cuda implementation of mla_attention_with_kvcache"):
        fusedattn.mla_attention_with_kvcache(q, cache, backend="cuda", **kw)
    with pytest.raises(ValueError, match="inference only"):
        fusedattn.mla_attention_with_kvcache(q.requires_grad_(), cache, **kw)
    assert torch.equal(cache.nan_to_num(7.0), snapshot.nan_to_num(7.0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_decode_step_with_its_append_compiles_whole(backend):
    cache, table = make_cache([10, 30], 80, 8, torch.float32)
    eager_cache = cache.clone()
    seqlens = torch.tensor([10, 30], dtype=torch.int32)
    q, kv_c, k_pe = torch.randn(2, 1, 3, 80), torch.randn(2, 1, 64), torch.randn(2, 1, 16)

    def step(q, cache, kv_c, k_pe):
        return fusedattn.mla_attention_with_kvcache(
            q, cache, kv_c, k_pe, cache_seqlens=seqlens, block_table=table, head_dim_v=64,
            backend=backend,
        )  # fmt: skip

    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(q, cache.clone(), kv_c, k_pe)
    assert explained.graph_break_count == 0, explained.break_reasons
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(q, cache, kv_c, k_pe)
    want = step(q, eager_cache, kv_c, k_pe)
    torch.testing.assert_close(got, want)
    assert torch.equal(cache.nan_to_num(7.0), eager_cache.nan_to_num(7.0))


@kernels
def test_a_latent_without_rope_columns():
    """head_dim_v = D (Dr = 0): the kernel takes the latent alone (no rope dot)."""
    check("triton", Dl=64, Dr=0, lengths=(30, 4), Hq=3, Tq=2, is_causal=True)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=kernels)])
def test_flash_mla_compat_keeps_flashmlas_conventions(backend, monkeypatch):
    """FlashMLA's names, shapes and returns; an empty sequence's lse +inf (FlashMLA's, where
    fusedattn's is -inf); the scale 1/sqrt(head_dim) by default; the scheduling object's
    reuse checked; the older get_mla_metadata arguments and num_splits tensor accepted."""
    from fusedattn.compat import flash_mla

    monkeypatch.setenv("FUSEDATTN_BACKEND", backend)
    cache, table = make_cache([37, 0], 80, 16, torch.float32)
    q = torch.randn(2, 2, 4, 80)
    seqlens = torch.tensor([37, 0], dtype=torch.int32)
    meta, num_splits = flash_mla.get_mla_metadata(seqlens, 2 * 4, 1)  # the old interface
    out, lse = flash_mla.flash_mla_with_kvcache(q, cache, table, seqlens, 64, meta, num_splits,
                                                causal=True)  # fmt: skip
    want, want_lse = reference.mla_attention_with_kvcache(
        q.double(), cache.double(), cache_seqlens=seqlens, block_table=table, head_dim_v=64,
        scale=80**-0.5, is_causal=True, return_lse=True,
    )  # fmt: skip
    assert out.shape == (2, 2, 4, 64) and lse.shape == (2, 4, 2) and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    assert (lse[1] == float("inf")).all() and (want_lse[1] == float("-inf")).all()
    torch.testing.assert_close(lse[0].double(), want_lse[0].double(), rtol=1e-4, atol=1e-4)
    with pytest.raises(AssertionError, match="inconsistent with sched_meta"):
        flash_mla.flash_mla_with_kvcache(q[:, :1], cache, table, seqlens, 64, meta)
    with pytest.raises(ValueError, match="is_fp8_kvcache: k_cache must hold 656-byte rows"):
        flash_mla.flash_mla_with_kvcache(q, cache, table, seqlens, 64,
                                         flash_mla.get_mla_metadata()[0], is_fp8_kvcache=True)  # fmt: skip


@kernels
@pytest.mark.parametrize("paged", [False, True], ids=["packed", "paged"])
def test_mla_prefill_runs_as_varlen_attention_at_192_and_128(paged):
    """MLA's prefill (non-absorbed): q and k of head dim 192 (128 nope + 64 rope), v of 128,
    16 heads, through varlen_attention on Triton: packed and causal, or over a paged cache
    holding earlier context chunks (the queries bottom-right of their keys), with the lse
    vLLM merges context chunks by. The tiles pad 192 to 256 columns in QKᵀ (docs/mla.md)."""
    from fusedattn.testing import assert_close_kx as kx

    g = torch.Generator().manual_seed(2)
    lengths_k = [12, 17, 40] if paged else [5, 17, 30]  # queries: 5, 17 and 9
    device = torch.get_default_device()
    cu_q = torch.tensor([0, 5, 22, 31], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32,
                        device=device)  # fmt: skip
    q = torch.randn(31, 16, 192, generator=g).to(device)
    total_k = sum(lengths_k)
    k = torch.randn(total_k, 16, 192, generator=g).to(device)
    v = torch.randn(total_k, 16, 128, generator=g).to(device)
    kw = dict(is_causal=True, causal_alignment="bottom_right", return_lse=True)
    if paged:  # the keys in pages of 8, each sequence's pages shuffled
        page, per_seq = 8, 5
        k_cache = torch.full((3 * per_seq, page, 16, 192), float("nan"), device=device)
        v_cache = torch.full((3 * per_seq, page, 16, 128), float("nan"), device=device)
        table = torch.randperm(3 * per_seq, generator=g).view(3, per_seq).int().to(device)
        for b in range(3):
            rows = k[cu_k[b] : cu_k[b + 1]], v[cu_k[b] : cu_k[b + 1]]
            for pos in range(lengths_k[b]):
                k_cache[table[b, pos // page], pos % page] = rows[0][pos]
                v_cache[table[b, pos // page], pos % page] = rows[1][pos]
        with torch.no_grad():
            out, lse = fusedattn.varlen_attention(q, k_cache, v_cache, cu_q, cu_k, 17, 40,
                                                  block_table=table, backend="triton", **kw)  # fmt: skip
    else:
        out, lse = fusedattn.varlen_attention(q, k, v, cu_q, cu_k, 17, 30, backend="triton", **kw)
    max_k = max(lengths_k)
    want, want_lse = reference.varlen_attention(q.double(), k.double(), v.double(), cu_q, cu_k,
                                                17, max_k, **kw)  # fmt: skip
    base, _ = reference.varlen_attention(q, k, v, cu_q, cu_k, 17, max_k, **kw)
    assert out.shape == (31, 16, 128)
    kx(out, want, base)
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=1e-4, atol=1e-4)
