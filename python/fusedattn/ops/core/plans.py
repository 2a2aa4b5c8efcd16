"""Plans: what an eager call's metadata decides, decided once per metadata (the validation of
the arguments, the backend's refusals and auto's choice, the kernels' launch arguments and
compiled kernels), and kept for every later call with the same key. FlashInfer splits plan
from run the same way, with the plan made explicitly; here the key is made from the call
itself: every tensor argument's shape, strides, dtype, device, requires_grad and 16-byte
alignment (what Triton specialises a pointer on), every Python argument, grad mode and the
process state the op reads (the current CUDA device, the environment switches, TF32). A call
with a new key takes the op's full path, which raises the errors of a bad call and makes the
plan. Tracing (torch.compile, jit.trace) never uses plans: `tracing()` says when. This module
holds the cache and the key's parts; each family's plans are its own (attention/plans.py,
decode/plans.py, rowwise/plans.py).
"""

from __future__ import annotations

import contextlib
import os

import torch

from ... import invariance
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
    override from the environment, batch invariance."""
    return (
        torch.is_grad_enabled(), torch._C._cuda_getDevice() if q.is_cuda else -1,
        os.environ.get("FUSEDATTN_BACKEND") if backend == "auto" else None, invariance._enabled,
    )  # fmt: skip


class Cache:
    """Plans of one op by key; None keys (a call plans do not cover) are never stored. A plan
    serves only while the backend implementation it was made with is still the registered one
    (backends._REGISTRY: a test's counting wrapper, or a re-registration, makes new plans)."""

    def __init__(self, op: str):
        self.op = op
        self.plans: dict = {}

    def get(self, key):
        if key is None or _BYPASSED:
            return None
        try:
            plan = self.plans.get(key)
        except (TypeError, RuntimeError):  # unhashable, or no plain ==: the full path names it
            return None
        if plan is not None and backends._REGISTRY[self.op].get(plan.impl.backend) is not plan.impl:
            return None
        return plan

    def remember(self, key, plan) -> None:
        if key is None or _BYPASSED:
            return
        if len(self.plans) >= MAX_PLANS:
            self.plans.clear()
        with contextlib.suppress(TypeError, RuntimeError):  # a key get() could not look up
            self.plans[key] = plan

    def clear(self) -> None:
        self.plans.clear()


def tracing() -> bool:
    """torch.compile or torch.jit.trace is recording: the public ops then skip their plans and
    the kernel backends call their custom ops, which both record (a jit.trace of the eager
    path records no kernel launch, and its replay returns the traced call's output for any
    input)."""
    return torch.compiler.is_compiling() or torch.jit.is_tracing()
