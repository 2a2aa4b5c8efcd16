"""attention_with_kvcache (issue #32): the Triton decode kernel (interpreter on CPU, compiled
on a GPU) and the torch backend against the float64 reference under the k× rule, over
contiguous, paged and Hugging Face-layout caches; bit equality across layouts for the same
split; determinism; the in-place append; NaN in unused slots; refusals and bad input."""

import itertools

import pytest
import torch

import fusedattn
from fusedattn import reference
from fusedattn.cache_layout import dense_cache
from fusedattn.testing import assert_close_kx

K = pytest.importorskip("fusedattn.triton_kernels.decode")
# Tests marked kernels run the Triton kernel: compiled on a GPU machine (tensors made on the
# default device there, the kernel_device fixture), in the interpreter on a CPU.


def make_cache(B, S, Hkv, D, Dv, dtype, layout, page_size=16, fill=None, seed=0):
    """(k_cache, v_cache, block_table) holding the same logical rows 0..S-1 per sequence in one
    of three layouts: contiguous (B, S, Hkv, D), hf ((B, Hkv, S, D).transpose(1, 2)) or paged
    (pages shuffled, a page table per sequence; spare pages filled with `fill`)."""
    g = torch.Generator().manual_seed(seed)
    device = torch.get_default_device()
    k = torch.randn(B, S, Hkv, D, generator=g, device="cpu").to(device, dtype)
    v = torch.randn(B, S, Hkv, Dv, generator=g, device="cpu").to(device, dtype)
    if layout == "contiguous":
        return k, v, None
    if layout == "hf":
        kh, vh = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        return kh.transpose(1, 2), vh.transpose(1, 2), None
    pages_per_seq = -(-S // page_size)
    num_pages = B * pages_per_seq + 3  # spare pages nobody owns
    order = torch.randperm(num_pages, generator=g, device="cpu")[: B * pages_per_seq].to(device)
    block_table = order.view(B, pages_per_seq).to(torch.int32)
    kp = torch.full((num_pages, page_size, Hkv, D), float("nan") if fill is None else fill)
    vp = torch.full((num_pages, page_size, Hkv, Dv), float("nan") if fill is None else fill)
    kp, vp = kp.to(dtype), vp.to(dtype)
    for b, p in itertools.product(range(B), range(pages_per_seq)):
        rows = slice(p * page_size, min((p + 1) * page_size, S))
        n = rows.stop - rows.start
        kp[block_table[b, p], :n] = k[b, rows]
        vp[block_table[b, p], :n] = v[b, rows]
    return kp, vp, block_table


def run_kx(backend, dtype, *, B=3, S=70, Hq=4, Hkv=2, D=16, Dv=16, Tq=1, layout="contiguous",
           page_size=16, seqlens=(5, 40, 63), leftpad=None, Tnew=0, num_splits=0,
           return_lse=True, **variants):  # fmt: skip
    torch.manual_seed(1)
    device = torch.get_default_device()  # VARIANTS' tensors were made at import, on the CPU
    variants = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in variants.items()}
    q = torch.randn(B, Tq, Hq, D).to(dtype)
    kc, vc, bt = make_cache(B, S, Hkv, D, Dv, dtype, layout, page_size)
    seq = torch.tensor(seqlens[:B], dtype=torch.int32)
    lp = None if leftpad is None else torch.tensor(leftpad[:B], dtype=torch.int32)
    new = {}
    if Tnew:
        new = dict(
            k=torch.randn(B, Tnew, Hkv, D).to(dtype), v=torch.randn(B, Tnew, Hkv, Dv).to(dtype)
        )
    kw = dict(cache_seqlens=seq, block_table=bt, cache_leftpad=lp, **variants)
    mine_cache = (kc.clone(), vc.clone())
    got = fusedattn.attention_with_kvcache(
        q, *mine_cache, **new, num_splits=num_splits, return_lse=return_lse, backend=backend,
        **kw,
    )  # fmt: skip
    f64 = {n: (t.double() if t.is_floating_point() and n != "alibi_slopes" else t)
           for n, t in kw.items() if isinstance(t, torch.Tensor)}  # fmt: skip
    truth = reference.attention_with_kvcache(
        q.double(), kc.double(), vc.double(), **{n: t.double() for n, t in new.items()},
        return_lse=True, **(kw | f64),
    )  # fmt: skip
    base = reference.attention_with_kvcache(q, kc.clone(), vc.clone(), **new, return_lse=True, **kw)
    out = got[0] if return_lse else got
    assert out.shape == (B, Tq, Hq, Dv) and out.dtype == dtype
    assert_close_kx(out, truth[0], base[0], name="out")
    if return_lse:
        torch.testing.assert_close(got[1].double(), truth[1].double(), rtol=2e-3, atol=2e-3)
    return got, mine_cache


