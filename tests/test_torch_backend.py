"""backend="torch" (torch's fused ops wrapped to our semantics) under the k× rule.

Truth: the float64 twin. Baseline: the naive reference run in the tested dtype.
"""

from functools import partial

import pytest
import torch
import torch.nn.functional as F
from hard_shapes import AttentionShape, attention_shapes, make_qkv
from kx_check import assert_op_kx
from torch.utils._python_dispatch import TorchDispatchMode

import fusedattn
from fusedattn import reference
from fusedattn.testing import ABS_FLOOR

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", attention_shapes(sizes=(1, 7, 63), head_dims=(40,)), ids=str)
def test_attention_forward_backward_kx(shape, dtype):
    q, k, v = make_qkv(shape, dtype, "cpu", layout="transposed")
    kpm = torch.zeros(shape.B, shape.Tk, dtype=torch.bool)
    kpm[1, shape.Tk // 2 :] = True
    assert_op_kx(
        partial(fusedattn.attention, backend="torch"),
        reference.attention,
        dict(q=q, k=k, v=v),
        kwargs=dict(is_causal=True, enable_gqa=True, key_padding_mask=kpm),
        grad_of=("q", "k", "v"),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_float_mask_and_its_gradient(dtype):
    s = AttentionShape(B=2, Hq=2, Hkv=2, Tq=9, Tk=13, D=32, Dv=32)
    q, k, v = make_qkv(s, dtype, "cpu")
    bias = torch.randn(2, 9, 13, dtype=dtype)
    assert_op_kx(
        partial(fusedattn.attention, backend="torch"),
        reference.attention,
        dict(q=q, k=k, v=v, attn_mask=bias),
        grad_of=("q", "attn_mask"),
    )


def test_attention_fully_masked_rows():
    s = AttentionShape(B=2, Hq=2, Hkv=2, Tq=4, Tk=5, D=8, Dv=8)
    q, k, v = make_qkv(s, torch.float32, "cpu", requires_grad=True)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0] = True
    out = fusedattn.attention(q, k, v, is_causal=True, key_padding_mask=kpm, backend="torch")
    out.sum().backward()
    assert (out[0] == 0).all() and (q.grad[0] == 0).all() and (k.grad[0] == 0).all()
    assert not q.grad.isnan().any()


@pytest.mark.parametrize("float_mask", [False, True])
def test_attention_dead_rows_never_reach_sdpa_as_fully_masked(monkeypatch, float_mask):
    """An SDPA whose fully masked rows are NaN (cuDNN's backward did that on the H100, torch
    2.11): the torch backend still returns 0 output and 0 gradients there, NaN nowhere."""
    import torch.nn.functional as F

    def nan_on_dead_rows(q, k, v, attn_mask=None, scale=None, **_):
        scores = q @ k.transpose(-1, -2) * (scale or q.shape[-1] ** -0.5)
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
        return torch.softmax(scores, dim=-1) @ v  # NaN where a row has no key

    monkeypatch.setattr(F, "scaled_dot_product_attention", nan_on_dead_rows)
    s = AttentionShape(B=1, Hq=2, Hkv=2, Tq=6, Tk=5, D=8, Dv=8)
    q, k, v = make_qkv(s, torch.float32, "cpu", requires_grad=True)
    keep = torch.rand(6, 5) > 0.3
    keep[1] = keep[4] = False
    keep[0, 0] = True  # row 0 keeps a key either way
    mask = keep if not float_mask else torch.zeros(6, 5).masked_fill(~keep, float("-inf"))
    out = fusedattn.attention(q, k, v, attn_mask=mask, backend="torch")
    out.sum().backward()
    assert not out.isnan().any() and (out[:, :, [1, 4]] == 0).all()
    assert (q.grad[:, :, [1, 4]] == 0).all()
    for grad in (q.grad, k.grad, v.grad):
        assert torch.isfinite(grad).all()
    want = reference.attention(q.double(), k.double(), v.double(), attn_mask=keep)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 127, 1000, 4097])
