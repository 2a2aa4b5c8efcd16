"""`fusedattn.rms_norm`: validation, backend dispatch, and the reference / torch backends."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .. import reference
from ..checks import check_rms_norm_args
from . import backends, norm_kernels, plans, rowwise
from .autocast import apply_autocast


def _torch_rms_norm(x, normalized_shape, weight, eps):
    """F.rms_norm; a weight of another dtype than x (fp32 with a half input) is applied in fp32
    and the output rounded once to x's dtype, as F.rms_norm's own unfused fallback does."""
    if weight is not None and weight.dtype != x.dtype:
        return F.rms_norm(x.float(), normalized_shape, weight.float(), eps).to(x.dtype)
    return F.rms_norm(x, normalized_shape, weight, eps)


def _reference_rms_norm(x, normalized_shape, weight, eps):
    return reference.rms_norm(x, normalized_shape, weight, eps)


def _kernel_rms_norm(backend):
    def run(x, normalized_shape, weight, eps):
        n = math.prod(normalized_shape)
        if n == 0:  # as layer_norm: an empty output, torch's op for the autograd graph
            return _torch_rms_norm(x, normalized_shape, weight, eps)
        return norm_kernels.rms_norm(x, n, weight, eps, backend)

    return run


def _triton_refusals(*, x, weight, **_inputs) -> list[str]:
    return rowwise.dtype_refusals(x, weight)


def _cuda_refusals(*, x, weight, **_inputs) -> list[str]:
    return rowwise.dtype_refusals(x, weight, backend="cuda") + rowwise.extension_op_refusals(
        "rms_norm"
    )


backends.register("rms_norm", "reference", _reference_rms_norm, backends.no_refusals)
backends.register("rms_norm", "torch", _torch_rms_norm, backends.no_refusals)
TRITON_RUN = _kernel_rms_norm("triton")  # a plan's fast path serves only this one
backends.register("rms_norm", "triton", TRITON_RUN, _triton_refusals)
backends.register("rms_norm", "cuda", _kernel_rms_norm("cuda"), _cuda_refusals)


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
    if not rowwise.tracing():  # an eager call of known metadata: its plan (plans.py)
        shape_key = (
            tuple(normalized_shape) if not isinstance(normalized_shape, int) else normalized_shape
        )
        key = plans.rowwise_key(x, (weight,), (shape_key, eps), backend, "rms_norm")
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
    if impl.run is TRITON_RUN and n and not norm_kernels.wants_autograd(x, weight):
        fast = norm_kernels.TritonNormForward(x, n, weight, None, eps, rms=True)
    plan = plans.RowwisePlan(impl, dict(normalized_shape=shape, eps=eps), fast)
    plans.RMS_NORM.remember(key, plan)
    return plan(x=x, weight=weight)
