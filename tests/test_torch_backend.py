"""backend="torch" (torch's fused ops wrapped to our semantics) under the k× rule.

Reference: the float64 twin. Baseline: the naive reference run in the tested dtype.
"""

import pytest
import torch
from hard_shapes import AttentionShape, attention_shapes, leaf_copies, make_qkv

import fusedattn
from fusedattn import reference
from fusedattn.testing import ABS_FLOOR, assert_close_kx

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grads(out, inputs, grad):
    return torch.autograd.grad(out, inputs, grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", attention_shapes(sizes=(1, 7, 63), head_dims=(40,)), ids=str)
def test_attention_forward_backward_kx(shape, dtype):
    q, k, v = make_qkv(shape, dtype, "cpu", layout="transposed", requires_grad=True)
    kpm = torch.zeros(shape.B, shape.Tk, dtype=torch.bool)
    kpm[1, shape.Tk // 2 :] = True
    kw = dict(is_causal=True, enable_gqa=True, key_padding_mask=kpm)
    out = fusedattn.attention(q, k, v, backend="torch", **kw)
    q64, k64, v64 = leaf_copies((q, k, v), torch.float64)
    ref = reference.attention(q64, k64, v64, **kw)
    qb, kb, vb = leaf_copies((q, k, v))
    base = reference.attention(qb, kb, vb, **kw)
    assert out.dtype == dtype
    assert_close_kx(out, ref, base, name="out")
    grad = torch.randn_like(out)
    for name, a, r, b in zip(
        ("dq", "dk", "dv"),
        _grads(out, (q, k, v), grad),
        _grads(ref, (q64, k64, v64), grad.double()),
        _grads(base, (qb, kb, vb), grad),
        strict=True,
    ):
        assert_close_kx(a, r, b, name=name)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_float_mask_and_its_gradient(dtype):
    s = AttentionShape(B=2, Hq=2, Hkv=2, Tq=9, Tk=13, D=32, Dv=32)
    q, k, v = make_qkv(s, dtype, "cpu")
    bias = torch.randn(2, 9, 13, dtype=dtype, requires_grad=True)
    out = fusedattn.attention(q, k, v, bias, backend="torch")
    (b64,) = leaf_copies([bias], torch.float64)
    ref = reference.attention(q.double(), k.double(), v.double(), b64)
    (bb,) = leaf_copies([bias])
    base = reference.attention(q, k, v, bb)
    assert_close_kx(out, ref, base)
    grad = torch.randn_like(out)
    (g,) = torch.autograd.grad(out, bias, grad)
    (g64,) = torch.autograd.grad(ref, b64, grad.double())
    (gb,) = torch.autograd.grad(base, bb, grad)
    assert_close_kx(g, g64, gb, name="d_attn_mask")


def test_attention_fully_masked_rows():
    s = AttentionShape(B=2, Hq=2, Hkv=2, Tq=4, Tk=5, D=8, Dv=8)
    q, k, v = make_qkv(s, torch.float32, "cpu", requires_grad=True)
    kpm = torch.zeros(2, 5, dtype=torch.bool)
    kpm[0] = True
    out = fusedattn.attention(q, k, v, is_causal=True, key_padding_mask=kpm, backend="torch")
    out.sum().backward()
    assert (out[0] == 0).all() and (q.grad[0] == 0).all() and (k.grad[0] == 0).all()
    assert not q.grad.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 127, 1000, 4097])
def test_layer_norm_kx(N, dtype):
    x = (torch.randn(3, 4, N) * 2 + 0.5).to(dtype).requires_grad_()
    w = torch.randn(N, dtype=dtype, requires_grad=True)
    b = torch.randn(N, dtype=dtype, requires_grad=True)
    out = fusedattn.layer_norm(x, (N,), w, b, backend="torch")
    x64, w64, b64 = leaf_copies((x, w, b), torch.float64)
    ref = reference.layer_norm(x64, N, w64, b64)
    xb, wb, bb = leaf_copies((x, w, b))
    base = reference.layer_norm(xb, N, wb, bb)
    assert_close_kx(out, ref, base)
    # Rounding noise in dx is amplified by rstd, which reaches 1/sqrt(eps) = 316 at N = 1
    # (where the exact dx is 0): scale the absolute floor with it.
    rstd = torch.rsqrt(x64.detach().var(-1, unbiased=False) + 1e-5).max().item()
    atol = ABS_FLOOR[dtype] * max(1.0, rstd)
    grad = torch.randn_like(out)
    for name, a, r, bs in zip(
        ("dx", "dw", "db"),
        _grads(out, (x, w, b), grad),
        _grads(ref, (x64, w64, b64), grad.double()),
        _grads(base, (xb, wb, bb), grad),
        strict=True,
    ):
        assert_close_kx(a, r, bs, name=name, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 1000, 4097])
def test_softmax_masked_causal_kx(N, dtype):
    x = (torch.randn(2, 3, 5, N) * 3).to(dtype).requires_grad_()
    keep = torch.rand(1, 3, 1, N) > 0.2
    kw = dict(mask=keep, scale=0.5, is_causal=True)
    out = fusedattn.softmax(x, -1, backend="torch", **kw)
    (x64,) = leaf_copies([x], torch.float64)
    (xb,) = leaf_copies([x])
    ref, base = reference.softmax(x64, -1, **kw), reference.softmax(xb, -1, **kw)
    assert out.dtype == dtype
    assert_close_kx(out, ref, base)
    grad = torch.randn_like(out)
    (g,) = _grads(out, (x,), grad)
    (g64,) = _grads(ref, (x64,), grad.double())
    (gb,) = _grads(base, (xb,), grad)
    assert_close_kx(g, g64, gb, name="dx")


def test_softmax_float_mask_keeps_input_dtype():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    out = fusedattn.softmax(x, mask=torch.randn(4, 8), backend="torch")
    assert out.dtype == torch.bfloat16