VARIANTS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "window": dict(window_size=(9, 0)),
    "window_both_sides": dict(window_size=(5, 2)),
    "softcap": dict(softcap=2.5),
    "alibi": dict(alibi_slopes=torch.rand(4) * 0.5, is_causal=True),
    "alibi_per_sequence": dict(alibi_slopes=torch.rand(3, 4) * 0.5),
    "sinks": dict(sinks=torch.randn(4)),
    "scale": dict(scale=0.7),
}


@pytest.mark.kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_every_variant_fp32(name, num_splits):
    run_kx("triton", torch.float32, num_splits=num_splits, **VARIANTS[name])


@pytest.mark.kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("layout,page_size", [("contiguous", 16), ("hf", 16), ("paged", 1),
                                              ("paged", 3), ("paged", 16), ("paged", 32)])  # fmt: skip
def test_triton_layouts_with_leftpad_append_and_speculative_queries(layout, page_size):
    """Left-padded sequences, 3 new keys appended in the call, 4 queries (speculative
    decoding) with bottom-right causal, in every cache layout."""
    run_kx("triton", torch.float32, layout=layout, page_size=page_size, Tq=4, Tnew=3,
           leftpad=(0, 7, 20), seqlens=(5, 40, 60), is_causal=True, num_splits=2)  # fmt: skip


@pytest.mark.kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_triton_half_precision_every_option_at_once(dtype):
    run_kx("triton", dtype, layout="paged", page_size=5, Tq=2, Tnew=1, leftpad=(1, 0, 3),
           window_size=(30, 0), softcap=3.0, alibi_slopes=torch.rand(3, 4) * 0.3,
           sinks=torch.randn(4).to(dtype), num_splits=4)  # fmt: skip


@pytest.mark.kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("Hq,Hkv,D,Dv", [(8, 1, 16, 16), (4, 4, 40, 24), (2, 1, 256, 256)])
def test_triton_mqa_mha_and_head_dims(Hq, Hkv, D, Dv):
    run_kx("triton", torch.float32, Hq=Hq, Hkv=Hkv, D=D, Dv=Dv, Tq=3, is_causal=True,
           num_splits=2, B=2, seqlens=(33, 17))  # fmt: skip


@pytest.mark.kernels
@pytest.mark.usefixtures("kernel_device")
def test_triton_many_query_rows_take_several_query_blocks():
    """group * Tq past 64 rows (a chunked prefill through the cache): several query blocks."""
    run_kx("triton", torch.float32, Hq=8, Hkv=2, Tq=20, B=2, seqlens=(50, 64), is_causal=True,
           num_splits=2)  # fmt: skip


@pytest.mark.parametrize("name", [n for n in VARIANTS if n != "softcap"])
def test_torch_backend_every_variant_it_takes(name):
    run_kx("torch", torch.float32, layout="paged", page_size=7, Tq=2, leftpad=(0, 4, 9),
           return_lse=False, **VARIANTS[name])  # fmt: skip


