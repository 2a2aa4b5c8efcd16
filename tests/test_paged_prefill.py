"""varlen_attention over a paged KV cache (issue #50 item 5): chunked prefill and prefix-cache
hits, as flash-attention's `flash_attn_varlen_func(..., block_table=...)`. Packed new queries,
each sequence's keys its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] cache positions through
the block table, the queries bottom-right; every variant on the reference, torch and Triton
backends against float64 attention over the same keys packed without pages."""

import importlib

import pytest
import torch
from test_decode import make_cache

import fusedattn
from fusedattn import reference
from fusedattn.testing import assert_close_kx

# On a GPU machine (scripts/gpu_check.sh's grid) every tensor is made on the GPU: the Triton
# kernel compiled, the reference and torch backends on CUDA tensors.
pytestmark = pytest.mark.usefixtures("kernel_device")
BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]
Q_LENGTHS = (3, 0, 7, 1, 5)
K_LENGTHS = (20, 5, 33, 1, 4)  # the last sequence: more queries than keys (its first sees none)


def paged_case(dtype, page_size, Hq=4, Hkv=2, D=16, Dv=16, seed=0):
    """(q, k_cache, v_cache, block_table, cu_q, cu_k, k_packed, v_packed): the same keys
    paged and packed."""
    B, S = len(Q_LENGTHS), 40
    kc, vc, bt = make_cache(B, S, Hkv, D, Dv, dtype, "paged", page_size, seed=seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(Q_LENGTHS), Hq, D, generator=g, device="cpu").to(kc.device, dtype)
    cu_q = torch.tensor([0, *torch.tensor(Q_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(K_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    rows = [(b, j) for b, n in enumerate(K_LENGTHS) for j in range(n)]
    k = torch.stack([kc[bt[b, j // page_size], j % page_size] for b, j in rows])
    v = torch.stack([vc[bt[b, j // page_size], j % page_size] for b, j in rows])
    return q, kc, vc, bt, cu_q, cu_k, k, v


VARIANTS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(window_size=(6, 0)),
    "window_both_sides": dict(window_size=(4, 2)),
    "softcap": dict(softcap=2.5),
    "alibi": dict(alibi_slopes="heads", is_causal=True),
    "alibi_per_sequence": dict(alibi_slopes="batch"),
    "sinks": dict(sinks=True, is_causal=True),
    "scale": dict(scale=0.4),
}
TORCH_REFUSES = {"softcap"}


def run(backend, dtype, page_size, variant, Hq=4, Hkv=2, D=16, Dv=16):
    q, kc, vc, bt, cu_q, cu_k, k, v = paged_case(dtype, page_size, Hq, Hkv, D, Dv)
    kw = dict(variant, causal_alignment="bottom_right")
    if kw.get("alibi_slopes") == "heads":
        kw["alibi_slopes"] = torch.rand(Hq) * 0.5
    elif kw.get("alibi_slopes") == "batch":
        kw["alibi_slopes"] = torch.rand(len(Q_LENGTHS), Hq) * 0.5
    if kw.get("sinks"):
        kw["sinks"] = torch.randn(Hq).to(dtype)
    args = (cu_q, cu_k, max(Q_LENGTHS), max(K_LENGTHS))
    with torch.no_grad():
        got = fusedattn.varlen_attention(q, kc, vc, *args, block_table=bt, enable_gqa=True,
                                         return_lse=backend != "torch", backend=backend, **kw)  # fmt: skip
    f64 = {n: (t.double() if isinstance(t, torch.Tensor) and n != "alibi_slopes" else t)
           for n, t in kw.items()}  # fmt: skip
    truth = reference.varlen_attention(q.double(), k.double(), v.double(), *args,
                                       enable_gqa=True, return_lse=True, **f64)  # fmt: skip
    base = reference.varlen_attention(q, k, v, *args, enable_gqa=True, **kw)
    out = got[0] if backend != "torch" else got
    assert out.shape == (q.shape[0], Hq, Dv) and out.dtype == dtype
    assert_close_kx(out, truth[0], base, name="out")
    if backend != "torch":
        torch.testing.assert_close(got[1].double(), truth[1].double(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_against_the_keys_packed(backend, name):
    if backend == "torch" and name in TORCH_REFUSES:
        with pytest.raises(fusedattn.BackendUnavailableError, match="softcap"):
            run(backend, torch.float32, 8, VARIANTS[name])
        return
    run(backend, torch.float32, 8, VARIANTS[name])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_page_sizes_from_one_with_gqa(backend, page_size):
    run(backend, torch.float32, page_size, dict(is_causal=True), Hq=6, Hkv=2, D=40, Dv=24)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_half_precision_every_option_at_once(dtype):
    run("triton", dtype, 5, dict(window_size=(9, 0), softcap=3.0, alibi_slopes="batch",
                                 sinks=True))  # fmt: skip


@pytest.mark.kernels
def test_triton_reads_the_pages_in_place_never_a_gathered_copy(monkeypatch):
    """The Triton path launches the decode kernel with packed queries over the cache itself:
    no gather (the torch backend's paged_positions is never called), NaN in pages no sequence
    owns never reaches the output."""
    torch_backend = importlib.import_module("fusedattn.ops.attention.torch_backend")

    monkeypatch.setattr(torch_backend, "paged_positions", lambda *a: pytest.fail("gathered"))
    q, kc, vc, bt, cu_q, cu_k, _, _ = paged_case(torch.float32, 8)
    used = {int(p) for b, n in enumerate(K_LENGTHS) for p in bt[b, : -(-n // 8)]}
    for page in set(range(kc.shape[0])) - used:
        kc[page], vc[page] = float("nan"), float("nan")
    with torch.no_grad():
        out = fusedattn.varlen_attention(q, kc, vc, cu_q, cu_k, 7, 33, block_table=bt,
                                         enable_gqa=True, backend="triton")  # fmt: skip
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_nan_past_each_sequence_and_in_unowned_pages_never_leaks(backend):
    """The torch path gathers the pages into a copy: positions past a sequence's keys and pages
    no sequence owns may hold NaN (an empty cache) and must add nothing."""
    q, kc, vc, bt, cu_q, cu_k, _, _ = paged_case(torch.float32, 8)
    for b, n in enumerate(K_LENGTHS):
        for j in range(n, bt.shape[1] * 8):
            kc[bt[b, j // 8], j % 8], vc[bt[b, j // 8], j % 8] = float("nan"), float("nan")
    used = {int(p) for b, n in enumerate(K_LENGTHS) for p in bt[b, : -(-n // 8)]}
    for page in set(range(kc.shape[0])) - used:
        kc[page], vc[page] = float("nan"), float("nan")
    with torch.no_grad():
        out = fusedattn.varlen_attention(q, kc, vc, cu_q, cu_k, 7, 33, block_table=bt,
                                         enable_gqa=True, is_causal=True,
                                         causal_alignment="bottom_right", backend=backend)  # fmt: skip
    assert torch.isfinite(out).all()


def test_refusals_and_bad_values_are_clear_errors():
    q, kc, vc, bt, cu_q, cu_k, _, _ = paged_case(torch.float32, 8)
    args = (q, kc, vc, cu_q, cu_k, 7, 33)
    with torch.no_grad():
        with pytest.raises(ValueError, match="causal_alignment='bottom_right'"):
            fusedattn.varlen_attention(*args, block_table=bt, is_causal=True, enable_gqa=True)
        with pytest.raises(ValueError, match="no dropout"):
            fusedattn.varlen_attention(*args, block_table=bt, dropout_p=0.1, enable_gqa=True)
        with pytest.raises(ValueError, match=r"\(num_pages, page_size, Hkv, D\)"):
            fusedattn.varlen_attention(q, kc[:, 0], vc[:, 0], cu_q, cu_k, 7, 33,
                                       block_table=bt, enable_gqa=True)  # fmt: skip
        for backend in ("reference", "torch"):
            bad = bt.clone()
            bad[2, 1] = kc.shape[0]
            with pytest.raises(ValueError, match=r"block_table\[2, 1\]"):
                fusedattn.varlen_attention(*args, block_table=bad, enable_gqa=True,
                                           backend=backend)  # fmt: skip
            long = cu_k.clone()
            long[3:] += 20  # sequence 2 with 53 keys in a cache of 40 positions a sequence
            with pytest.raises(ValueError, match=r"cu_seqlens_k\[3\] - cu_seqlens_k\[2\] = 53"):
                fusedattn.varlen_attention(q, kc, vc, cu_q, long, 7, 53, block_table=bt,
                                           enable_gqa=True, backend=backend)  # fmt: skip
    leaf = q.clone().requires_grad_()
    with pytest.raises(ValueError, match="inference only"):
        fusedattn.varlen_attention(leaf, kc, vc, cu_q, cu_k, 7, 33, block_table=bt,
                                   enable_gqa=True)  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["causal", "alibi_per_sequence"])
def test_a_paged_prefill_compiles_whole(backend, variant):
    """One op in the graph, eager's answer bit for bit. ALiBi without a window is bottom-right
    too (masks.make_window): the op carries the alignment, a compiled call once read it as
    top-left from the unbounded window (torch backend 1.08 off, reference refused)."""
    q, kc, vc, bt, cu_q, cu_k, _, _ = paged_case(torch.float32, 8)
    kw = dict(is_causal=True)
    if variant == "alibi_per_sequence":
        g = torch.Generator().manual_seed(3)
        slopes = torch.rand(len(Q_LENGTHS), 4, generator=g, device="cpu") * 0.5
        kw = dict(alibi_slopes=slopes.to(q.device))

    def prefill(q, kc, vc):
        return fusedattn.varlen_attention(q, kc, vc, cu_q, cu_k, 7, 33, block_table=bt,
                                          causal_alignment="bottom_right", enable_gqa=True,
                                          backend=backend, **kw)  # fmt: skip

    with torch.no_grad():
        want = prefill(q, kc, vc)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(prefill)(q, kc, vc)
        assert explained.graph_break_count == 0, explained.break_reasons
        torch._dynamo.reset()
        got = torch.compile(prefill, fullgraph=True, backend="aot_eager")(q, kc, vc)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.kernels
@pytest.mark.parametrize("splits", [2, 3])
def test_triton_key_splits_combine_per_packed_row(splits, monkeypatch):
    """The split-key path (partials per packed query row, merged by decode_combine, rows past
    a sequence's queries left alone): the reference's answer for any split count."""
    from fusedattn.ops.shared import decode_launch

    monkeypatch.setattr(decode_launch, "default_splits", lambda *args: splits)
    run("triton", torch.float32, 4, dict(window_size=(11, 0), sinks=True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_when_the_page_size_equals_the_query_heads(backend):
    """The kv heads are the cache's dim -2: a page of 4 slots beside 4 query heads over 2 kv
    heads was read as multi-head attention by the torch and reference backends."""
    run(backend, torch.float32, 4, dict(is_causal=True), Hq=4, Hkv=2)
