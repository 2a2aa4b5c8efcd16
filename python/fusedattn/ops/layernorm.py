"""`fusedattn.layer_norm`: validation, backend dispatch, and the reference / torch backends."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import reference
from ..checks import check_layer_norm_args
from . import backends, norm_kernels, plans, rowwise
from .autocast import apply_autocast


def _torch_layer_norm(x, normalized_shape, weight, bias, eps):
    """F.layer_norm; parameters of another dtype than x (fp32 weights with a half input, as
    autocast leaves them) are computed in fp32 and the output rounded once to x's dtype: the
    eager CUDA kernel takes parameters only in x's dtype (pytorch/pytorch#188503; this backend's
    mixed-dtype GPU test failed on the H200 with torch 2.11). On a CPU see _cpu_layer_norm."""
    if x.device.type == "cpu":
        return _cpu_layer_norm(x, normalized_shape, weight, bias, eps)
    params = [t for t in (weight, bias) if t is not None]
    if any(t.dtype != x.dtype for t in params):
        weight = None if weight is None else weight.float()
        bias = None if bias is None else bias.float()
        return F.layer_norm(x.float(), normalized_shape, weight, bias, eps).to(x.dtype)
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


def _cpu_layer_norm(x, normalized_shape, weight, bias, eps):
    """F.layer_norm on a CPU, made exact where torch's CPU kernel is not (torch 2.14, issue
    #31): a constant row in float16 at eps=1e-12 (BERT's) gave NaN dx and dweight, and rows
    with a large common offset (1000 + noise of 1e-2) lost their variance to cancellation
    (fp32 dx off by 0.47). Half inputs are computed in fp32, and each row's mean is taken
    out first, detached: LayerNorm does not change when a row is shifted, so the function and
    its gradient are the same, and the kernel's statistics see values near 0. One more pass
    over x, on the CPU only."""
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    dims = tuple(range(-len(normalized_shape), 0))
    xc = x.to(compute)
    if xc.numel():
        xc = xc - xc.detach().mean(dims, keepdim=True)
    weight = None if weight is None else weight.to(compute)
    bias = None if bias is None else bias.to(compute)
    return F.layer_norm(xc, normalized_shape, weight, bias, eps).to(x.dtype)


def _reference_layer_norm(x, normalized_shape, weight, bias, eps):
    return reference.layer_norm(x, normalized_shape, weight, bias, eps)


def _kernel_layer_norm(backend):
    def run(x, normalized_shape, weight, bias, eps):
        n = math.prod(normalized_shape)
        if n == 0:  # a zero-sized normalized dim: the output is empty; torch's op keeps autograd
            return _torch_layer_norm(x, normalized_shape, weight, bias, eps)
        return norm_kernels.layer_norm(x, n, weight, bias, eps, backend)

    return run


def _triton_refusals(*, x, weight, bias, **_inputs) -> list[str]:
    return rowwise.dtype_refusals(x, weight, bias)


def _cuda_refusals(*, x, weight, bias, **_inputs) -> list[str]:
    return rowwise.dtype_refusals(x, weight, bias, backend="cuda") + rowwise.extension_op_refusals(
        "layer_norm"
    )


backends.register("layer_norm", "reference", _reference_layer_norm, backends.no_refusals)
backends.register("layer_norm", "torch", _torch_layer_norm, backends.no_refusals)
TRITON_RUN = _kernel_layer_norm("triton")  # a plan's fast path serves only this one
backends.register("layer_norm", "triton", TRITON_RUN, _triton_refusals)
backends.register("layer_norm", "cuda", _kernel_layer_norm("cuda"), _cuda_refusals)


def layer_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """LayerNorm over the trailing `normalized_shape` dims, as `F.layer_norm`.

    weight and bias are optional and may be x's dtype or float32; statistics are fp32 and the
    variance biased, as torch; the output has x's dtype.
    """
    key = None
    if not rowwise.tracing():  # an eager call of known metadata: its plan (plans.py)
        shape_key = (
            tuple(normalized_shape) if not isinstance(normalized_shape, int) else normalized_shape
        )
        key = plans.rowwise_key(x, (weight, bias), (shape_key, eps), backend, "layer_norm")
        plan = plans.LAYER_NORM.get(key)
        if plan is not None:
            return plan(x=x, weight=weight, bias=bias)
    cast = apply_autocast("layer_norm", dict(x=x, weight=weight, bias=bias))
    x, weight, bias = cast["x"], cast["weight"], cast["bias"]
    shape = check_layer_norm_args(x, normalized_shape, weight, bias, eps)
    inputs = dict(x=x, normalized_shape=shape, weight=weight, bias=bias, eps=float(eps))
    impl = backends.select("layer_norm", backend, x.device, inputs)
    if key is None:
        return impl.run(**inputs)
    n, fast = math.prod(shape), None
    if impl.run is TRITON_RUN and n and not norm_kernels.wants_autograd(x, weight, bias):
        fast = norm_kernels.TritonNormForward(x, n, weight, bias, float(eps), rms=False)
    plan = plans.RowwisePlan(impl, dict(normalized_shape=shape, eps=float(eps)), fast)
    plans.LAYER_NORM.remember(key, plan)
    return plan(x=x, weight=weight, bias=bias)
