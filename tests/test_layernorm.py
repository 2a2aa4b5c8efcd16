"""Triton LayerNorm (interpreter on CPU, compiled on GPU) against float64 with the k× rule:
sizes no block divides, one-pass and looped paths, optional/fp32 parameters, layouts."""

from functools import partial

import pytest
import torch
from kx_check import assert_op_kx
from launch_probe import probe_kernels

import fusedattn
from fusedattn import reference
from fusedattn.testing import ABS_FLOOR

pytestmark = [pytest.mark.kernels, pytest.mark.usefixtures("kernel_device")]
K = pytest.importorskip("fusedattn.triton_kernels.layernorm")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
triton_ln = partial(fusedattn.layer_norm, backend="triton")


def check(x, weight=None, bias=None, shape=None, backend="triton"):
    shape = shape or x.shape[-1:]
    tensors = dict(x=x, weight=weight, bias=bias)
    grad_of = tuple(n for n, t in tensors.items() if t is not None)
    # dx rounding noise grows with rstd (316 at N = 1, where the exact dx is 0)
    stats = x.double().flatten(-len(shape))
    rstd = torch.rsqrt(stats.var(-1, unbiased=False) + 1e-5).max().item()
    op = partial(fusedattn.layer_norm, backend=backend)
    assert_op_kx(op, reference.layer_norm, tensors, kwargs=dict(normalized_shape=shape),
                 grad_of=grad_of, grad_atol=ABS_FLOOR[x.dtype] * max(1.0, rstd))  # fmt: skip


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 127, 1000, 4097])
def test_one_pass_kx(N, dtype, monkeypatch):
    probes = probe_kernels(monkeypatch, K, "layer_norm_fwd_one_pass", "layer_norm_bwd_one_pass")
    x = (torch.randn(3, 5, N) * 2 + 1).to(dtype)
    check(x, torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype))
    assert probes["layer_norm_fwd_one_pass"].grids == [(15,)]
    assert len(probes["layer_norm_bwd_one_pass"].grids) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N", [1000, 4097])
def test_looped_path_kx(N, dtype, monkeypatch):
    monkeypatch.setattr(K, "MAX_ONE_PASS_N", 256)  # force rows longer than one block
    names = ("layer_norm_fwd_looped", "layer_norm_bwd_dx_looped", "layer_norm_bwd_params_looped")
    probes = probe_kernels(monkeypatch, K, *names)
    x = (torch.randn(2, 3, N) * 3 + 50).to(dtype)  # a large mean tests the shifted sums
    check(x, torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype))
    assert all(len(probes[n].grids) == 1 for n in names)


def test_rows_past_the_backward_limit_take_one_pass_forward_and_looped_backward(monkeypatch):
    """Past MAX_ONE_PASS_BWD_N the one-pass backward would spill (sm_90), so the backward
    loops while the forward still holds the row in registers."""
    monkeypatch.setattr(K, "MAX_ONE_PASS_BWD_N", 128)
    names = ("layer_norm_fwd_one_pass", "layer_norm_bwd_one_pass", "layer_norm_bwd_dx_looped",
             "layer_norm_bwd_params_looped")  # fmt: skip
    probes = probe_kernels(monkeypatch, K, *names)
    x = torch.randn(2, 3, 300) * 2 + 5
    check(x, torch.randn(300), torch.randn(300))
    assert len(probes["layer_norm_fwd_one_pass"].grids) == 1
    assert not probes["layer_norm_bwd_one_pass"].grids
    assert len(probes["layer_norm_bwd_dx_looped"].grids) == 1
    assert len(probes["layer_norm_bwd_params_looped"].grids) == 1


@pytest.mark.parametrize("affine", ["weight", "bias", "none"])
def test_optional_parameters(affine):
    x = torch.randn(4, 33)
    w = torch.randn(33) if affine == "weight" else None
    b = torch.randn(33) if affine == "bias" else None
    check(x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_input_with_float32_parameters(dtype):
    check(torch.randn(6, 96).to(dtype), torch.randn(96), torch.randn(96))


PARAM_LAYOUTS = ["strided", "expanded"]


def param_pair(layout, n):
    """weight and bias as views the kernels must not read as contiguous: every other element
    of a wider tensor, or one element expanded (stride 0; its storage holds one value)."""
    if layout == "strided":
        return torch.randn(2 * n)[::2], torch.randn(2 * n)[1::2]
    return torch.randn(1).expand(n), torch.randn(1).expand(n)


@pytest.mark.parametrize("layout", PARAM_LAYOUTS)
def test_strided_and_expanded_parameters(layout):
    check(torch.randn(6, 40), *param_pair(layout, 40))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_float32_bias_gradient_stays_float32(dtype):
    """A half input with an fp32 bias and no weight: dbias is an fp32 sum, never rounded to the
    input dtype (it was: 3e-2 off in bf16)."""
    check(torch.randn(256, 40).to(dtype), None, torch.randn(40))


def test_non_contiguous_input_and_multi_dim_shape():
    x = torch.randn(8, 6, 40).transpose(0, 1)  # rows with a non-unit stride pattern
    check(x, torch.randn(40), torch.randn(40))
    check(torch.randn(3, 4, 10), torch.randn(4, 10), torch.randn(4, 10), shape=(4, 10))


def test_empty_batch_and_parameter_grads_are_zero():
    x = torch.randn(0, 16, requires_grad=True)
    w = torch.randn(16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    y = triton_ln(x, 16, w, b)
    y.sum().backward()
    assert y.shape == (0, 16) and (w.grad == 0).all() and (b.grad == 0).all()


def test_float64_is_refused_with_the_reason():
    with pytest.raises(ValueError, match=r"float16, bfloat16 and float32, got torch\.float64"):
        triton_ln(torch.randn(2, 8, dtype=torch.float64), 8)


def test_deterministic_parameter_gradients():
    x = torch.randn(64, 48, requires_grad=True)
    w = torch.randn(48, requires_grad=True)
    grads = []
    for _ in range(2):
        w.grad = None
        triton_ln(x, 48, w).square().sum().backward()
        grads.append(w.grad.clone())
    assert torch.equal(grads[0], grads[1])


def test_config_is_a_pure_function_of_the_row_length():
    assert K.layer_norm_config(1) == K.LayerNormConfig(1, 1, True)
    assert K.layer_norm_config(1000) == K.LayerNormConfig(1024, 4, True)
    assert K.layer_norm_config(32768) == K.LayerNormConfig(32768, 16, True)
    assert K.layer_norm_config(32769) == K.LayerNormConfig(K.LOOP_BLOCK_N, 8, False)
    assert K.layer_norm_config(65536).one_pass is False
    assert K.layer_norm_config(100, max_one_pass_n=64).block_n == 64
    assert K.backward_programs(10, 132) == 10 and K.backward_programs(10**6, 132) == 528


def test_torch_compile_fullgraph_sees_one_custom_op():
    torch._dynamo.reset()
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, requires_grad=True)
    compiled = torch.compile(lambda x, w: triton_ln(x, 32, w), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, w), triton_ln(x, 32, w))
    compiled(x, w).sum().backward()
    assert x.grad is not None and w.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("N", [512, 4096, 8192, 32768, 65536, 100_000])
