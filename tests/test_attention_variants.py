"""The attention variants in the kernels (Triton: interpreter on CPU, compiled on a GPU) and in
the torch backend, against the float64 reference under the k× rule, forward and backward:
windows on either or both sides, bottom-right alignment, softcap, ALiBi, sinks, packed
variable-length batches, every combination with the masks; tiles outside a window are never
read; clear refusals where a backend cannot express a variant."""

import itertools
from functools import partial

import pytest
import torch
from hard_shapes import AttentionShape, make_qkv
from kx_check import assert_op_kx

import fusedattn
from fusedattn import reference

pytestmark = pytest.mark.usefixtures("kernel_device")
kernels = pytest.mark.kernels
ALL = ("q", "k", "v")

VARIANTS = {
    "window": dict(window_size=(20, 9)),
    "wide_window": dict(window_size=(70, 40)),
    "left_only": dict(window_size=(33, -1)),
    "right_only": dict(window_size=(-1, 12)),
    "causal_window": dict(is_causal=True, window_size=(40, -1)),
    "bottom_right_causal": dict(is_causal=True, causal_alignment="bottom_right"),
    "bottom_right_window": dict(window_size=(10, 10), causal_alignment="bottom_right"),
    "softcap": dict(softcap=1.0),
    "alibi": dict(alibi="head"),
    "alibi_per_batch_bottom_right": dict(
        alibi="batch", is_causal=True, causal_alignment="bottom_right"
    ),
    "sinks": dict(sinks=True),
    "everything": dict(
        window_size=(25, 5),
        causal_alignment="bottom_right",
        softcap=2.0,
        alibi="head",
        sinks=True,
        key_padding_mask=True,
        attn_mask="float",
    ),
}
SHAPES = [
    AttentionShape(2, 2, 1, 63, 129, 16, 16),
    AttentionShape(2, 2, 2, 129, 63, 40, 40),
    AttentionShape(1, 2, 1, 100, 100, 16, 24),
]


