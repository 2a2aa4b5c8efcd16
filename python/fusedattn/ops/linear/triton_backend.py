"""The triton backend of linear: triton_kernels/matmul.py's batch-invariant matmul, launched
by linear_ops.py (custom ops and autograd)."""

from __future__ import annotations

from ..core.kernels import dtype_refusals
from . import linear_ops

BACKEND = "triton"


def linear(x, weight, bias):
    return linear_ops.linear(x, weight, bias)


def linear_refusals(*, x, weight, bias, **_inputs) -> list[str]:
    return dtype_refusals(x, weight, bias, backend=BACKEND)
