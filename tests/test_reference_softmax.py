"""fusedattn.reference.softmax against float64 torch.softmax with explicit masks."""

import pytest
import torch
from hard_shapes import leaf_copies

from fusedattn import masks, reference

F64 = torch.float64


@pytest.mark.parametrize("N", [1, 7, 127, 1000, 4097])
@pytest.mark.parametrize("dim", [-1, 0, 1])
def test_matches_torch_softmax_along_any_dim(N, dim):
    x = (torch.randn(3, 5, N, dtype=F64) * 4).requires_grad_()
    out = reference.softmax(x, dim)
    (x2,) = leaf_copies([x])
    expected = torch.softmax(x2, dim)
    torch.testing.assert_close(out, expected)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x.grad, x2.grad)


@pytest.mark.parametrize("mask_shape", [(6, 9), (1, 9), (4, 1, 9), (4, 6, 9)], ids=str)
def test_bool_and_float_masks_broadcast_with_scale(mask_shape):
    x = torch.randn(4, 6, 9, dtype=F64)
    keep = torch.rand(mask_shape) > 0.3
    keep[..., 0] = True  # keep one entry per row so the torch oracle has no NaN rows
    expected = torch.softmax((x * 0.5).masked_fill(~keep, float("-inf")), -1)
    torch.testing.assert_close(reference.softmax(x, mask=keep, scale=0.5), expected)
    bias = torch.randn(mask_shape, dtype=F64)
    torch.testing.assert_close(reference.softmax(x, mask=bias), torch.softmax(x + bias, -1))


@pytest.mark.parametrize("Tq,Tk", [(5, 5), (3, 8), (8, 3)])
def test_causal_is_top_left_with_tq_ne_tk(Tq, Tk):
    x = torch.randn(2, Tq, Tk, dtype=F64)
    expected = torch.softmax(x.masked_fill(~masks.causal_mask(Tq, Tk), float("-inf")), -1)
    torch.testing.assert_close(reference.softmax(x, is_causal=True), expected)


@pytest.mark.parametrize("dtype", [F64, torch.float32, torch.bfloat16, torch.float16])
def test_fully_masked_rows_give_zero_and_zero_grad(dtype):
    x = torch.randn(4, 10, dtype=dtype, requires_grad=True)
    keep = torch.ones(4, 10, dtype=torch.bool)
    keep[1] = False
    out = reference.softmax(x, mask=keep)
    out.backward(torch.randn_like(out))
    assert (out[1] == 0).all() and (x.grad[1] == 0).all()
    assert not out.isnan().any() and not x.grad.isnan().any()
    torch.testing.assert_close(out[0].float().sum(), torch.tensor(1.0), rtol=1e-2, atol=1e-2)
    assert out.dtype == dtype


def test_minus_inf_inputs_follow_masking_semantics():
    x = torch.tensor([[0.0, float("-inf"), 1.0], [float("-inf")] * 3], dtype=F64)
    out = reference.softmax(x)
    torch.testing.assert_close(out[0], torch.softmax(x[0], -1))
    assert (out[1] == 0).all()


def test_gradcheck_with_mask_and_scale():
    x = torch.randn(3, 4, 5, dtype=F64, requires_grad=True)
    bias = torch.randn(4, 5, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, b: reference.softmax(x, -1, mask=b, scale=0.7, is_causal=True), (x, bias)
    )