def variant_inputs(s: AttentionShape, dtype, variant: dict, layout="transposed"):
    """(tensors, kwargs, grad_of) for assert_op_kx: q, k, v, sinks and a float mask are
    differentiated; ALiBi slopes (fp32, as the contract says) and key padding are not."""
    device = torch.get_default_device()
    q, k, v = make_qkv(s, dtype, device, layout=layout)
    tensors, kwargs = dict(q=q, k=k, v=v), dict(enable_gqa=s.Hq != s.Hkv)
    for name, value in variant.items():
        if name == "alibi":
            shape = (s.Hq,) if value == "head" else (s.B, s.Hq)
            kwargs["alibi_slopes"] = torch.rand(shape) * 0.3
        elif name == "sinks":
            tensors["sinks"] = torch.randn(s.Hq, dtype=dtype)
        elif name == "key_padding_mask":
            lengths = torch.randint(s.Tk // 2, s.Tk + 1, (s.B,))
            kwargs[name] = torch.arange(s.Tk) >= lengths[:, None]
        elif name == "attn_mask":
            tensors[name] = torch.randn(1, s.Hq, s.Tq, s.Tk, dtype=dtype)
        else:
            kwargs[name] = value
    return tensors, kwargs, tuple(tensors)


def check(backend, s, dtype, variant, forward_only=False, **kw):
    """The k× check of `variant`, forward and gradients (forward_only: the forward alone)."""
    tensors, kwargs, grad_of = variant_inputs(s, dtype, variant, **kw)
    op = partial(fusedattn.attention, backend=backend)
    assert_op_kx(op, reference.attention, tensors, kwargs=kwargs,
                 grad_of=() if forward_only else grad_of)  # fmt: skip


@pytest.mark.slow
@kernels
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("name", VARIANTS)
def test_triton_variants_fp32(name, shape):
    check("triton", shape, torch.float32, VARIANTS[name])


@pytest.mark.slow
@kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", ["wide_window", "bottom_right_causal", "softcap", "everything"])
def test_triton_variants_half(name, dtype):
    check("triton", SHAPES[0], dtype, VARIANTS[name])


@kernels
@pytest.mark.parametrize("layout", ["contiguous", "sliced"])
def test_triton_variants_any_layout(layout):
    check("triton", AttentionShape(2, 2, 1, 40, 70, 24, 24), torch.float32,
          VARIANTS["everything"], layout=layout)  # fmt: skip


@pytest.fixture
def merged_dkdv_boundaries(monkeypatch):
    """Every call's dK/dV kernel runs Tiles.merge (both boundary ranges in one loop): off by
    default until a GPU times it, so its correctness is checked here."""
    import dataclasses

    from tiles_patch import patch_attention_config

    def merged(cfg, *args, **kwargs):
        return dataclasses.replace(cfg, dkdv=dataclasses.replace(cfg.dkdv, merge=True))

    patch_attention_config(monkeypatch, merged)


@pytest.mark.slow
@kernels
@pytest.mark.usefixtures("merged_dkdv_boundaries")
# one shape in the interpreter, as the other candidate loops' grids (the merged loop's
# boundary tiles are those of the plain one: test_merged_dkdv_boundary_loops_with_...), two on a GPU
@pytest.mark.parametrize("shape", SHAPES[: 2 if torch.cuda.is_available() else 1], ids=str)
@pytest.mark.parametrize(
    "name", ["causal_window", "bottom_right_causal", "bottom_right_window", "left_only", "alibi",
             "sinks", "everything"],
)  # fmt: skip
def test_triton_variants_with_merged_dkdv_boundary_loops(name, shape):
    check("triton", shape, torch.float32, VARIANTS[name])


@kernels
@pytest.mark.usefixtures("merged_dkdv_boundaries")
@pytest.mark.parametrize("causal", [False, True], ids=["", "causal"])
def test_merged_dkdv_boundary_loops_with_key_padding_and_a_float_mask(causal):
    _, bn = block_sizes()
    T = 5 * bn + 3
    s = AttentionShape(2, 2, 1, T, T, 16, 16)
    q, k, v = make_qkv(s, torch.float32, torch.get_default_device())
    kpm = padding_pattern("both_ends", T, bn).to(q.device)
    mask = torch.randn(1, 2, T, T, device=q.device)
    kwargs = dict(key_padding_mask=kpm, is_causal=causal, enable_gqa=True)
    op = partial(fusedattn.attention, backend="triton")
    assert_op_kx(op, reference.attention, dict(q=q, k=k, v=v, attn_mask=mask),
                 grad_of=(*ALL, "attn_mask"), kwargs=kwargs)  # fmt: skip


@kernels
def test_triton_rows_that_see_nothing_give_zero_grads_and_the_sink_as_lse():
    s = AttentionShape(1, 2, 2, 40, 8, 16, 16)
    q, k, v = make_qkv(s, torch.float32, torch.get_default_device(), requires_grad=True)
    sinks = torch.randn(2, requires_grad=True)
    # bottom-right causal with Tq > Tk: the first 32 queries see no key
    kw = dict(is_causal=True, causal_alignment="bottom_right", return_lse=True)
    for sink in (None, sinks):
        out, lse = fusedattn.attention(q, k, v, sinks=sink, backend="triton", **kw)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        assert (out[:, :, :32] == 0).all() and (grads[0][:, :, :32] == 0).all()
        assert all(torch.isfinite(g).all() for g in grads)
        expect = (
            torch.full((1, 2, 32), float("-inf"))
            if sink is None
            else sinks.detach()[None, :, None].expand(1, 2, 32)
        )
        torch.testing.assert_close(lse[:, :, :32], expect)


# ---- tiles outside the window are never read -------------------------------------------------


def block_sizes():
    from fusedattn.triton_kernels.attention import attention_config

    gpu = torch.get_default_device().type == "cuda"
    # the tiles the fp32 inputs below get: FMA dots unless TF32 is allowed
    ieee = gpu and not torch.backends.cuda.matmul.allow_tf32
    cfg = attention_config(16, 16, gpu, ieee_fp32=ieee)
    tilings = {(t.block_m, t.block_n) for t in (cfg.fwd, cfg.dkdv, cfg.dq)}
    assert len(tilings) == 1  # the test reads one tiling for every kernel
    return cfg.fwd.block_m, cfg.fwd.block_n


@kernels
def test_window_tiles_outside_every_row_are_never_read_forward_or_backward():
    bm, bn = block_sizes()
    T, left, right = 6 * bm, bm // 2, bm // 2
    s = AttentionShape(1, 1, 1, T, T, 16, 16)
    q, k, v = make_qkv(s, torch.float32, torch.get_default_device())
    first_hi = -(-(bm + right) // bn) * bn  # the first query block reads keys below this
    last_lo = (T - bm - left) // bn * bn  # the last query block reads keys from this
    for poisoned, rows in (
        (slice(first_hi, T), slice(0, bm)),
        (slice(0, last_lo), slice(T - bm, T)),
    ):
        kp, vp = k.clone(), v.clone()
        kp[:, :, poisoned], vp[:, :, poisoned] = float("nan"), float("nan")
        out = fusedattn.attention(q, kp, vp, window_size=(left, right), backend="triton")
        # Had a query block computed a tile outside its window, 0 * NaN would poison it.
        assert torch.isfinite(out[:, :, rows]).all()
    # Backward: the first key block is only seen by queries below first_hi.
    qp = q.clone().requires_grad_()
    with torch.no_grad():
        qp[:, :, first_hi:] = float("nan")
    kg, vg = k.clone().requires_grad_(), v.clone().requires_grad_()
    out = fusedattn.attention(qp, kg, vg, window_size=(left, right), backend="triton")
    dq, dk, dv = torch.autograd.grad(out[:, :, :bm].sum(), (qp, kg, vg))
    assert torch.isfinite(dk[:, :, :bn]).all() and torch.isfinite(dv[:, :, :bn]).all()
    assert torch.isfinite(dq[:, :, :bm]).all()


# ---- packed variable-length batches ------------------------------------------------------------


def packed(lengths_q, lengths_k, Hq, Hkv, D, Dv, dtype):
    cu_q = torch.tensor([0, *itertools.accumulate(lengths_q)], dtype=torch.int32)
    cu_k = torch.tensor([0, *itertools.accumulate(lengths_k)], dtype=torch.int32)
    q = torch.randn(sum(lengths_q), Hq, D, dtype=dtype)
    k = torch.randn(sum(lengths_k), Hkv, D, dtype=dtype)
    v = torch.randn(sum(lengths_k), Hkv, Dv, dtype=dtype)
    return q, k, v, cu_q, cu_k


VARLEN_VARIANTS = {
    "plain": {},
    "causal": dict(is_causal=True),
    "bottom_right_causal": dict(is_causal=True, causal_alignment="bottom_right"),
    "everything": dict(
        window_size=(12, 3), causal_alignment="bottom_right", softcap=2.0, alibi="batch", sinks=True
    ),
    "everything_but_softcap": dict(
        window_size=(12, 3), causal_alignment="bottom_right", alibi="batch", sinks=True
    ),
}
LENGTHS = ([33, 0, 70, 5, 1], [40, 9, 70, 1, 0])


def check_varlen(backend, dtype, variant):
    q, k, v, cu_q, cu_k = packed(*LENGTHS, 4, 2, 16, 24, dtype)
    tensors = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    kwargs = dict(max_seqlen_q=max(LENGTHS[0]), max_seqlen_k=max(LENGTHS[1]), enable_gqa=True)
    grad_of = ALL
    for name, value in variant.items():
        if name == "alibi":
            kwargs["alibi_slopes"] = torch.rand(len(LENGTHS[0]), 4) * 0.3
        elif name == "sinks":
            tensors["sinks"], grad_of = torch.randn(4, dtype=dtype), (*ALL, "sinks")
        else:
            kwargs[name] = value
    op = partial(fusedattn.varlen_attention, backend=backend)
    assert_op_kx(op, reference.varlen_attention, tensors, kwargs=kwargs, grad_of=grad_of)


@pytest.mark.slow
@kernels
@pytest.mark.parametrize("name", VARLEN_VARIANTS)
def test_triton_varlen_fp32(name):
    check_varlen("triton", torch.float32, VARLEN_VARIANTS[name])


@kernels
def test_triton_varlen_bf16():
    check_varlen("triton", torch.bfloat16, VARLEN_VARIANTS["everything"])


@pytest.mark.parametrize(
    "backend", ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]
)
def test_varlen_lse_layout_and_sequences_never_read_each_other(backend):
    """NaN in the third sequence's keys and +inf in its values: every other sequence's rows,
    lse and gradients are finite and those of the clean call (the torch backend's padded
    gather once handed them to the sequence before it, issue #82)."""
    q, k, v, cu_q, cu_k = packed(*LENGTHS, 4, 2, 16, 24, torch.float32)
    kp, vp = k.clone(), v.clone()
    kp[cu_k[2] : cu_k[3]] = float("nan")  # the third sequence's keys
    vp[cu_k[2] : cu_k[3]] = float("inf")
    args = (cu_q, cu_k, max(LENGTHS[0]), max(LENGTHS[1]), 0.0, False, None, True)
    others = torch.cat([torch.arange(cu_q[2]), torch.arange(cu_q[3], cu_q[-1])])
    kw = dict(backend=backend, return_lse=backend != "torch")  # SDPA returns no lse

    def run(k, v):
        leaf = q.clone().requires_grad_()
        got = fusedattn.varlen_attention(leaf, k, v, *args, **kw)
        out, lse = got if kw["return_lse"] else (got, None)
        (dq,) = torch.autograd.grad(out[others].sum(), leaf)
        return out[others], None if lse is None else lse[:, others], dq[others]

    for name, a, b in zip(("out", "lse", "dq"), run(k, v), run(kp, vp), strict=True):
        if a is not None:  # a sequence with no keys has lse -inf
            assert not b.isnan().any() and (b < float("inf")).all(), name
            torch.testing.assert_close(b, a, msg=name)
    if kw["return_lse"]:
        _, lse = fusedattn.varlen_attention(q, kp, vp, *args, **kw)
        _, want = reference.varlen_attention(q.double(), k.double(), v.double(), *args,
                                             return_lse=True)  # fmt: skip
        assert lse.shape == (4, cu_q[-1])
        torch.testing.assert_close(lse[:, others], want[:, others], rtol=1e-5, atol=1e-5)


# ---- dropout with a window and sinks: the same mask forward and backward ----------------------


@kernels
def test_dropout_with_window_and_sinks_matches_float64_with_the_kernels_mask():
    s = AttentionShape(1, 2, 2, 48, 48, 16, 16)
    q, k, _ = make_qkv(s, torch.float32, torch.get_default_device())
    sinks = torch.randn(2)
    kw = dict(window_size=(9, 4), sinks=sinks, backend="triton")
    eye = torch.eye(48).expand(1, 2, 48, 48).contiguous()
    torch.manual_seed(3)
    dropped = fusedattn.attention(q, k, eye, dropout_p=0.25, **kw)  # v = I: the probabilities
    probs = reference.attention(q.double(), k.double(), eye.double(), window_size=(9, 4),
                                sinks=sinks.double())  # fmt: skip
    kept = dropped != 0
    assert abs(kept[probs > 0].float().mean().item() - 0.75) < 0.05
    # fp32 probabilities: on the H100 one differed from float64 by 2.6e-7 (exp2 in fp32), past
    # assert_close's float64 defaults (1e-7); a wrong mask or scale is off by far more.
    torch.testing.assert_close(dropped[kept].double(), probs[kept] / 0.75, rtol=1e-5, atol=1e-6)
    v = torch.randn(1, 2, 48, 16, requires_grad=True)
    qg = q.clone().requires_grad_()
    torch.manual_seed(3)
    out = fusedattn.attention(qg, k, v, dropout_p=0.25, **kw)
    q64, v64 = qg.detach().double().requires_grad_(), v.detach().double().requires_grad_()
    p64 = reference.attention(q64, k.double(), eye.double(), window_size=(9, 4),
                              sinks=sinks.double())  # fmt: skip
    want = (p64 * kept / 0.75) @ v64
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, (qg, v), grad),
                    torch.autograd.grad(want, (q64, v64), grad.double()), strict=True):  # fmt: skip
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


