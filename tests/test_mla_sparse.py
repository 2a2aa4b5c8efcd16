"""DeepSeek sparse attention over the latent cache (issue #85 item 1):
mla_attention_with_kvcache(..., indices=, topk_length=) against a float64 brute force that
attends each query over exactly the keys it lists (no code shared with the backends), under
the k× rule: topk 1 to 130, pages 1, 16, 64 and a contiguous cache, Tq 1 and 2, Hq 1 and 16,
unused (-1) entries, rows with none, duplicates, topk_length shorter than topk, NaN in every
unlisted slot, sinks, fp8 caches, splits, is_causal on a contiguous cache; the refusals, batch
invariance and torch.compile.
"""

from __future__ import annotations

import pytest
import torch

import fusedattn
from fusedattn import reference
from fusedattn.testing import assert_close_kx

pytestmark = pytest.mark.usefixtures("kernel_device")
kernels = pytest.mark.kernels
Dl, Dr = 32, 16
D = Dl + Dr


def _device():
    return torch.get_default_device()


def make_case(B=2, Tq=1, Hq=4, topk=20, page=16, lengths=(50, 37), seed=0, dtype=torch.float32):
    """(q, cache, block_table or None, cache_seqlens, indices): a cache whose listed rows are
    random and every other slot NaN or inf; indices drawn from each sequence's keys (a paged cache:
    their slots), a few -1 and a duplicate."""
    g = torch.Generator().manual_seed(seed)
    lengths = list(lengths)[:B]
    S = max(lengths) + 3
    if page:
        per_seq = -(-S // page)
        pages = B * per_seq + 2
        table = torch.randperm(pages, generator=g)[: B * per_seq].view(B, per_seq).int()
        cache = torch.full((pages, page, 1, D), float("nan"))
    else:
        table = None
        cache = torch.full((B, S, 1, D), float("nan"))
    positions = [
        torch.randint(0, n, (Tq, topk), generator=g) if n else torch.full((Tq, topk), -1)
        for n in lengths
    ]
    indices = torch.stack(positions).int()  # positions in the sequence
    listed = indices >= 0
    slots = indices.clone()
    if page:  # the cache slot of each position
        slots = torch.where(listed, table.long().gather(
            1, (indices.clamp(min=0) // page).view(B, -1)).view(B, Tq, topk) * page
            + indices % page, -1).int()  # fmt: skip
    cache.view(-1, D)[::2] = float("inf")  # every unlisted slot NaN or inf
    rows = cache.view(-1, D) if page else None
    for b in range(B):  # only the listed rows hold numbers
        for s in slots[b][slots[b] >= 0].unique().tolist():
            value = torch.randn(D, generator=g)
            if page:
                rows[s] = value
            else:
                cache[b, s, 0] = value
    if topk > 3:
        slots[0, 0, 1] = -1
        slots[-1, -1, 2] = slots[-1, -1, 3]  # a duplicate: counts once
    q = torch.randn(B, Tq, Hq, D, generator=g) * 2
    to = dict(device=_device())
    table = None if table is None else table.to(**to)
    return (q.to(dtype).to(**to), cache.to(dtype).to(**to), table,
            torch.tensor(lengths, dtype=torch.int32, **to), slots.to(**to))  # fmt: skip


def brute_force(
    q,
    cache,
    table,
    seqlens,
    slots,
    topk_length=None,
    sinks=None,
    scale=None,
    is_causal=False,
    descale=None,
):
    """float64, each query over the set of keys it lists: (out, lse)."""
    B, Tq, Hq, _ = q.shape
    scale = D**-0.5 if scale is None else scale
    rows = cache.double()
    if descale is not None:
        rows = cache.float().double() * float(descale)
    out = torch.zeros(B, Tq, Hq, Dl, dtype=torch.float64)
    lse = torch.full((B, Hq, Tq), float("-inf"), dtype=torch.float64)
    for b in range(B):
        for i in range(Tq):
            entries = slots[b, i].tolist()
            if topk_length is not None:
                entries = entries[: int(topk_length[b])]
            keys = sorted({e for e in entries if e >= 0})
            if is_causal:
                keys = [k for k in keys if k <= int(seqlens[b]) - Tq + i]
            kv = (rows.view(-1, D)[keys] if table is not None else rows[b, keys, 0]).cpu()
            s = q[b, i].double().cpu() @ kv.T * scale  # (Hq, n)
            if sinks is not None:
                s = torch.cat([s, sinks.double().cpu()[:, None]], dim=1)
                kv = torch.cat([kv, torch.zeros(1, D, dtype=torch.float64)])
            if s.shape[1] == 0:
                continue
            m = s.max(dim=1, keepdim=True).values
            p = torch.exp(s - m)
            out[b, i] = (p @ kv[:, :Dl]) / p.sum(1, keepdim=True)
            lse[b, :, i] = (m + p.sum(1, keepdim=True).log())[:, 0]
    return out, lse


def run(backend, q, cache, table, seqlens, slots, **kw):
    with torch.no_grad():
        return fusedattn.mla_attention_with_kvcache(
            q, cache, cache_seqlens=seqlens, block_table=table, head_dim_v=Dl, indices=slots,
            return_lse=True, backend=backend, **kw,
        )  # fmt: skip


def check(backend, case, **kw):
    q, cache, table, seqlens, slots = case
    out, lse = run(backend, q, cache, table, seqlens, slots, **kw)
    want, want_lse = brute_force(q, cache, table, seqlens, slots, **kw)
    base, _ = run("reference", q, cache, table, seqlens, slots, **kw)
    assert torch.isfinite(out).all(), "a NaN or inf in an unlisted slot reached the output"
    assert_close_kx(out, want.to(out.device), base, name="out")
    finite = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), finite)
    torch.testing.assert_close(lse.double().cpu()[finite], want_lse[finite], rtol=1e-4, atol=1e-4)
    return out, lse


BACKENDS = ["reference", pytest.param("triton", marks=kernels)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("topk,page,Tq,Hq", [(1, 16, 1, 1), (7, 1, 2, 16), (64, 64, 1, 4),
                                             (130, 16, 2, 4), (20, 0, 2, 16)])  # fmt: skip
def test_each_query_attends_to_exactly_its_listed_keys(backend, topk, page, Tq, Hq):
    check(backend, make_case(Tq=Tq, Hq=Hq, topk=topk, page=page, seed=topk))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unused_entries_empty_rows_topk_length_and_sinks(backend):
    q, cache, table, seqlens, slots = make_case(B=3, Tq=2, topk=24, lengths=(50, 0, 20), seed=3)
    slots[2, 1] = -1  # a query with no key at all
    topk_length = torch.tensor([24, 0, 9], dtype=torch.int32, device=slots.device)
    sinks = torch.randn(4, device=slots.device)
    out, lse = check(backend, (q, cache, table, seqlens, slots), topk_length=topk_length)
    assert torch.equal(out[1], torch.zeros_like(out[1]))  # sequence 1: topk_length 0
    assert torch.isinf(lse[1]).all() and torch.equal(out[2, 1], torch.zeros_like(out[2, 1]))
    check(backend, (q, cache, table, seqlens, slots), topk_length=topk_length, sinks=sinks)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_duplicate_counts_once(backend):
    q, cache, table, seqlens, slots = make_case(Tq=1, topk=8, seed=4)
    once, _ = run(backend, q, cache, table, seqlens, slots)
    twice = torch.cat([slots, slots], dim=-1)  # every key listed twice
    again, _ = run(backend, q, cache, table, seqlens, twice)
    torch.testing.assert_close(again, once, rtol=1e-6, atol=1e-6)


@kernels
def test_causal_on_a_contiguous_cache_splits_and_half_precision():
    case = make_case(Tq=2, Hq=16, topk=40, page=0, seed=6)
    check("triton", case, is_causal=True)
    one, _ = run("triton", *case, num_splits=1)
    split, _ = run("triton", *case, num_splits=3)
    torch.testing.assert_close(split, one, rtol=1e-5, atol=1e-5)
    check("triton", make_case(Tq=2, topk=33, seed=7, dtype=torch.bfloat16))


@kernels
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_an_fp8_cache_reads_its_listed_rows_dequantized(fp8):
    q, cache, table, seqlens, slots = make_case(topk=30, seed=8)
    descale = torch.tensor([0.05], device=cache.device)
    stored = (cache / descale).to(fp8)
    out, _ = run("triton", q.to(torch.bfloat16), stored, table, seqlens, slots, kv_descale=descale)
    want, _ = brute_force(q, stored, table, seqlens, slots, descale=descale)
    base, _ = run("reference", q.to(torch.bfloat16), stored, table, seqlens, slots,
                  kv_descale=descale)  # fmt: skip
    assert_close_kx(out.float(), want.to(out.device), base.float(), name="out")


@kernels
def test_batch_invariance_a_query_alone_and_in_a_batch():
    q, cache, table, seqlens, slots = make_case(B=3, topk=50, lengths=(50, 20, 44), seed=9)
    with fusedattn.batch_invariant():
        batch, _ = run("triton", q, cache, table, seqlens, slots)
        alone, _ = run("triton", q[:1], cache, table[:1], seqlens[:1], slots[:1])
    assert torch.equal(batch[:1], alone)


def test_bad_indices_are_refused_by_name_before_any_launch():
    q, cache, table, seqlens, slots = make_case(topk=6, page=0, seed=10)
    for bad, pattern in (
        (slots.long(), "indices must be int32"),
        (slots[:, :, None], "indices must be 3-D"),
        (slots[:1], r"indices must be \(B, Tq, topk\)"),
        (torch.where(slots == slots[1, 0, 0], 37, slots), "key 37 is past its sequence's length"),
        (torch.where(slots == slots[0, 0, 0], -2, slots), "an entry is a key index or -1"),
    ):
        with pytest.raises((TypeError, ValueError), match=pattern):
            run("reference", q, cache, table, seqlens, bad)
    with pytest.raises(ValueError, match=r"topk_length\[1\] = 7 is outside \[0, topk = 6\]"):
        run("reference", q, cache, table, seqlens, slots,
            topk_length=torch.tensor([6, 7], dtype=torch.int32, device=slots.device))  # fmt: skip
    with pytest.raises(ValueError, match="topk_length is given without indices"):
        fusedattn.mla_attention_with_kvcache(q, cache, cache_seqlens=seqlens, head_dim_v=Dl,
                                             topk_length=seqlens)  # fmt: skip
    paged = make_case(topk=6, page=16, seed=11)
    with pytest.raises(ValueError, match="is_causal with indices over a paged cache"):
        run("reference", *paged, is_causal=True)
    slots_held = paged[1].shape[0] * paged[1].shape[1]
    past = paged[4].clone()
    past[0, 0, 0] = slots_held
    with pytest.raises(ValueError, match=f"past the cache's {slots_held} slots"):
        run("reference", *paged[:4], past)
    with pytest.raises(ValueError, match="the torch backend has no sparse path"):
        run("torch", q, cache, table, seqlens, slots)


@kernels
def test_a_sparse_decode_step_compiles_whole():
    q, cache, table, seqlens, slots = make_case(topk=12, seed=12)

    def step(q, slots):
        return fusedattn.mla_attention_with_kvcache(
            q, cache, cache_seqlens=seqlens, block_table=table, head_dim_v=Dl, indices=slots,
            backend="triton",
        )  # fmt: skip

    with torch.no_grad():
        eager = step(q, slots)
        # aot_eager: the custom ops' fake kernels traced whole, as test_mla's decode step
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(q, slots)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    assert reference.mla_attention_with_kvcache is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_mlas_sparse_decode_call_runs_unmodified(backend, monkeypatch):
    """flash_mla_with_kvcache(q, k_cache, None, None, dv, sched, indices=, attn_sink=,
    topk_length=) as FlashMLA's sparse tests call it: the slots of the blocked cache, no block
    table, no lengths; an empty row's lse +inf (FlashMLA's)."""
    from fusedattn.compat import flash_mla

    q, cache, table, seqlens, slots = make_case(topk=16, page=16, seed=13)
    slots[1, 0] = -1  # a query with no key
    sinks = torch.randn(4, device=q.device)
    want, want_lse = run(backend, q, cache, table, seqlens, slots, sinks=sinks)
    original = flash_mla.mla_attention_with_kvcache
    monkeypatch.setattr(flash_mla, "mla_attention_with_kvcache",
                        lambda *a, **kw: original(*a, backend=backend, **kw))  # fmt: skip
    meta, _ = flash_mla.get_mla_metadata()
    with torch.no_grad():
        out, lse = flash_mla.flash_mla_with_kvcache(q, cache, None, None, Dl, meta, None,
                                                    indices=slots, attn_sink=sinks)  # fmt: skip
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(lse, want_lse)  # sequence 1 sees its sink alone
    torch.testing.assert_close(lse[1, :, 0], sinks)
    meta, _ = flash_mla.get_mla_metadata()
    with torch.no_grad():
        _, lse = flash_mla.flash_mla_with_kvcache(q, cache, None, None, Dl, meta, None,
                                                  indices=slots)  # fmt: skip
    assert torch.equal(lse[1], torch.full_like(lse[1], float("inf")))  # FlashMLA's empty row
    for kw, pattern in ((dict(is_fp8_kvcache=True), "k_cache must hold 656-byte rows"),
                        (dict(causal=True), "causal must be False with indices"),
                        (dict(extra_k_cache=cache), "a second \\(extra\\) cache")):  # fmt: skip
        with pytest.raises(ValueError, match=pattern):
            flash_mla.flash_mla_with_kvcache(q, cache, None, None, Dl, meta, None,
                                             indices=slots, **kw)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_sparse_prefill_is_each_querys_attention_over_its_rows(backend):
    """mla_sparse_attention (FlashMLA's flash_mla_sparse_fwd contract): Sq queries over one
    latent buffer, each its own rows, topk_length per query; the compat call's max_logits."""
    from fusedattn.compat import flash_mla

    g = torch.Generator().manual_seed(14)
    Sq, Skv, Hq, topk = 9, 40, 4, 12
    q = torch.randn(Sq, Hq, D, generator=g).to(_device())
    kv = torch.randn(Skv, 1, D, generator=g).to(_device())
    indices = torch.randint(0, Skv, (Sq, 1, topk), generator=g).int().to(_device())
    indices[3, 0, :5] = -1
    topk_length = torch.tensor([12, 12, 3, 12, 0, 12, 7, 12, 12], dtype=torch.int32,
                               device=_device())  # fmt: skip
    with torch.no_grad():
        out, lse = fusedattn.mla_sparse_attention(q, kv, indices, head_dim_v=Dl,
                                                  topk_length=topk_length, return_lse=True,
                                                  backend=backend)  # fmt: skip
    seqlens = torch.tensor([Skv], dtype=torch.int32)
    # topk_length per query: the brute force lists only each query's prefix
    prefix = indices[:, 0].clone()
    prefix[torch.arange(topk, device=prefix.device) >= topk_length[:, None]] = -1
    want, want_lse = brute_force(q[None], kv[None], None, seqlens, prefix[None])
    torch.testing.assert_close(out.double().cpu(), want[0], rtol=1e-4, atol=1e-5)
    finite = torch.isfinite(want_lse[0].T)
    assert torch.equal(torch.isfinite(lse).cpu(), finite) and torch.isinf(lse[4]).all()
    # a float32 lse: check()'s tolerance, not float64's default (one entry was 2e-7 off in
    # relative terms on a fresh environment, over the 1e-7 that default allows)
    torch.testing.assert_close(
        lse.double().cpu()[finite], want_lse[0].T[finite], rtol=1e-4, atol=1e-4
    )
    flash_out, max_logits, flash_lse = flash_mla.flash_mla_sparse_fwd(
        q, kv, indices, D**-0.5, d_v=Dl, topk_length=topk_length)  # fmt: skip
    torch.testing.assert_close(flash_out, out, rtol=1e-5, atol=1e-5)  # its backend: auto's
    torch.testing.assert_close(flash_lse, lse, rtol=1e-5, atol=1e-5)
    logits = torch.einsum("shd,std->sht", q.double(), kv[indices[:, 0].long(), 0].double())
    logits = logits * D**-0.5
    logits[(prefix < 0)[:, None, :].expand_as(logits)] = float("-inf")
    torch.testing.assert_close(max_logits.double(), logits.amax(-1), rtol=1e-5, atol=1e-5)


# ---- DeepSeek's 656-byte fp8 rows (issue #85 item 3) ----------------------------------------


def _format_float64(x):
    """The 656-byte row of FlashMLA's tests, computed in float64: per 128-value group the
    scale amax / 448 rounded up to a power of two (1 for an all-zero group), the values
    x / scale in e4m3, then the 4 scales as float32 and the rope part as bfloat16."""
    x = x.double()
    groups = x[..., :512].reshape(*x.shape[:-1], 4, 128)
    amax = groups.abs().amax(-1)
    scale = torch.where(amax > 0, 2.0 ** torch.ceil(torch.log2(amax / 448.0)), 1.0)
    values = (groups / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return torch.cat([values.reshape(*x.shape[:-1], 512).view(torch.uint8),
                      scale.float().view(torch.uint8),
                      x[..., 512:].to(torch.bfloat16).view(torch.uint8)], dim=-1)  # fmt: skip


def test_the_656_byte_rows_round_trip_as_flashmlas_format():
    from fusedattn.fp8 import dequantize_mla_ds, quantize_mla_ds

    g = torch.Generator().manual_seed(15)
    x = torch.randn(3, 7, 576, generator=g) * torch.logspace(-3, 3, 7)[None, :, None]
    x[0, 0, :128] = 0.0  # an all-zero group
    x[1, 1, 5] = 1e30  # saturates its group's scale, not the others
    rows = quantize_mla_ds(x)
    assert rows.dtype == torch.uint8 and rows.shape == (3, 7, 656)
    assert torch.equal(rows, _format_float64(x))
    back = dequantize_mla_ds(rows).double()
    groups = rows[..., 512:528].contiguous().view(torch.float32).double()
    want = torch.cat([(rows[..., :512].contiguous().view(torch.float8_e4m3fn).double()
                       .reshape(3, 7, 4, 128) * groups[..., None]).reshape(3, 7, 512),
                      x[..., 512:].to(torch.bfloat16).double()], dim=-1)  # fmt: skip
    assert torch.equal(back, want)
    assert (back[..., :512] - x[..., :512].double()).abs().max() <= x.abs().max() * 2**-4


@kernels
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_decode_reads_the_656_byte_rows_in_place(sparse):
    """The dense and sparse decode over a 656-byte cache against the float64 attention over the
    values its rows hold (the row format's own error is not the kernel's)."""
    from fusedattn.fp8 import dequantize_mla_ds, quantize_mla_ds

    g = torch.Generator().manual_seed(16)
    B, Hq, page, pages = 2, 4, 16, 7
    rows = quantize_mla_ds(torch.randn(pages, page, 1, 576, generator=g)).to(_device())
    table = torch.randperm(pages, generator=g)[:6].view(B, 3).int().to(_device())
    seqlens = torch.tensor([45, 19], dtype=torch.int32, device=_device())
    q = torch.randn(B, 2, Hq, 576, generator=g).to(torch.bfloat16).to(_device())
    kw = dict(cache_seqlens=seqlens, block_table=table, head_dim_v=512, return_lse=True)
    if sparse:
        kw["indices"] = torch.randint(0, pages * page, (B, 2, 24), generator=g).int().to(_device())
    values = dequantize_mla_ds(rows)
    with torch.no_grad():
        out, lse = fusedattn.mla_attention_with_kvcache(q, rows, backend="triton", **kw)
        want, want_lse = fusedattn.mla_attention_with_kvcache(q.double(), values.double(),
                                                              backend="reference", **kw)  # fmt: skip
        base, _ = fusedattn.mla_attention_with_kvcache(q, rows, backend="reference", **kw)
    assert out.dtype == torch.bfloat16
    assert_close_kx(out.float(), want, base.float(), name="out")
    torch.testing.assert_close(lse.double(), want_lse.double(), rtol=1e-3, atol=1e-3)


def test_an_append_writes_656_byte_rows_and_bad_calls_are_refused():
    from fusedattn.fp8 import quantize_mla_ds

    g = torch.Generator().manual_seed(17)
    rows = torch.zeros(4, 16, 1, 656, dtype=torch.uint8, device=_device())
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=_device())
    seqlens = torch.tensor([5, 16], dtype=torch.int32, device=_device())
    kv_c = torch.randn(2, 2, 512, generator=g).to(_device())
    k_pe = torch.randn(2, 2, 64, generator=g).to(_device())
    q = torch.randn(2, 1, 4, 576, generator=g).to(_device())
    with torch.no_grad():
        fusedattn.mla_attention_with_kvcache(q, rows, kv_c, k_pe, cache_seqlens=seqlens,
                                             block_table=table, backend="reference")  # fmt: skip
    new = quantize_mla_ds(torch.cat([kv_c, k_pe], dim=-1))
    assert torch.equal(rows[2, 5:7, 0], new[0]) and torch.equal(rows[3, 0:2, 0], new[1])
    assert int(rows[0].sum()) == 0 and int(rows[1].sum()) == 0  # nothing else written
    call = dict(cache_seqlens=seqlens, block_table=table)
    with pytest.raises(ValueError, match=r"656-byte rows .* head_dim_v 512"):
        fusedattn.mla_attention_with_kvcache(q, rows, head_dim_v=448, **call)
    with pytest.raises(ValueError, match="whose scales are in each row"):
        fusedattn.mla_attention_with_kvcache(q, rows, kv_descale=torch.ones(1), **call)
    with pytest.raises(ValueError, match="656-byte fp8 rows: the torch backend"):
        fusedattn.mla_attention_with_kvcache(q, rows, backend="torch", **call)


def test_flash_mlas_fp8_layout_runs_through_the_compat_call():
    """is_fp8_kvcache=True: FlashMLA's 656-byte rows (held as float8_e4m3fn), dense and
    sparse, equal fusedattn's own call on the same bytes."""
    from fusedattn.compat import flash_mla
    from fusedattn.fp8 import quantize_mla_ds

    g = torch.Generator().manual_seed(18)
    rows = quantize_mla_ds(torch.randn(4, 16, 1, 576, generator=g)).to(_device())
    table = torch.tensor([[1, 3], [0, 2]], dtype=torch.int32, device=_device())
    seqlens = torch.tensor([30, 9], dtype=torch.int32, device=_device())
    q = torch.randn(2, 1, 4, 576, generator=g).to(torch.bfloat16).to(_device())
    held = rows.view(torch.float8_e4m3fn)  # as FlashMLA's tests hold them
    with torch.no_grad():
        out, _ = flash_mla.flash_mla_with_kvcache(q, held, table, seqlens, 512,
                                                  flash_mla.get_mla_metadata()[0],
                                                  is_fp8_kvcache=True)  # fmt: skip
        want = fusedattn.mla_attention_with_kvcache(q, rows, cache_seqlens=seqlens,
                                                    block_table=table, head_dim_v=512)  # fmt: skip
        idx = torch.randint(0, 64, (2, 1, 10), generator=g).int().to(_device())
        sparse, _ = flash_mla.flash_mla_with_kvcache(q, held, None, None, 512,
                                                     flash_mla.get_mla_metadata()[0],
                                                     is_fp8_kvcache=True, indices=idx)  # fmt: skip
        want_sparse = fusedattn.mla_attention_with_kvcache(
            q, rows, cache_seqlens=seqlens, block_table=table, head_dim_v=512, indices=idx)  # fmt: skip
    assert torch.equal(out, want) and torch.equal(sparse, want_sparse)
