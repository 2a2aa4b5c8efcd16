"""`fusedattn.softmax`: validation, backend dispatch, and the reference / torch backends."""

from __future__ import annotations

import torch

from .. import reference
from ..checks import check_softmax_args
from ..masks import causal_mask
from . import backends, plans, rowwise
from .autocast import apply_autocast


def _torch_softmax(x, dim, mask, scale, is_causal):
    """torch.softmax on the masked, scaled input; rows with no finite entry give 0."""
    dtype = x.dtype  # a float32 mask promotes a half input: compute in fp32, return x's dtype
    if scale is not None:
        x = x * scale
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else x + mask
    if is_causal:
        x = x.masked_fill(~causal_mask(x.shape[-2], x.shape[-1], device=x.device), float("-inf"))
    if x.shape[dim] == 0:  # nothing to normalise (amax cannot reduce an empty dim)
        return x.clone().to(dtype)
    # torch.softmax gives NaN on a row of -inf; zero it before and after (detached max, so the
    # zeroed rows also get a zero gradient).
    dead = x.detach().amax(dim, keepdim=True) == float("-inf")
    return torch.softmax(x.masked_fill(dead, 0.0), dim).masked_fill(dead, 0.0).to(dtype)


def _reference_softmax(x, dim, mask, scale, is_causal):
    return reference.softmax(x, dim, mask=mask, scale=scale, is_causal=is_causal)


def _kernel_softmax(backend):
    def run(x, dim, mask, scale, is_causal):
        scale = 1.0 if scale is None else float(scale)
        return rowwise.softmax(x, dim, mask, scale, is_causal, backend)

    return run


def _kernel_refusals(backend):
    def refusals(*, x, mask, **_inputs) -> list[str]:
        reasons = rowwise.dtype_refusals(x, backend=backend)
        if backend == "cuda":
            reasons += rowwise.extension_op_refusals("softmax")
        if mask is not None and mask.requires_grad:
            reasons.append(f"the {backend} softmax has no gradient for a float mask")
        return reasons

    return refusals


backends.register("softmax", "reference", _reference_softmax, backends.no_refusals)
backends.register("softmax", "torch", _torch_softmax, backends.no_refusals)
TRITON_RUN = _kernel_softmax("triton")  # a plan's fast path serves only this one
backends.register("softmax", "triton", TRITON_RUN, _kernel_refusals("triton"))
backends.register("softmax", "cuda", _kernel_softmax("cuda"), _kernel_refusals("cuda"))


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
    if not rowwise.tracing():  # an eager call of known metadata: its plan (plans.py)
        key = plans.rowwise_key(x, (mask,), (dim, scale, is_causal), backend, "softmax")
        plan = plans.SOFTMAX.get(key)
        if plan is not None:
            return plan(x=x, mask=mask)
    x = apply_autocast("softmax", dict(x=x))["x"]
    dim = check_softmax_args(x, dim, mask, scale, is_causal)
    inputs = dict(x=x, dim=dim, mask=mask, scale=scale, is_causal=is_causal)
    impl = backends.select("softmax", backend, x.device, inputs)
    if key is None:
        return impl.run(**inputs)
    fast = None
    wants_grad = torch.is_grad_enabled() and x.requires_grad
    if impl.run is TRITON_RUN and x.numel() and not wants_grad:
        fast = rowwise.TritonSoftmaxForward(x, dim, mask, 1.0 if scale is None else float(scale),
                                            is_causal)  # fmt: skip
    plan = plans.RowwisePlan(impl, dict(dim=dim, scale=scale, is_causal=is_causal), fast)
    plans.SOFTMAX.remember(key, plan)
    return plan(x=x, mask=mask)