# ---- the torch backend: exact where SDPA can express a variant, a refusal where not --------------

TORCH_EXPRESSIBLE = ["window", "right_only", "causal_window", "bottom_right_causal",
                     "bottom_right_window", "alibi", "alibi_per_batch_bottom_right", "sinks"]  # fmt: skip


@pytest.mark.parametrize("name", TORCH_EXPRESSIBLE)
def test_torch_backend_variants_fp32(name, device):
    with torch.device(device):
        check("torch", SHAPES[0], torch.float32, VARIANTS[name])


def test_torch_backend_window_with_padding_float_mask_and_sinks(device):
    variant = dict(window_size=(25, 5), causal_alignment="bottom_right", sinks=True,
                   key_padding_mask=True, attn_mask="float")  # fmt: skip
    with torch.device(device):
        check("torch", SHAPES[1], torch.float32, variant)


@pytest.mark.parametrize(
    "name", ["plain", "causal", "bottom_right_causal", "everything_but_softcap"]
)
def test_torch_backend_varlen(name, device):
    """One SDPA call over the padded batch, each sequence's positions in the mask."""
    with torch.device(device):
        check_varlen("torch", torch.float32, VARLEN_VARIANTS[name])


def test_torch_backend_refuses_what_sdpa_cannot_express_exactly():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="cannot apply softcap"):
        fusedattn.attention(q, q, q, softcap=5.0, backend="torch")
    half = q.bfloat16()
    with pytest.raises(ValueError, match=r"rounds -slope"):
        fusedattn.attention(half, half, half, alibi_slopes=torch.rand(2), backend="torch")
    with pytest.raises(ValueError, match="would round"):
        fusedattn.attention(half, half, half, sinks=torch.randn(2), backend="torch")
    # auto on CPU takes the reference for them, never a silently different answer
    out = fusedattn.attention(q, q, q, softcap=5.0)
    torch.testing.assert_close(out, reference.attention(q, q, q, softcap=5.0))


