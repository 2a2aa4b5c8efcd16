"""Empty inputs give the same result on every backend (an empty or all-zero result, never a
crash): attention with no keys, no queries or no batch; softmax over an empty dim; LayerNorm and
RMSNorm over a normalized_shape holding a 0."""

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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("B,Tq,Tk", [(2, 5, 0), (2, 0, 5), (0, 5, 5)], ids=str)
@pytest.mark.parametrize("with_sinks", [False, True], ids=["", "sinks"])
def test_attention_with_nothing_to_attend(backend, B, Tq, Tk, with_sinks, device):
    """No keys: 0 output, lse -inf (the sink with sinks), 0 gradients; no queries or no batch:
    empty results."""
    q = torch.randn(B, 2, Tq, 8, device=device, requires_grad=True)
    k = torch.randn(B, 2, Tk, 8, device=device, requires_grad=True)
    v = torch.randn(B, 2, Tk, 8, device=device, requires_grad=True)
    sinks = torch.randn(2, device=device) if with_sinks else None
    lse_backend = "reference" if backend == "torch" else backend  # SDPA has no lse
    out, lse = fusedattn.attention(q, k, v, sinks=sinks, return_lse=True, backend=lse_backend)
    out = fusedattn.attention(q, k, v, sinks=sinks, backend=backend)
    assert out.shape == (B, 2, Tq, 8) and (out == 0).all()
    expect = float("-inf") if sinks is None else sinks[None, :, None].expand(B, 2, Tq)
    torch.testing.assert_close(
        lse, torch.full((B, 2, Tq), float("-inf"), device=device) if sinks is None else expect
    )
    grads = torch.autograd.grad(out.sum(), (q, k, v), allow_unused=True)
    for g, t in zip(grads, (q, k, v), strict=True):
        assert g is None or (g.shape == t.shape and (g == 0).all())


@pytest.mark.parametrize(
    "backend", [*BACKENDS, pytest.param("cuda", marks=pytest.mark.gpu), "auto"]
)
@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_norm_over_a_zero_sized_normalized_shape_is_empty(backend, op, device):
    """normalized_shape may hold a 0, as in F.layer_norm / F.rms_norm: an empty output and
    empty gradients (the kernel backends used to fail reshaping 0 elements into rows of 0)."""
    x = torch.randn(2, 0, 3, device=device, requires_grad=True)
    w = torch.randn(0, 3, device=device, requires_grad=True)
    b = torch.randn(0, 3, device=device, requires_grad=True)
    if op == "layer_norm":
        y, leaves = fusedattn.layer_norm(x, (0, 3), w, b, backend=backend), (x, w, b)
    else:
        y, leaves = fusedattn.rms_norm(x, (0, 3), w, backend=backend), (x, w)
    assert y.shape == x.shape and y.dtype == x.dtype
    grads = torch.autograd.grad(y.sum(), leaves)
    assert [g.shape for g in grads] == [t.shape for t in leaves]
    module = fusedattn.LayerNorm((0, 3)) if op == "layer_norm" else fusedattn.RMSNorm((0, 3))
    assert module.to(device)(x).shape == x.shape
