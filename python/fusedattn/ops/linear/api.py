"""`fusedattn.linear`: y = x @ weight^T + bias as F.linear, and under fusedattn.batch_invariant
a row's result the same bits whatever the batch (the Triton kernel's tiles and its order of
summation over K never follow M).

The family's files: this one (the public function, the backends' registration),
reference_backend.py, torch_backend.py, triton_backend.py (each backend's runs and refusals),
linear_ops.py (the Triton backend's custom ops, autograd and launches).

`auto` is torch's F.linear (cuBLAS on a GPU) unless batch invariance is on: then the Triton
kernel, which is what the switch is for. There is no CUDA C++ backend: the point of the op is
the invariant matmul, and one kernel serves it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from ... import invariance
from ...autocast import apply_autocast
from ...checks import check_linear_args
from ..core import backends
from ..core.plans import Cache, meta, process_state, tracing
from . import linear_ops, reference_backend, torch_backend, triton_backend

backends.register("linear", "reference", reference_backend.linear, backends.no_refusals)
backends.register("linear", "torch", torch_backend.linear, backends.no_refusals)
backends.register("linear", "triton", triton_backend.linear, triton_backend.linear_refusals)

PLANS = Cache("linear")  # eager calls' plans (core/plans.py), by the call's metadata


class LinearPlan:
    """The backend of one key, and for the Triton backend with no gradient wanted its forward
    with the compiled kernel bound (linear_ops.TritonLinearForward)."""

    def __init__(self, impl, fast=None):
        self.impl, self.run, self.fast = impl, impl.run, fast

    def __call__(self, x, weight, bias):
        return (self.fast or self.run)(x, weight, bias)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
) -> torch.Tensor:
    """y = x @ weight^T + bias over x's last dim, as `F.linear`: x (..., in_features), weight
    (out_features, in_features), bias (out_features,) or None, one dtype.

    With `fusedattn.batch_invariant` on, `auto` runs the Triton kernel (torch's is refused):
    a row of y is the same bits whatever the other rows of x. Otherwise `auto` is F.linear.
    """
    if backend == "auto" and not invariance._enabled and backends.ENV_VAR not in os.environ:
        # auto without the switch is torch's (AUTO_ORDER on every device, nothing refuses it):
        # F.linear straight away, its own argument checks included, so that a swapped model's
        # projections cost what nn.Linear's do
        return F.linear(x, weight, bias)
    key = None
    if not tracing():  # an eager call of known metadata: its plan
        try:
            if not torch.is_autocast_enabled(x.device.type):
                key = (
                    meta(x), meta(weight), meta(bias), backend, *process_state(x, backend),
                    torch.backends.cuda.matmul.allow_tf32,  # fp32's dot precision (dot_flags)
                )  # fmt: skip
        except (AttributeError, TypeError, RuntimeError):  # not tensors: the checks name them
            key = None
        plan = PLANS.get(key)
        if plan is not None:
            return plan(x, weight, bias)
    cast = apply_autocast("linear", dict(x=x, weight=weight, bias=bias))
    x, weight, bias = cast["x"], cast["weight"], cast["bias"]
    check_linear_args(x, weight, bias)
    inputs = dict(x=x, weight=weight, bias=bias)
    impl = backends.select("linear", backend, x.device, inputs)
    if key is None:
        return impl.run(**inputs)
    fast = None
    if impl.run is triton_backend.linear and not linear_ops.wants_autograd(x, weight, bias):
        fast = linear_ops.TritonLinearForward()
    plan = LinearPlan(impl, fast)
    PLANS.remember(key, plan)
    return plan(x, weight, bias)