def test_cuda_backend_refuses_the_variants_it_does_not_have():
    from fusedattn.masks import Window
    from fusedattn.ops.attention import cuda_backend

    q = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16)
    reasons = cuda_backend.refusals(
        q=q, k=q, v=q, window=Window(8, 0), softcap=1.0, alibi_slopes=torch.rand(2),
        sinks=torch.randn(2),
    )  # fmt: skip
    text = " ".join(reasons)
    assert "window (left=8, right=0)" in text
    assert all(name in text for name in ("softcap", "alibi_slopes", "sinks"))
    assert not any("window" in r for r in cuda_backend.refusals(q=q, k=q, v=q,
                                                                           window=Window(-1, 0)))  # fmt: skip
    assert "packed variable-length" in cuda_backend.varlen_refusals()[0]


# ---- validation ------------------------------------------------------------------------------

BAD = [
    (dict(window_size=(3,)), TypeError, "pair of Python ints"),
    (dict(window_size=(-2, 3)), ValueError, ">= 0, or -1"),
    (dict(window_size=(1.5, 2)), TypeError, "pair of Python ints"),
    (dict(softcap=-1.0), ValueError, "softcap must be finite and >= 0"),
    (dict(softcap=float("inf")), ValueError, "softcap must be finite"),
    (
        dict(alibi_slopes=torch.rand(3)),
        ValueError,
        r"alibi_slopes must have shape \(Hq,\) = \(2,\)",
    ),
    (
        dict(alibi_slopes=torch.rand(2, dtype=torch.float64)),
        TypeError,
        "alibi_slopes must be float32",
    ),
    (dict(sinks=torch.randn(3)), ValueError, r"sinks must have shape \(Hq,\)"),
    (dict(sinks=torch.randn(2, 1)), ValueError, "sinks must be 1-D"),
    (dict(causal_alignment="bottom"), ValueError, "causal_alignment must be"),
]


