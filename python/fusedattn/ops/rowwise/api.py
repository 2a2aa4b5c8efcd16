"""`fusedattn.layer_norm`, `fusedattn.rms_norm` and `fusedattn.softmax`: the row-wise ops'
public functions and their dispatch (validation, the plan of an eager call, the backend).

The family's files: this one (public functions, the backends' registration), plans.py (the
eager calls' plans), reference_backend.py, torch_backend.py, triton_backend.py,
cuda_backend.py (each backend's runs and refusals), norm_ops.py and softmax_ops.py (the
kernel backends' custom ops, autograd and launches, shared by Triton and CUDA).
"""

from __future__ import annotations

import math

import torch

from ...autocast import apply_autocast
from ...checks import check_layer_norm_args, check_rms_norm_args, check_softmax_args
from ..core import backends
from ..core.plans import tracing
from . import (
    cuda_backend,
    norm_ops,
    plans,
    reference_backend,
    softmax_ops,
    torch_backend,
    triton_backend,
)

for _op, _refusals in (("layer_norm", "layer_norm_refusals"), ("rms_norm", "rms_norm_refusals"),
                       ("softmax", "softmax_refusals")):  # fmt: skip
    backends.register(_op, "reference", getattr(reference_backend, _op), backends.no_refusals)
    backends.register(_op, "torch", getattr(torch_backend, _op), backends.no_refusals)
    backends.register(_op, "triton", getattr(triton_backend, _op),
                      getattr(triton_backend, _refusals))  # fmt: skip
    backends.register(_op, "cuda", getattr(cuda_backend, _op), getattr(cuda_backend, _refusals))


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
    if not tracing():  # an eager call of known metadata: its plan (plans.py)
        shape_key = plans.shape_key(normalized_shape)
        if shape_key is not None:
            key = plans.key(x, (weight, bias), (shape_key, eps), backend, "layer_norm")
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
    if impl.run is triton_backend.layer_norm and n and not norm_ops.wants_autograd(x, weight, bias):
        fast = norm_ops.TritonNormForward(x, n, weight, bias, float(eps), rms=False)
    plan = plans.RowwisePlan(impl, dict(normalized_shape=shape, eps=float(eps)), fast)
    plans.LAYER_NORM.remember(key, plan)
    return plan(x=x, weight=weight, bias=bias)


def rms_norm(
    x: torch.Tensor,
    normalized_shape,
    weight: torch.Tensor | None = None,
    eps: float | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """RMSNorm over the trailing `normalized_shape` dims, as `F.rms_norm`:
    y = x / sqrt(mean(x^2) + eps) * weight.

    weight may be x's dtype or float32; eps=None is torch.finfo(x.dtype).eps; statistics are
    fp32 and the output has x's dtype.
    """
    key = None
    if not tracing():  # an eager call of known metadata: its plan (plans.py)
        shape_key = plans.shape_key(normalized_shape)
        if shape_key is not None:
            key = plans.key(x, (weight,), (shape_key, eps), backend, "rms_norm")
        plan = plans.RMS_NORM.get(key)
        if plan is not None:
            return plan(x=x, weight=weight)
    cast = apply_autocast("rms_norm", dict(x=x, weight=weight))
    x, weight = cast["x"], cast["weight"]
    shape, eps = check_rms_norm_args(x, normalized_shape, weight, eps)
    inputs = dict(x=x, normalized_shape=shape, weight=weight, eps=eps)
    impl = backends.select("rms_norm", backend, x.device, inputs)
    if key is None:
        return impl.run(**inputs)
    n, fast = math.prod(shape), None
    if impl.run is triton_backend.rms_norm and n and not norm_ops.wants_autograd(x, weight):
        fast = norm_ops.TritonNormForward(x, n, weight, None, eps, rms=True)
    plan = plans.RowwisePlan(impl, dict(normalized_shape=shape, eps=eps), fast)
    plans.RMS_NORM.remember(key, plan)
    return plan(x=x, weight=weight)


def softmax(
    x: torch.Tensor,
    dim: int = -1,
    *,
    mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """Softmax of `x * scale` along `dim`; `mask` bool (True = keep) or float (added).

    is_causal masks x of shape (..., Tq, Tk) top-left along dim=-1 (Tq != Tk allowed). Rows
    with nothing kept give 0 output and 0 gradient, never NaN.
    """
    key = None
    if not tracing():  # an eager call of known metadata: its plan (plans.py)
        key = plans.key(x, (mask,), (dim, scale, is_causal), backend, "softmax")
        plan = plans.SOFTMAX.get(key)
        if plan is not None:
            return plan(x=x, mask=mask)
    x = apply_autocast("softmax", dict(x=x))["x"]
    dim = check_softmax_args(x, dim, mask, scale, is_causal)
    if x.dim() == 0:  # torch's softmax of a scalar: the 1-element row's, reshaped back
        one = None if mask is None else mask.reshape(1)
        return softmax(x.reshape(1), 0, mask=one, scale=scale, is_causal=is_causal,
                       backend=backend).reshape(())  # fmt: skip
    inputs = dict(x=x, dim=dim, mask=mask, scale=scale, is_causal=is_causal)
    impl = backends.select("softmax", backend, x.device, inputs)
    if key is None:
        return impl.run(**inputs)
    fast = None
    wants_grad = torch.is_grad_enabled() and x.requires_grad
    if impl.run is triton_backend.softmax and x.numel() and not wants_grad:
        fast = softmax_ops.TritonSoftmaxForward(x, dim, mask, 1.0 if scale is None else float(scale),
                                            is_causal)  # fmt: skip
    plan = plans.RowwisePlan(impl, dict(dim=dim, scale=scale, is_causal=is_causal), fast)
    plans.SOFTMAX.remember(key, plan)
    return plan(x=x, mask=mask)