def test_torch_backend_refuses_what_sdpa_cannot_express():
    q = torch.randn(1, 1, 2, 8)
    kc = torch.randn(1, 4, 2, 8)
    for kw, match in ((dict(softcap=1.0), "softcap"), (dict(return_lse=True), "log-sum-exp"),
                      (dict(alibi_slopes=torch.ones(2)), "ALiBi")):  # fmt: skip
        qq, cc = (q.half(), kc.half()) if "alibi_slopes" in kw else (q, kc)
        with pytest.raises(fusedattn.BackendUnavailableError, match=match):
            fusedattn.attention_with_kvcache(qq, cc, cc, cache_seqlens=3, backend="torch", **kw)


@pytest.mark.kernels
@pytest.mark.usefixtures("kernel_device")
def test_contiguous_paged_and_hf_layouts_give_the_same_bits_for_the_same_split():
    outs = {}
    for layout, page_size in (("contiguous", 16), ("hf", 16), ("paged", 16), ("paged", 5)):
        kc, vc, bt = make_cache(2, 50, 2, 16, 16, torch.bfloat16, layout, page_size)
        g = torch.Generator().manual_seed(3)
        q = torch.randn(2, 2, 4, 16, generator=g, device="cpu").to(kc.device, torch.bfloat16)
        outs[(layout, page_size)] = fusedattn.attention_with_kvcache(
            q, kc, vc, cache_seqlens=torch.tensor([50, 29], dtype=torch.int32), block_table=bt,
            is_causal=True, num_splits=3, return_lse=True, backend="triton",
        )  # fmt: skip
    first = next(iter(outs.values()))
    for key, (out, lse) in outs.items():
        assert torch.equal(out, first[0]) and torch.equal(lse, first[1]), key