@pytest.mark.parametrize("backend", ["reference", "torch", "auto"])
@pytest.mark.parametrize("bad,error,match", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_variant_arguments_get_clear_errors(backend, bad, error, match):
    q = torch.randn(1, 2, 4, 8, device="cpu")
    with pytest.raises(error, match=match):
        fusedattn.attention(q, q, q, backend=backend, **bad)


def test_bad_varlen_arguments_get_clear_errors():
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 8, 8, torch.float32)
    args = (q.cpu(), k.cpu(), v.cpu())
    with pytest.raises(TypeError, match="cu_seqlens_q must be int32"):
        fusedattn.varlen_attention(*args, cu_q.long().cpu(), cu_k.cpu(), 4, 4)
    with pytest.raises(ValueError, match="q must be 3-D"):
        fusedattn.varlen_attention(q[None].cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), 4, 4)
    with pytest.raises(TypeError, match="max_seqlen_k must be a non-negative int"):
        fusedattn.varlen_attention(*args, cu_q.cpu(), cu_k.cpu(), 4, 4.0)
    for backend in ("reference", "torch"):  # they read cu_seqlens anyway, so they check it
        with pytest.raises(ValueError, match="must rise from 0 to the 7 packed rows"):
            fusedattn.varlen_attention(*args, cu_q.cpu() + 1, cu_k.cpu(), 4, 4, backend=backend)
        with pytest.raises(ValueError, match="max_seqlen_k=3 is below a sequence of 4"):
            fusedattn.varlen_attention(*args, cu_q.cpu(), cu_k.cpu(), 4, 3, backend=backend)
    with pytest.raises(ValueError, match="B \\+ 1"):
        fusedattn.varlen_attention(*args, cu_q.cpu(), cu_k[:2].cpu(), 4, 4)


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=kernels)])
def test_varlen_takes_enable_gqa_by_keyword_and_by_position_as_attention_does(backend):
    """Issue #31 item 1: the documented signature lists enable_gqa after scale; Hq != Hkv
    needs it, as in fusedattn.attention (SDPA's rule)."""
    q, k, v, cu_q, cu_k = packed([5, 3], [4, 6], 4, 2, 8, 8, torch.float32)
    args = (q, k, v, cu_q, cu_k, 5, 6)
    want = reference.varlen_attention(*(t.double() for t in args[:3]), *args[3:],
                                      enable_gqa=True)  # fmt: skip
    by_keyword = fusedattn.varlen_attention(*args, enable_gqa=True, backend=backend)
    by_position = fusedattn.varlen_attention(*args, 0.0, False, None, True, backend=backend)
    for out in (by_keyword, by_position):
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="pass enable_gqa=True"):
        fusedattn.varlen_attention(*args, backend=backend)
    same = packed([5, 3], [4, 6], 2, 2, 8, 8, torch.float32)
    fusedattn.varlen_attention(*same, 5, 6, enable_gqa=True, backend=backend)  # MHA: accepted


