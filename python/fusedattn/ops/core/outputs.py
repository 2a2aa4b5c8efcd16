"""The output buffers every launcher allocates, poisoned under test.

FUSEDATTN_POISON_OUTPUTS=1 (the test suite sets it before any import) fills them with NaN, so
an element a kernel forgets to write fails every comparison instead of passing as stale memory
that happens to hold the right value.
"""

from __future__ import annotations

import functools
import os

import torch

POISON_ENV = "FUSEDATTN_POISON_OUTPUTS"


@functools.cache
def poisoned() -> bool:
    """FUSEDATTN_POISON_OUTPUTS=1, read once."""
    return os.environ.get(POISON_ENV) == "1"


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty, or NaN-filled when FUSEDATTN_POISON_OUTPUTS=1."""
    if poisoned():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_output_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like (same strides), poisoned like new_output."""
    out = torch.empty_like(t)
    return out.fill_(float("nan")) if poisoned() else out