def test_layer_norm_kx(N, dtype):
    x = (torch.randn(3, 4, N) * 2 + 0.5).to(dtype)
    # Rounding noise in dx is amplified by rstd, which reaches 1/sqrt(eps) = 316 at N = 1
    # (where the exact dx is 0): scale the absolute floor with it.
    rstd = torch.rsqrt(x.double().var(-1, unbiased=False) + 1e-5).max().item()
    assert_op_kx(
        partial(fusedattn.layer_norm, backend="torch"),
        reference.layer_norm,
        dict(x=x, weight=torch.randn(N, dtype=dtype), bias=torch.randn(N, dtype=dtype)),
        kwargs=dict(normalized_shape=(N,)),
        grad_of=("x", "weight", "bias"),
        grad_atol=ABS_FLOOR[dtype] * max(1.0, rstd),
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("eps", [1e-12, 1e-5], ids=str)
def test_layer_norm_constant_and_offset_rows_at_berts_eps(eps, dtype):
    """Issue #31 item 8: torch's CPU LayerNorm in float16 gave NaN dx and dweight for a
    constant row at eps=1e-12; half inputs on a CPU are now computed with fp32 statistics.
    Rows: random, constant (0.5), a large common offset (1000 + noise below the dtype's
    ulp there), and random again. The weight is small so that the true dx of a constant row
    (1/sqrt(eps) = 1e6 times dy * weight) fits in float16."""
    N = 257
    x = torch.randn(4, N)
    x[1] = 0.5
    x[2] = 1000 + torch.randn(N) * 1e-2
    x = x.to(dtype)
    assert_op_kx(
        partial(fusedattn.layer_norm, backend="torch"),
        reference.layer_norm,
        dict(x=x, weight=(torch.randn(N) * 1e-4).to(dtype), bias=torch.randn(N).to(dtype)),
        kwargs=dict(normalized_shape=(N,), eps=eps),
        grad_of=("x", "weight", "bias"),
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_layer_norm_half_input_with_float32_parameters(dtype):
    """fp32 weight and bias with a half input (what autocast leaves): computed in fp32, output in
    x's dtype, parameter gradients in fp32. (CUDA's F.layer_norm refuses the mix outright.)"""
    N = 1000
    x = (torch.randn(3, 4, N) * 2 + 0.5).to(dtype)
    params = dict(weight=torch.randn(N), bias=torch.randn(N))
    assert_op_kx(
        partial(fusedattn.layer_norm, backend="torch"),
        reference.layer_norm,
        dict(x=x, **params),
        kwargs=dict(normalized_shape=(N,)),
        grad_of=("x", "weight", "bias"),
    )
    w = params["weight"].requires_grad_()
    out = fusedattn.layer_norm(x, (N,), w, params["bias"], backend="torch")
    out.float().sum().backward()
    assert out.dtype == dtype and w.grad.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 1000, 4097])
def test_softmax_masked_causal_kx(N, dtype):
    assert_op_kx(
        partial(fusedattn.softmax, backend="torch"),
        reference.softmax,
        dict(x=(torch.randn(2, 3, 5, N) * 3).to(dtype)),
        kwargs=dict(dim=-1, mask=torch.rand(1, 3, 1, N) > 0.2, scale=0.5, is_causal=True),
        grad_of=("x",),
    )


def test_softmax_float_mask_keeps_input_dtype():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    out = fusedattn.softmax(x, mask=torch.randn(4, 8), backend="torch")
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "backend", ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]
)
@pytest.mark.parametrize("mask_shape", [(1, 1, 1, 1), (2, 3, 17, 1)], ids=str)
def test_bias_constant_over_keys_gets_a_zero_gradient_in_any_mask_dtype(
    backend, mask_shape, device
):
    """fp32 inputs with a bf16 bias and key padding: the bias's exact gradient is 0. Merged
    in the mask's own dtype, the broadcast's gradient was summed in bf16 (0.22 instead of 0)."""
    s = AttentionShape(B=2, Hq=3, Hkv=3, Tq=17, Tk=33, D=16, Dv=16)
    q, k, v = make_qkv(s, torch.float32, device)
    bias = torch.randn(mask_shape, dtype=torch.bfloat16, device=device, requires_grad=True)
    kpm = torch.zeros(2, 33, dtype=torch.bool, device=device)
    kpm[1, 20:] = True
    out = fusedattn.attention(q, k, v, bias, key_padding_mask=kpm, backend=backend)
    (grad,) = torch.autograd.grad(out, bias, torch.randn_like(out))
    assert grad.dtype == torch.bfloat16 and grad.abs().max().item() < 1e-4


def test_attention_edge_cases_of_sdpa():
    """Causal with a scale <= 0 (SDPA's CPU kernel gave NaN), masks of 0 or 1 dims (they
    broadcast; SDPA crashed on them)."""
    s = AttentionShape(B=2, Hq=2, Hkv=2, Tq=6, Tk=6, D=8, Dv=8)
    q, k, v = make_qkv(s, torch.float32, "cpu")
    for scale in (0.0, -0.5):
        got = fusedattn.attention(q, k, v, is_causal=True, scale=scale, backend="torch")
        want = reference.attention(q.double(), k.double(), v.double(), is_causal=True, scale=scale)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    for mask in (torch.tensor(True), torch.rand(6) > 0.3, torch.randn(()), torch.randn(6)):
        got = fusedattn.attention(q, k, v, mask, backend="torch")
        want = reference.attention(
            q.double(), k.double(), v.double(), mask if mask.dtype == torch.bool else mask.double()
        )
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