@pytest.mark.parametrize("backend", ["reference", "torch", pytest.param("triton", marks=kernels)])
def test_varlen_with_no_sequences_stays_connected_to_autograd(backend):
    """Issue #31 item 6: cu_seqlens = [0] (no sequences): an empty output that backward()
    runs through, with empty gradients, in every backend."""
    q, k, v, cu_q, cu_k = packed([], [], 4, 2, 8, 8, torch.float32)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    kw = dict(enable_gqa=True, backend=backend)
    if backend != "torch":
        kw["return_lse"] = True
    res = fusedattn.varlen_attention(*leaves, cu_q, cu_k, 0, 0, **kw)
    out = res[0] if backend != "torch" else res
    assert out.shape == (0, 4, 8) and out.requires_grad
    if backend != "torch":
        assert res[1].shape == (4, 0)
    out.sum().backward()
    assert [t.grad.shape for t in leaves] == [(0, 4, 8), (0, 2, 8), (0, 2, 8)]


@kernels
def test_key_padding_tiles_are_skipped_by_the_valid_key_range(monkeypatch):
    """The kernels read only the key tiles inside each batch row's [first, end) of non-padding
    keys (the launcher's valid_key_range). Told a narrower range than the padding mask
    implies, they compute attention over that range alone: proof that the tiles outside it
    are skipped rather than masked (masking could not tell the two apart)."""
    from fusedattn.ops.attention import triton_args as attention_launch

    _, bn = block_sizes()
    T = 4 * bn
    s = AttentionShape(2, 2, 2, T, T, 16, 16)
    q, k, v = make_qkv(s, torch.float32, torch.get_default_device(), requires_grad=True)
    no_padding = torch.zeros(2, T, dtype=torch.bool)
    # [first, end) and the flag "no padding inside the range" (true here: nothing is padding)
    told = torch.tensor([[bn, 2 * bn, 1], [0, 3 * bn, 1]], dtype=torch.int32)
    monkeypatch.setattr(attention_launch, "valid_key_range", lambda kpm: told.to(kpm.device))
    out = fusedattn.attention(q, k, v, key_padding_mask=no_padding, backend="triton")
    outside = torch.arange(T)[None, :] < told[:, :1]
    outside |= torch.arange(T)[None, :] >= told[:, 1:2]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = reference.attention(q64, k64, v64, key_padding_mask=outside.to(q.device))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), grad)
    expected = torch.autograd.grad(want, (q64, k64, v64), grad.double())
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5)


