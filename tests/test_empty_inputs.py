"""Empty inputs give the same result on every backend (an empty or all-zero result, never a
crash): attention with no keys, no queries or no batch; softmax over an empty dim."""

import pytest
import torch

import fusedattn

BACKENDS = ["reference", "torch", pytest.param("triton", marks=pytest.mark.kernels)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(3, 0), (0, 4), (2, 0, 5)], ids=str)
def test_softmax_of_an_empty_tensor_is_empty(backend, shape, device):
    x = torch.randn(shape, device=device, requires_grad=True)
    for dim in range(len(shape)):
        y = fusedattn.softmax(x, dim, backend=backend)
        assert y.shape == x.shape and y.dtype == x.dtype
        (grad,) = torch.autograd.grad(y.sum(), x)
        assert grad.shape == x.shape