def test_gpu_sizes(N, dtype):
    x = (torch.randn(64, N, device="cuda") * 2 + 1).to(dtype)
    w = torch.randn(N, device="cuda", dtype=dtype)
    b = torch.randn(N, device="cuda", dtype=dtype)
    check(x, w, b)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [1, 7, 127, 1000, 1024, 1025, 4096, 4097, 65536])
def test_cuda_backend_kx(N, dtype):
    """The CUDA C++ kernels: warp-per-row up to 1024, block-per-row beyond, vector and
    scalar loads (4096 vs 4097), fp32 and same-dtype parameters, a strided input."""
    x = (torch.randn(3, 5, N) * 2 + 1).to(dtype)
    check(x, torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype), backend="cuda")
    check(x[:, ::2], torch.randn(N), None, backend="cuda")
    check(x, None, torch.randn(N), backend="cuda")  # an fp32 bias gradient alone
    for layout in PARAM_LAYOUTS:
        check(x, *param_pair(layout, N), backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [8, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 32776])
def test_cuda_fast_path_rows_kx(N, dtype):
    """Aligned unit-stride rows take the CUDA fast path (the row read once into registers,
    layernorm_rows.cuh) for the forward and dx: every row shape it launches (a warp with 1-4
    vectors per lane, 128-512 threads with 2-8, dy read twice at 8), with and without
    parameters, a sliced row view whose row starts stay 16-byte aligned, and parameters 4 bytes
    off alignment (the general kernels). 32776, and fp32 past 16384, take the general ones."""
    x = (torch.randn(4, 3, N) * 2 + 1).to(dtype)
    check(x, torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype), backend="cuda")
    check(x, backend="cuda")
    wide = (torch.randn(4, 3, N + 8) * 2 + 1).to(dtype)
    check(wide[..., :N], torch.randn(N), torch.randn(N), backend="cuda")
    check(x, torch.randn(N + 1)[1:], torch.randn(N + 1)[1:], backend="cuda")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("N", [256, 1024, 2048, 4096, 8192])
def test_cuda_fused_backward_many_rows_kx(N, dtype):
    """Rows well past one wave of the fused backward's row groups (layernorm_rows.cuh: each
    group sums dweight/dbias over several rows in registers, then writes its partials once):
    the k× rule on dx, dweight and dbias, and bitwise-equal parameter gradients on a rerun
    (the groups' partials are summed in a fixed order). fp32 past 4096 takes the two-kernel
    path."""
    x = (torch.randn(3000, N) * 2 + 1).to(dtype)
    check(x, torch.randn(N, dtype=dtype), torch.randn(N, dtype=dtype), backend="cuda")
    w = torch.randn(N, requires_grad=True)
    b = torch.randn(N, requires_grad=True)
    dy = torch.randn_like(x)
    grads = [
        torch.autograd.grad(fusedattn.layer_norm(x, (N,), w, b, backend="cuda"), (w, b), dy)
        for _ in range(2)
    ]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


def test_cuda_backend_refuses_what_it_cannot_run(monkeypatch):
    from fusedattn.ops.core import kernels as rowwise

    with pytest.raises(ValueError, match="cuda backend needs CUDA tensors"):
        fusedattn.layer_norm(torch.randn(2, 8, device="cpu"), 8, backend="cuda")
    assert rowwise.dtype_refusals(torch.randn(2, dtype=torch.float64), backend="cuda")
    from fusedattn.ops.core import backends

    monkeypatch.setattr(backends, "EXTENSION_ERROR", None)
    monkeypatch.setattr(backends, "EXTENSION_OPS", frozenset({"softmax"}))  # an older build
    assert "rebuild" in rowwise.extension_op_refusals("layer_norm")[0]
    assert rowwise.extension_op_refusals("softmax") == []
