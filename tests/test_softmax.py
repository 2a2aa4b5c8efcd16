"""Triton softmax (interpreter on CPU, compiled on GPU) against float64 with the k× rule: any
dim, scale, broadcast bool/float masks, causal with Tq != Tk, fully masked rows, one-pass and
looped paths, layouts; the backward never writes its incoming gradient."""

from functools import partial

import pytest
import torch
from kx_check import assert_op_kx
from launch_probe import probe_kernels

import fusedattn
from fusedattn import reference

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernel_device")]
K = pytest.importorskip("fusedattn.triton_kernels.softmax")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
triton_softmax = partial(fusedattn.softmax, backend="triton")


def check(x, backend="triton", **kwargs):
    op = partial(fusedattn.softmax, backend=backend)
    assert_op_kx(op, reference.softmax, dict(x=x), kwargs=kwargs, grad_of=("x",))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 127, 1000, 4097])
def test_last_dim_kx_one_pass(N, dtype, monkeypatch):
    probes = probe_kernels(monkeypatch, K, "softmax_fwd_one_pass", "softmax_bwd_one_pass")
    check((torch.randn(2, 3, N) * 4).to(dtype), dim=-1)
    assert probes["softmax_fwd_one_pass"].grids == [(6,)]
    assert probes["softmax_bwd_one_pass"].grids == [(6,)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N", [1000, 4097])
def test_looped_path_kx(N, dtype, monkeypatch):
    monkeypatch.setattr(K, "MAX_ONE_PASS_N", 256)
    probes = probe_kernels(monkeypatch, K, "softmax_fwd_looped", "softmax_bwd_looped")
    keep = torch.rand(1, N) > 0.2
    check((torch.randn(4, N) * 4).to(dtype), dim=-1, mask=keep, scale=0.7)
    check(torch.randn(3, 5, N).to(dtype), dim=-1, is_causal=True)
    assert len(probes["softmax_fwd_looped"].grids) == 2
    assert len(probes["softmax_bwd_looped"].grids) == 2


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_any_dim_without_a_copy_of_the_input(dim):
    check(torch.randn(5, 6, 7) * 3, dim=dim)


@pytest.mark.parametrize(
    "mask_shape", [(9,), (7, 9), (3, 1, 9), (2, 3, 7, 9), (2, 1, 1, 9)], ids=str
)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_broadcast_masks_with_scale(mask_shape, kind):
    x = torch.randn(2, 3, 7, 9) * 3
    mask = torch.rand(mask_shape) > 0.3 if kind == "bool" else torch.randn(mask_shape)
    check(x, dim=-1, mask=mask, scale=0.5)


@pytest.mark.parametrize("Tq,Tk", [(5, 5), (3, 11), (11, 3), (1, 7)])
def test_causal_top_left_with_tq_ne_tk(Tq, Tk):
    check(torch.randn(2, 2, Tq, Tk), dim=-1, is_causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fully_masked_rows_give_zero_and_zero_grad(dtype):
    x = torch.randn(4, 3, 10, dtype=dtype, requires_grad=True)
    keep = torch.ones(4, 3, 10, dtype=torch.bool)
    keep[1, 2] = False
    keep[3] = False
    y = triton_softmax(x, mask=keep)
    y.backward(torch.randn_like(y))
    assert not y.isnan().any() and not x.grad.isnan().any()
    assert (y[1, 2] == 0).all() and (y[3] == 0).all()
    assert (x.grad[1, 2] == 0).all() and (x.grad[3] == 0).all()
    # A row of -inf in the input itself is "nothing kept" too.
    assert (triton_softmax(torch.full((2, 5), float("-inf"), dtype=dtype)) == 0).all()


def test_layouts_transposed_sliced_and_more_than_four_dims():
    check(torch.randn(6, 8, 5).transpose(0, 2), dim=-1)
    check(torch.randn(4, 20)[:, 3:17], dim=-1)
    check(torch.randn(2, 2, 3, 2, 5, 6), dim=-1, mask=torch.rand(3, 1, 5, 6) > 0.3)
    check(torch.randn(2, 2, 3, 2, 5, 6), dim=2)


def test_backward_never_writes_the_incoming_gradient():
    x = torch.randn(3, 33, requires_grad=True)
    y = triton_softmax(x)
    dy = torch.randn_like(y)
    saved = dy.clone()
    (dx,) = torch.autograd.grad(y, x, dy)
    assert torch.equal(dy, saved) and dx.data_ptr() != dy.data_ptr()
    # An expanded (stride-0) incoming gradient, as autograd passes for a sum, works too.
    (dx,) = torch.autograd.grad(triton_softmax(x).sum(), x)
    torch.testing.assert_close(dx, torch.zeros_like(dx), atol=1e-6, rtol=0)


def test_refusals_name_their_reason():
    with pytest.raises(ValueError, match=r"got torch\.float64"):
        triton_softmax(torch.randn(2, 8, dtype=torch.float64))
    bias = torch.randn(2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="no gradient for a float mask"):
        triton_softmax(torch.randn(2, 8), mask=bias)


def test_config_is_a_pure_function_of_the_row_length():
    assert K.softmax_config(1) == K.SoftmaxConfig(1, 1, True)
    assert K.softmax_config(4097) == K.SoftmaxConfig(8192, 16, True)
    assert K.softmax_config(40000) == K.SoftmaxConfig(K.LOOP_BLOCK_N, 8, False)
    assert K.softmax_config(300, max_one_pass_n=256).one_pass is False


def test_torch_compile_fullgraph_sees_one_custom_op():
    torch._dynamo.reset()
    x = torch.randn(4, 32, requires_grad=True)
    keep = torch.rand(4, 32) > 0.5
    fn = torch.compile(lambda x: triton_softmax(x, mask=keep, scale=0.5), fullgraph=True,
                       backend="aot_eager")  # fmt: skip
    torch.testing.assert_close(fn(x), triton_softmax(x, mask=keep, scale=0.5))
    fn(x).square().sum().backward()
    assert x.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("N", [512, 4096, 32768, 65536, 100_000])
def test_gpu_sizes(N, dtype):
    x = (torch.randn(32, N, device="cuda") * 4).to(dtype)
    check(x, dim=-1, mask=torch.rand(1, N, device="cuda") > 0.1, scale=0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 1000, 1024, 1025, 4097, 65536])
def test_cuda_backend_kx(N, dtype):
    """The CUDA C++ kernels: warp-per-row up to 1024, block-per-row beyond; masks through
    broadcast strides, causal, any dim, fully masked rows."""
    x = (torch.randn(2, 3, 5, N) * 4).to(dtype)
    check(x, "cuda", dim=-1, mask=torch.rand(1, 3, 1, N) > 0.2, scale=0.5)
    check(x, "cuda", dim=-1, mask=torch.randn(5, N), is_causal=True)
    check(x, "cuda", dim=1)
    keep = torch.ones(2, 3, 5, N, dtype=torch.bool)
    keep[1, 2] = False
    y = fusedattn.softmax(x, mask=keep, backend="cuda")
    assert (y[1, 2] == 0).all() and not y.isnan().any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [8, 256, 1000, 1024, 2048, 4096, 8192, 16384, 32768, 32776])