class AtenOps(TorchDispatchMode):
    """The aten ops a call runs: (name, numel of its output), views left out."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(tag == torch.Tag.view_copy for tag in func.tags) and not func.is_view:
            size = out.numel() if isinstance(out, torch.Tensor) else 0
            self.ops.append((func.__name__, size))
        return out


@pytest.mark.parametrize("train", [False, True], ids=["infer", "train"])
def test_key_padding_runs_sdpa_on_views_of_each_sequences_keys(train):
    """Right and left padding: one SDPA call per run of sequences with the same key range, on
    views of their keys (no mask at all, nothing K-sized written), and one output-sized cat.
    The copy of K and V that clears padded rows is left to masks with holes (next test)."""
    B, H, T, D = 4, 4, 64, 32
    q, k, v = (torch.randn(B, T, H, D).transpose(1, 2).requires_grad_(train) for _ in range(3))
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, 40:] = pad[2, 40:] = True  # sequences 1 and 2 share one call
    pad[3, :5] = True
    with AtenOps() as ours:
        out = fusedattn.attention(q, k, v, key_padding_mask=pad, backend="torch")
    names = [name for name, _ in ours.ops]
    sdpa_calls = [n for n in names if n.startswith("_scaled_dot_product")]
    assert len(sdpa_calls) == 3, ours.ops
    others = [op for op in ours.ops if not op[0].startswith("_scaled_dot_product")]
    assert others == [("cat.default", out.numel())], ours.ops
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :])
    torch.testing.assert_close(out, want)


def test_key_padding_with_holes_zeroes_padded_keys_in_a_copy():
    """A sequence whose real keys have a hole cannot be one view: K and V are copied with
    their padded rows zeroed (two K/V-sized writes), then one masked SDPA call as a user
    writes it."""
    B, H, T, D = 2, 4, 64, 32
    q, k, v = (torch.randn(B, T, H, D).transpose(1, 2) for _ in range(3))
    pad = torch.zeros(B, T, dtype=torch.bool)
    pad[1, 20:30] = True
    with AtenOps() as direct:
        F.scaled_dot_product_attention(q, k, v, attn_mask=~pad[:, None, None, :])
    with AtenOps() as ours:
        fusedattn.attention(q, k, v, key_padding_mask=pad, backend="torch")
    added = list(ours.ops)
    for op in direct.ops:
        assert op in added, f"the direct call's {op} is missing: {ours.ops}"
        added.remove(op)
    assert sorted(added) == [("masked_fill.Scalar", k.numel())] * 2, added


@pytest.mark.parametrize("pattern", ["right", "left", "hole", "all"])
def test_key_ranges_of_each_padding_pattern(pattern):
    from fusedattn.ops.shared.sdpa import key_ranges

    pad = torch.zeros(3, 10, dtype=torch.bool)
    if pattern == "right":
        pad[1:, 7:] = True
        assert key_ranges(pad) == [(0, 1, 0, 10), (1, 3, 0, 7)]
    elif pattern == "left":
        pad[0, :3] = True
        assert key_ranges(pad) == [(0, 1, 3, 10), (1, 3, 0, 10)]
    elif pattern == "hole":
        pad[2, 4:6] = True
        assert key_ranges(pad) is None
    else:
        pad[1] = True
        assert key_ranges(pad) == [(0, 1, 0, 10), (1, 2, 0, 0), (2, 3, 0, 10)]


@pytest.mark.parametrize("slopes_shape", [(4,), (2, 4)])
def test_float64_alibi_stays_float64_in_decoding_and_packed_calls(slopes_shape):
    """float64 in, float64 throughout: the ALiBi bias of the decode and packed torch paths was
    built from the fp32 slopes in fp32 (4.1e-8 from the truth; the reference 2.2e-16)."""
    g = torch.Generator().manual_seed(0)
    slopes = torch.rand(*slopes_shape, generator=g) + 0.1  # float32, as the API asks
    q = torch.randn(2, 3, 4, 16, dtype=torch.float64, generator=g)
    kc = torch.randn(2, 40, 2, 16, dtype=torch.float64, generator=g)
    vc = torch.randn(2, 40, 2, 16, dtype=torch.float64, generator=g)
    lengths = torch.tensor([37, 21], dtype=torch.int32)
    kw = dict(cache_seqlens=lengths, alibi_slopes=slopes, is_causal=True)
    got = fusedattn.attention_with_kvcache(q, kc, vc, backend="torch", **kw)
    want = reference.attention_with_kvcache(q, kc, vc, **kw)
    assert (got - want).abs().max() < 1e-12
    packed_q = q.flatten(0, 1)  # (8, 4, 16): sequences of 4 queries over 37 and 21 keys
    keys = torch.cat([kc[0, :37], kc[1, :21]])
    values = torch.cat([vc[0, :37], vc[1, :21]])
    cu_q = torch.tensor([0, 3, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 37, 58], dtype=torch.int32)
    args = (packed_q[:6], keys, values, cu_q, cu_k, 3, 37)
    kw = dict(alibi_slopes=slopes, is_causal=True, causal_alignment="bottom_right",
              enable_gqa=True)  # fmt: skip
    got = fusedattn.varlen_attention(*args, backend="torch", **kw)
    want = reference.varlen_attention(*args, **kw)
    assert (got - want).abs().max() < 1e-12