def padding_pattern(pattern: str, T: int, bn: int) -> torch.Tensor:
    """(2, T) key padding masks, True = padding, each batch row cutting tiles differently."""
    kpm = torch.zeros(2, T, dtype=torch.bool)
    if pattern == "right":
        kpm[0, 3 * bn + 5 :] = True
        kpm[1, T - 1 :] = True
    elif pattern == "left":
        kpm[0, : bn + 7] = True
        kpm[1, : 2 * bn] = True
    elif pattern == "both_ends":
        kpm[0, :5] = True
        kpm[0, 4 * bn + 1 :] = True
        kpm[1, :bn] = True
        kpm[1, 3 * bn :] = True
    elif pattern == "hole":
        kpm[:, 2 * bn + 3 : 2 * bn + 9] = True
        kpm[1, 3 * bn : 4 * bn] = True
    else:  # scattered
        kpm = torch.rand(2, T) < 0.3
    return kpm


class PoisonPadded(torch.autograd.Function):
    """x with NaN where `mask` is set; the gradient passes through unchanged, so the kernels'
    gradients of the padded keys and values (zero in the reference) are checked too."""

    @staticmethod
    def forward(ctx, x, mask):
        return x.masked_fill(mask, float("nan"))

    @staticmethod
    def backward(ctx, grad):
        return grad, None


@pytest.mark.slow
@kernels
# causal with each pattern on a GPU; in the interpreter with an end-padded and a holed one
# (causal changes the key range, not how padding is read)
@pytest.mark.parametrize(
    ("pattern", "causal"),
    [(p, c) for p in ("right", "left", "both_ends", "hole", "scattered") for c in (False, True)
     if not c or torch.cuda.is_available() or p in ("both_ends", "hole")],
    ids=lambda x: {True: "causal", False: ""}.get(x, x) if isinstance(x, bool) else x,
)  # fmt: skip
def test_key_padding_patterns_across_whole_and_cut_tiles(pattern, causal):
    """Padding only at the ends lets the forward and dQ kernels run the whole tiles inside the
    real keys without reading the padding mask; any hole sends every tile through the loops
    that read it. Both give the reference's answer, forward and backward, with the real keys
    spanning whole tiles and cut ones; and the kernels are handed keys and values that are NaN
    wherever padded, so a padded key read anywhere (even times zero) fails the check."""
    _, bn = block_sizes()
    T = 5 * bn + 3
    s = AttentionShape(2, 2, 1, T, T, 16, 16)
    q, k, v = make_qkv(s, torch.float32, torch.get_default_device())
    kpm = padding_pattern(pattern, T, bn).to(q.device)
    poison = kpm[:, None, :, None]

    def poisoned_op(q, k, v, **kwargs):  # the reference gets the clean keys and values
        k, v = (PoisonPadded.apply(t, poison) for t in (k, v))
        return fusedattn.attention(q, k, v, backend="triton", **kwargs)

    kwargs = dict(key_padding_mask=kpm, is_causal=causal, enable_gqa=True)
    assert_op_kx(poisoned_op, reference.attention, dict(q=q, k=k, v=v), grad_of=ALL,
                 kwargs=kwargs)  # fmt: skip