def test_cuda_fast_path_rows_kx(N, dtype):
    """Unmasked, non-causal softmax over aligned unit-stride rows takes the CUDA fast path (rows
    in registers, softmax_rows.cuh): every row shape it launches (a warp with 1-4 vectors per
    lane, 128-512 threads with 2-8), scales of both signs, a sliced row view, the backward, and
    a row of -inf (0, as the general kernels give). 32776 and fp32 past 16384 take the general
    kernels."""
    x = (torch.randn(3, 5, N) * 4).to(dtype)
    check(x, "cuda", dim=-1, scale=0.5)
    check(x, "cuda", dim=-1, scale=-1.3)
    wide = (torch.randn(3, 5, N + 8) * 4).to(dtype)
    check(wide[..., :N], "cuda", dim=-1)  # row starts 16-byte aligned: N + 8 elements apart
    x = x.clone()
    x[1, 2] = float("-inf")
    y = fusedattn.softmax(x, backend="cuda")
    assert (y[1, 2] == 0).all() and not y.isnan().any()


@pytest.mark.parametrize(
    "backend,invariant",
    [("reference", False), ("torch", False), ("triton", False), ("auto", False),
     ("triton", True), ("auto", True)],  # the switch refuses the torch backend
)  # fmt: skip
@pytest.mark.parametrize("shape,dim", [((3, 5, 7), 0), ((3, 5, 7), 1), ((2, 3, 4, 5, 6), 2)])
def test_any_dim_gives_a_contiguous_result_as_torch_does(shape, dim, backend, invariant):
    """Along a dim other than the last the result is contiguous, as aten's _softmax (vLLM's
    test_softmax_non_last_dim asserts it): it was a view of a dim-last buffer on the Triton
    kernels, so under fusedattn.batch_invariant (auto = Triton) the layout changed with the
    switch. Five dims that do not merge: a buffer copied back. The backward's dx too."""
    x = torch.randn(shape, requires_grad=True)
    with fusedattn.batch_invariant(invariant):
        y = fusedattn.softmax(x, dim, backend=backend)
        (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
        with torch.no_grad():  # the plan's forward (no autograd), twice: first call, then bound
            plain = [fusedattn.softmax(x, dim, backend=backend) for _ in range(2)]
    want = torch.softmax(x.double(), dim)
    for t in (y, dx, *plain):
        assert t.is_contiguous() and t.shape == x.shape
    for t in (y, *plain):
        torch.testing.assert_close(t.double(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", ["reference", "torch", "triton"])
def test_a_scalar_follows_torchs_contract(backend):
    """vLLM's test_row_softmax_scalar: a 0-d tensor's softmax along 0 or -1 is 1, as torch's;
    dim 1 raises torch's IndexError (checks.DimensionError, a ValueError too)."""
    x = torch.tensor(2.5, requires_grad=True)
    for dim in (0, -1):
        y = fusedattn.softmax(x, dim, backend=backend)
        assert y.shape == () and y.item() == 1.0
        (dx,) = torch.autograd.grad(y, x)
        assert dx.item() == 0.0
    with pytest.raises(IndexError, match=r"range of \[-1, 0\], but got 1"):
        fusedattn.softmax(x, 1, backend=backend)
    with pytest.raises(ValueError):
        fusedattn.softmax(torch.randn(2, 3), -3, backend=backend)
