"""Plans: what an eager call's metadata decides, decided once per metadata (the validation of
the arguments, the backend's refusals and auto's choice, the kernels' launch arguments and
compiled kernels), and kept for every later call with the same key. FlashInfer splits plan
from run the same way, with the plan made explicitly; here the key is made from the call
itself: every tensor argument's shape, strides, dtype, device, requires_grad and 16-byte
alignment (what Triton specialises a pointer on), every Python argument, grad mode and the
process state the op reads (the current CUDA device, the environment switches, TF32). A call
with a new key takes the op's full path, which raises the errors of a bad call and makes the
plan. Tracing (torch.compile, jit.trace) never uses plans. Per op: decode_plan.py
(attention_with_kvcache) and AttentionPlan (ops/attention.py).
"""

from __future__ import annotations

import contextlib
import os

import torch

from . import backends

MAX_PLANS = 512  # distinct call metadata kept per op before its cache starts over
_BYPASSED = 0  # > 0 inside bypassed(): every call takes its op's full path


@contextlib.contextmanager
def bypassed():
    """Every call inside the block takes its op's full path (validation, backends.select,
    auto's choice) and no plan is used or made: for instrumentation that wraps
    backends.select to see every call (scripts/profile_model.py), where a plan would
    otherwise serve all but the first call of each key."""
    global _BYPASSED
    _BYPASSED += 1
    try:
        yield
    finally:
        _BYPASSED -= 1


def meta(t: torch.Tensor | None):
    """What a plan keys a tensor argument on."""
    if t is None:
        return None
    return (t.shape, t.stride(), t.dtype, t.device, t.requires_grad, t.data_ptr() % 16 == 0)


def process_state(q: torch.Tensor, backend: str) -> tuple:
    """The process state a call's decisions read: grad mode, the current CUDA device, auto's
    override from the environment."""
    return (
        torch.is_grad_enabled(), torch._C._cuda_getDevice() if q.is_cuda else -1,
        os.environ.get("FUSEDATTN_BACKEND") if backend == "auto" else None,
    )  # fmt: skip


class Cache:
    """Plans of one op by key; None keys (a call plans do not cover) are never stored. A plan
    serves only while the backend implementation it was made with is still the registered one
    (backends._REGISTRY: a test's counting wrapper, or a re-registration, makes new plans)."""

    def __init__(self, op: str):
        self.op = op
        self.plans: dict = {}

    def get(self, key):
        plan = None if key is None or _BYPASSED else self.plans.get(key)
        if plan is not None and backends._REGISTRY[self.op].get(plan.impl.backend) is not plan.impl:
            return None
        return plan

    def remember(self, key, plan) -> None:
        if key is None or _BYPASSED:
            return
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        self.plans[key] = plan

    def clear(self) -> None:
        self.plans.clear()


def rowwise_key(x, tensors: tuple, args: tuple, backend: str, op: str):
    """layer_norm / rms_norm / softmax's plan key (x and the other tensor arguments, the
    Python arguments), or None for a call plans do not cover (autocast, an argument of a kind
    they do not key)."""
    try:
        if torch.is_autocast_enabled(x.device.type):
            return None
        return (op, meta(x), *map(meta, tensors), *args, backend, *process_state(x, backend))
    except (AttributeError, TypeError, RuntimeError):
        return None


class RowwisePlan:
    """A row-wise op's decisions for one key: the backend with its keyword arguments, and for a
    kernel backend with no gradient wanted a forward bound to its compiled kernel (`fast`:
    norm_kernels.TritonNormForward, rowwise.TritonSoftmaxForward; only where the registered
    implementation is the module's own, so a wrapped one is still what runs). Calls take the
    tensors by keyword."""

    def __init__(self, impl, fixed: dict, fast=None):
        self.impl, self.run, self.fixed, self.fast = impl, impl.run, fixed, fast

    def __call__(self, **tensors):
        if self.fast is not None:
            return self.fast(**tensors)
        return self.run(**tensors, **self.fixed)


LAYER_NORM, RMS_NORM, SOFTMAX = Cache("layer_norm"), Cache("rms_norm"), Cache("softmax")