@pytest.mark.parametrize("pattern", ["holes", "runs"])
@pytest.mark.parametrize(
    "backend",
    ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels),
     pytest.param("cuda", marks=pytest.mark.gpu)],
)  # fmt: skip
def test_nan_and_inf_in_padded_keys_reach_no_output_or_gradient(backend, pattern, device):
    """A padded key never contributes, whatever it holds: with NaN in every padded key and
    +inf in every padded value, the output and every gradient are those of the same call
    with finite padded keys (the Triton dQ kernel and the reference once multiplied dS = 0 by
    the NaN key; the torch backend let SDPA add -inf to a NaN score, issue #82). "runs":
    right and left padding and a sequence of padding only (the torch backend's views);
    "holes": padding inside a sequence (its zeroed copy). With a causal window and a float
    mask whose gradient is taken, so every mask path meets the padding."""
    s = AttentionShape(3, 2, 2, 33, 70, 16, 16)
    dtype = torch.bfloat16 if backend == "cuda" else torch.float32
    q, k, v = make_qkv(s, dtype, device)
    kpm = torch.zeros(3, 70, dtype=torch.bool, device=device)
    kpm[0, 50:] = True
    kpm[1, :9] = True
    if pattern == "holes":
        kpm[1, 30:34] = True
    else:
        kpm[2] = True
    bias = torch.randn(1, 2, 33, 70, dtype=dtype, device=device)
    kwargs = dict(key_padding_mask=kpm, backend=backend, window_size=(40, 0), is_causal=True,
                  causal_alignment="bottom_right")  # fmt: skip
    if backend == "cuda":  # the CUDA kernels take no window or float mask
        kwargs.pop("window_size")
        bias = None

    def run(k, v):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        if bias is not None:
            leaves.append(bias.clone().requires_grad_())
        out = fusedattn.attention(*leaves[:3], *leaves[3:], **kwargs)
        return (out, *torch.autograd.grad(out, leaves, torch.ones_like(out)))

    poison = kpm[:, None, :, None].expand_as(k)
    clean = run(k, v)
    poisoned = run(k.masked_fill(poison, float("nan")), v.masked_fill(poison, float("inf")))
    # fusedattn's kernels are deterministic: bit for bit; SDPA's GPU backwards may not be
    exact = dict(rtol=0, atol=0) if backend != "torch" else {}
    for name, a, b in zip(("out", "dq", "dk", "dv", "dmask"), clean, poisoned, strict=True):
        assert torch.isfinite(b).all(), name
        torch.testing.assert_close(b, a, **exact, msg=name)


@pytest.mark.parametrize("side", ["right", "left", "middle", "all"])
def test_valid_key_range_of_each_padding_pattern(side):
    from fusedattn.ops.attention.triton_args import valid_key_range

    kpm = torch.zeros(1, 10, dtype=torch.bool, device="cpu")
    if side == "right":
        kpm[:, 7:] = True
    elif side == "left":
        kpm[:, :3] = True
    elif side == "middle":
        kpm[:, 4:6] = True  # a hole: the range spans it, the mask hides it
    else:
        kpm[:] = True
    # [first, end), and whether every key inside it is real
    want = {"right": [0, 7, 1], "left": [3, 10, 1], "middle": [0, 10, 0], "all": [10, 0, 1]}[side]
    assert valid_key_range(kpm).tolist() == [want]


@kernels
@pytest.mark.parametrize("T", [1, 10, 16, 1000, 1024, 2500])
def test_valid_key_range_kernel_matches_the_torch_expression(T):
    """The GPU's one-launch key range (key_padding_range) against the CPU's torch ops, on rows
    right-, left- and both-padded, with holes, all padding and none, T across the kernel's
    1024-key blocks; run on the default device (compiled on a GPU, interpreted on a CPU)."""
    from fusedattn.ops.attention.triton_args import valid_key_range

    device = torch.get_default_device()
    with torch.device("cpu"):  # drawn from the CPU's generator, then moved
        g = torch.Generator().manual_seed(T)
        rows = [torch.zeros(T, dtype=torch.bool), torch.ones(T, dtype=torch.bool)]
        for _ in range(10):
            a, b = sorted(torch.randint(0, T + 1, (2,), generator=g).tolist())
            row = torch.ones(T, dtype=torch.bool)
            row[a:b] = False  # real keys [a, b): padding at either end
            rows.append(row.clone())
            row[torch.rand(T, generator=g) < 0.1] = True  # holes
            rows.append(row)
    kpm = torch.stack(rows).to(device)
    want = valid_key_range(kpm.cpu(), kernel=False)
    got = valid_key_range(kpm, kernel=True)
    assert got.dtype == torch.int32 and got.shape == (len(rows), 3)
    assert torch.equal(got.cpu(), want)
    # a strided (non-contiguous) mask reads the same rows
    wide = torch.zeros(len(rows), 2 * T, dtype=torch.bool, device=kpm.device)
    wide[:, ::2] = kpm
    assert torch.equal(valid_key_range(wide[:, ::2], kernel=True).cpu(), want)