@pytest.mark.kernels
@pytest.mark.usefixtures("kernel_device")
def test_the_same_call_twice_gives_the_same_bits():
    kc, vc, bt = make_cache(2, 64, 2, 16, 16, torch.bfloat16, "paged", 8)
    q = torch.randn(2, 1, 4, 16).bfloat16()
    kw = dict(cache_seqlens=torch.tensor([64, 50], dtype=torch.int32), block_table=bt,
              num_splits=4, return_lse=True, backend="triton")  # fmt: skip
    a, b = (fusedattn.attention_with_kvcache(q, kc, vc, **kw) for _ in range(2))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize(
    "backend", ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]
)
def test_nan_in_unused_slots_and_pages_never_leaks(backend, kernel_device):
    """Slots past each sequence, before its left padding, and whole pages nobody owns hold
    NaN (make_cache fills spare pages with NaN); the outputs stay finite."""
    B, S, Hkv, D = 2, 40, 2, 16
    for layout in ("contiguous", "paged"):
        kc, vc, bt = make_cache(B, S, Hkv, D, D, torch.float32, layout, page_size=8)
        seq = torch.tensor([12, 33], dtype=torch.int32)
        lp = torch.tensor([3, 0], dtype=torch.int32)
        if layout == "contiguous":
            for b in range(B):
                kc[b, seq[b] :], vc[b, seq[b] :] = float("nan"), float("nan")
                kc[b, : lp[b]], vc[b, : lp[b]] = float("nan"), float("nan")
        else:
            for b in range(B):
                for j in itertools.chain(range(lp[b]), range(seq[b], S)):
                    kc[bt[b, j // 8], j % 8] = float("nan")
                    vc[bt[b, j // 8], j % 8] = float("nan")
            bt[0, 3:] = 10**6  # pages past sequence 0's end: never read
        q = torch.randn(B, 2, 4, D)
        out = fusedattn.attention_with_kvcache(q, kc, vc, cache_seqlens=seq, block_table=bt,
                                               cache_leftpad=lp, is_causal=True,
                                               backend=backend)  # fmt: skip
        assert torch.isfinite(out).all(), layout


@pytest.mark.parametrize(
    "backend", ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]
)
@pytest.mark.parametrize("layout", ["contiguous", "hf", "paged"])
def test_append_writes_exactly_the_new_positions_in_place(backend, layout, kernel_device):
    B, S, Hkv, D = 2, 30, 2, 8
    kc, vc, bt = make_cache(B, S, Hkv, D, D, torch.float32, layout, page_size=4, fill=7.0)
    before_k, before_v = kc.clone(), vc.clone()
    k_storage = kc.data_ptr()
    seq = torch.tensor([3, 20], dtype=torch.int32)
    k_new, v_new = torch.randn(B, 2, Hkv, D), torch.randn(B, 2, Hkv, D)
    q = torch.randn(B, 2, 4, D)
    out = fusedattn.attention_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=seq,
                                           block_table=bt, is_causal=True, backend=backend)  # fmt: skip
    assert kc.data_ptr() == k_storage
    written = torch.zeros_like(kc, dtype=torch.bool)
    for b, t in itertools.product(range(B), range(2)):
        pos = int(seq[b]) + t
        where = (b, pos) if bt is None else (int(bt[b, pos // 4]), pos % 4)
        torch.testing.assert_close(kc[where], k_new[b, t])
        torch.testing.assert_close(vc[where], v_new[b, t])
        written[where] = True
    assert torch.equal(kc[~written], before_k[~written]) and torch.equal(
        vc[~written], before_v[~written]
    )
    want = reference.attention_with_kvcache(q.double(), kc.double(), vc.double(),
                                            cache_seqlens=seq + 2, block_table=bt,
                                            is_causal=True)  # fmt: skip
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize(
    "layout, page_size", [("contiguous", 16), ("hf", 16), ("paged", 1), ("paged", 5), ("paged", 16)]
)
@pytest.mark.parametrize("Tnew", [1, 7])
def test_append_kernel_writes_the_bits_torch_indexing_writes(layout, page_size, Tnew):
    """The one-launch Triton append (what a GPU runs) against torch's indexed writes, bit for
    bit, every other slot untouched, strided new rows; positions past the capacity are not
    written (torch's indexing would raise)."""
    from fusedattn.ops.shared.decode_launch import append

    B, S, Hkv, D, Dv = 3, 40, 2, 24, 16
    kc, vc, bt = make_cache(B, S, Hkv, D, Dv, torch.bfloat16, layout, page_size, fill=5.0)
    g = torch.Generator().manual_seed(Tnew)
    seq = torch.tensor([0, 17, S - Tnew], dtype=torch.int32).to(kc.device)
    k = torch.randn(B, Hkv, Tnew, D, generator=g, device="cpu").transpose(1, 2).to(kc.device)
    v = torch.randn(B, Tnew, Hkv, Dv, generator=g, device="cpu").to(kc.device)
    want_k, want_v = kc.clone(), vc.clone()
    append(want_k, want_v, k.bfloat16(), v.bfloat16(), seq, bt, kernel=False)
    append(kc, vc, k.bfloat16(), v.bfloat16(), seq, bt, kernel=True)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    # at or past the capacity (a paged cache's last page may hold slots past S): no write
    capacity = S if bt is None else bt.shape[1] * page_size
    before_k, before_v = kc.clone(), vc.clone()
    append(kc, vc, k.bfloat16(), v.bfloat16(), seq + capacity, bt, kernel=True)
    assert torch.equal(kc, before_k) and torch.equal(vc, before_v)


@pytest.mark.parametrize(
    "backend", ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]
)
def test_sequences_that_see_no_key_give_zero_and_the_sinks_lse(backend, kernel_device):
    """cache_seqlens 0, left padding up to the end, and queries before the first key
    (bottom-right causal with Tq > L): 0 output; lse -inf, or the sink with sinks."""
    q = torch.randn(3, 3, 2, 8)
    kc = torch.randn(3, 6, 2, 8)
    seq = torch.tensor([0, 4, 2], dtype=torch.int32)
    lp = torch.tensor([0, 4, 0], dtype=torch.int32)
    out = fusedattn.attention_with_kvcache(q, kc, kc, cache_seqlens=seq, cache_leftpad=lp,
                                           is_causal=True, backend=backend)  # fmt: skip
    assert (out[0] == 0).all() and (out[1] == 0).all() and (out[2, 0] == 0).all()
    assert (out[2, 1:] != 0).any()
    if backend != "torch":
        sinks = torch.tensor([0.5, -1.0])
        _, lse = fusedattn.attention_with_kvcache(q, kc, kc, cache_seqlens=seq, cache_leftpad=lp,
                                                  sinks=sinks, return_lse=True, backend=backend)  # fmt: skip
        assert torch.allclose(lse[0], sinks[:, None].expand(2, 3))


@pytest.mark.kernels
@pytest.mark.usefixtures("kernel_device")
def test_empty_batch_and_zero_splits_heuristic():
    q = torch.randn(0, 1, 4, 16)
    kc = torch.randn(0, 8, 2, 16)
    out, lse = fusedattn.attention_with_kvcache(q, kc, kc, cache_seqlens=0, return_lse=True,
                                                backend="triton")  # fmt: skip
    assert out.shape == (0, 1, 4, 16) and lse.shape == (0, 4, 1)
    assert K.choose_splits(8, 32768, 132, 64) == 33  # batch 1, Llama-3-8B's 8 kv heads
    assert K.choose_splits(512, 32768, 132, 64) == 1  # batch 64 fills the GPU as it is
    assert K.choose_splits(8, 300, 132, 64) == 1  # a short cache: at least 4 tiles a split
    assert K.decode_config(4, 128, 128, True).block_m == 16  # 4 query rows, padded for tl.dot
    assert K.decode_config(200, 128, 128, True).block_m == 64


def test_inference_only_refused_with_grad_fine_under_no_grad():
    q = torch.randn(1, 1, 2, 8, requires_grad=True)
    kc = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match=r"inference only.*q require grad"):
        fusedattn.attention_with_kvcache(q, kc, kc, cache_seqlens=4)
    sinks = torch.zeros(2, requires_grad=True)  # GPT-OSS's sinks are parameters
    with torch.no_grad():
        fusedattn.attention_with_kvcache(q, kc, kc, cache_seqlens=4, sinks=sinks)
    with torch.inference_mode():
        fusedattn.attention_with_kvcache(q, kc, kc, cache_seqlens=4, sinks=sinks)


BAD = [
    (dict(q=torch.randn(1, 2, 8)), ValueError, "q must be 4-D"),
    (dict(q=torch.randn(1, 1, 3, 8)), ValueError, "Hq must be a multiple of Hkv"),
    (dict(k_cache=torch.randn(1, 4, 8, 2).transpose(-1, -2)), ValueError, "unit last stride"),
    (dict(cache_seqlens=torch.tensor([3])), TypeError, "cache_seqlens must be int32"),
    (dict(cache_seqlens=-1), ValueError, "cache_seqlens must be >= 0"),
    (
        dict(cache_leftpad=torch.tensor([1, 2], dtype=torch.int32)),
        ValueError,
        r"cache_leftpad must have shape \(B,\)",
    ),
    (
        dict(block_table=torch.zeros(1, 2, dtype=torch.int64)),
        TypeError,
        "block_table must be int32",
    ),
    (dict(k=torch.randn(1, 1, 2, 8)), ValueError, "pass both or neither"),
    (
        dict(k=torch.randn(1, 1, 1, 8), v=torch.randn(1, 1, 1, 8)),
        ValueError,
        "k and v must have shapes",
    ),
    (dict(num_splits=-1), ValueError, "num_splits must be >= 0"),
    (dict(window_size=(1,)), TypeError, "window_size"),
    (dict(v_cache=torch.randn(1, 4, 2, 8).half()), TypeError, "v_cache must have the dtype"),
]


@pytest.mark.parametrize("bad,error,match", BAD, ids=[b[2][:28] for b in BAD])
def test_bad_input_gets_a_clear_error_before_anything_runs(bad, error, match):
    args = dict(q=torch.randn(1, 1, 2, 8), k_cache=torch.randn(1, 4, 2, 8),
                v_cache=torch.randn(1, 4, 2, 8), cache_seqlens=2) | bad  # fmt: skip
    before = args["k_cache"].clone()
    with pytest.raises(error, match=match):
        fusedattn.attention_with_kvcache(**args)
    assert torch.equal(args["k_cache"], before)  # nothing written


def test_auto_runs_on_cpu_and_the_decode_order_puts_triton_first_on_gpus():
    from fusedattn.ops.core import backends

    q = torch.randn(1, 1, 2, 8)
    kc = torch.randn(1, 4, 2, 8)
    out = fusedattn.attention_with_kvcache(q, kc, kc, cache_seqlens=4)
    torch.testing.assert_close(
        out.double(),
        reference.attention_with_kvcache(q.double(), kc.double(), kc.double(), cache_seqlens=4),
    )
    assert backends.AUTO_ORDER["cuda"]["attention_with_kvcache"][0] == "triton"
    assert dense_cache(kc, None, 1).shape == (1, 2, 4, 8)


@pytest.mark.gpu
@pytest.mark.usefixtures("kernel_device")
def test_decode_step_with_append_replays_from_a_cuda_graph():
    """Serving stacks replay decode steps from CUDA graphs (no host time per step), so the
    Triton path, append included, must capture (no sync, no host read of a device value) and
    a replay must follow inputs updated in place: the next query and the advanced lengths."""
    B, S, Hkv, Hq, D = 2, 64, 2, 4, 16
    kc, vc, bt = make_cache(B, S, Hkv, D, D, torch.bfloat16, "paged", 16, fill=0.0)
    seq = torch.tensor([10, 40], dtype=torch.int32, device="cuda")
    q, k1, v1 = (torch.randn(B, 1, h, D, device="cuda", dtype=torch.bfloat16)
                 for h in (Hq, Hkv, Hkv))  # fmt: skip

    def step():
        return fusedattn.attention_with_kvcache(q, kc, vc, k1, v1, cache_seqlens=seq,
                                                block_table=bt, backend="triton")  # fmt: skip

    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        for _ in range(3):  # each step: a new query and new k/v, one more key per sequence
            for t in (q, k1, v1):
                t.copy_(torch.randn_like(t))
            graph.replay()
            want = step()  # eager, the same state: the append rewrites the same slots
            assert torch.equal(out, want)
            seq += 1


@pytest.mark.kernels
@pytest.mark.usefixtures("kernel_device")
@pytest.mark.parametrize("S", [1, 7, 64, 300])
def test_the_kernel_finds_a_key_masks_bounds_as_torch_does(S):
    """A Hugging Face decode step over a padding mask on the Triton backend: each program
    finds the row's first and last visible position itself (MASK_BOUNDS, scanning 16 bytes a
    step here) where the torch backend derives lengths with torch's reductions. Rows with
    nothing visible (0 output), everything visible, holes, and a mask broadcast over the
    batch (stride 0) as HF's expand gives it."""
    from fusedattn.ops.decode import plans
    from fusedattn.ops.decode.api import decode_with_key_mask

    g = torch.Generator(torch.get_default_device()).manual_seed(S)
    q = torch.randn(4, 1, 4, 16, generator=g)
    kc, vc = torch.randn(4, S, 2, 16, generator=g), torch.randn(4, S, 2, 16, generator=g)
    mask = torch.rand(4, S, generator=g) < 0.3
    mask[1] = False
    mask[2] = True
    for m in (mask, mask[:1].expand(4, S), mask[:, None, None, :]):
        for _ in range(2):  # the full path, then the plan
            got = decode_with_key_mask(q, kc, vc, m, is_causal=True, backend="triton")
            want = decode_with_key_mask(q.double(), kc.double(), vc.double(), m,
                                        is_causal=True, backend="torch")  # fmt: skip
            torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)
        plans.MASKED.clear()
