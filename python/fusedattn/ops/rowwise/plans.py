"""Plans of the row-wise ops' eager calls (core/plans.py says what a plan is): per op a cache
of RowwisePlan by key, the key made of x, the other tensor arguments and the Python ones."""

from __future__ import annotations

import torch

from ..core.plans import Cache, meta, process_state

LAYER_NORM, RMS_NORM, SOFTMAX = Cache("layer_norm"), Cache("rms_norm"), Cache("softmax")


def shape_key(normalized_shape):
    """normalized_shape as a plan key part: an int, or a tuple of the ints a sequence holds; a
    value of another kind (a float, None, a sequence of floats, which compare equal to ints)
    gives None, and the call then takes the full path, whose validation names it."""
    kind = type(normalized_shape)
    if kind is int:
        return normalized_shape
    if kind is tuple and len(normalized_shape) == 1:  # the common case, checked cheaply
        return normalized_shape if type(normalized_shape[0]) is int else None
    if isinstance(normalized_shape, tuple | list | torch.Size) and all(
        type(s) is int for s in normalized_shape
    ):
        return tuple(normalized_shape)
    return None


def key(x, tensors: tuple, args: tuple, backend: str, op: str):
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
    norm_ops.TritonNormForward, softmax_ops.TritonSoftmaxForward; only where the registered
    implementation is the Triton backend's own, so a wrapped one is still what runs). Calls
    take the tensors by keyword."""

    def __init__(self, impl, fixed: dict, fast=None):
        self.impl, self.run, self.fixed, self.fast = impl, impl.run, fixed, fast

    def __call__(self, **tensors):
        if self.fast is not None:
            return self.fast(**tensors)
        return self.run(**tensors, **self.fixed)
