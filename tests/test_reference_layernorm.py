"""fusedattn.reference.layer_norm against F.layer_norm in float64 (fwd and grads)."""

import pytest
import torch
import torch.nn.functional as F
from hard_shapes import leaf_copies

from fusedattn import reference

F64 = torch.float64


@pytest.mark.parametrize("N", [1, 7, 127, 1000, 4097])
@pytest.mark.parametrize("lead", [(3,), (2, 5), ()], ids=str)
@pytest.mark.parametrize("affine", ["both", "weight", "bias", "none"])
def test_matches_float64_layer_norm(N, lead, affine):
    x = (torch.randn(*lead, N, dtype=F64) * 3 + 1).requires_grad_()
    w = torch.randn(N, dtype=F64, requires_grad=True) if affine in ("both", "weight") else None
    b = torch.randn(N, dtype=F64, requires_grad=True) if affine in ("both", "bias") else None
    out = reference.layer_norm(x, N, w, b, eps=1e-5)
    params = [p for p in (w, b) if p is not None]
    x2, *p2 = leaf_copies([x, *params])
    w2 = p2.pop(0) if w is not None else None
    b2 = p2.pop(0) if b is not None else None
    expected = F.layer_norm(x2, (N,), w2, b2, eps=1e-5)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    for a, e in ((x, x2), (w, w2), (b, b2)):
        if a is not None:
            torch.testing.assert_close(a.grad, e.grad)


def test_multi_dim_normalized_shape_on_a_non_contiguous_input():
    x = torch.randn(4, 6, 5, dtype=F64).transpose(0, 1)  # (6, 4, 5), non-contiguous
    w, b = torch.randn(4, 5, dtype=F64), torch.randn(4, 5, dtype=F64)
    torch.testing.assert_close(reference.layer_norm(x, (4, 5), w, b), F.layer_norm(x, (4, 5), w, b))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_input_with_float32_params_returns_input_dtype(dtype):
    x = torch.randn(8, 64, dtype=dtype)
    w, b = torch.randn(64), torch.randn(64)
    out = reference.layer_norm(x, 64, w, b)
    assert out.dtype == dtype
    expected = F.layer_norm(x.to(F64), (64,), w.to(F64), b.to(F64))
    torch.testing.assert_close(out.to(F64), expected, rtol=2e-2, atol=2e-2)


def test_gradcheck():
    x = torch.randn(3, 6, dtype=F64, requires_grad=True)
    w = torch.randn(6, dtype=F64, requires_grad=True)
    b = torch.randn(6, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: reference.layer_norm(x, 6, w, b), (x, w, b))
