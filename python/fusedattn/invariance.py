"""Batch invariance: while it is on, a sequence's attention gives the same bits whatever else is
in its batch, however its prompt was chunked, and whatever the cache's layout.

    fusedattn.batch_invariant(True)            # on for the process (False: off)
    with fusedattn.batch_invariant():          # on inside the block, the previous state after
        ...
    FUSEDATTN_BATCH_INVARIANT=1                # on from import

What changes while it is on (docs/batch_invariance.md):
- The Triton decode kernel (attention_with_kvcache, and varlen_attention's prefill, packed or
  paged, which runs it too) splits each sequence's keys at fixed positions: SPLIT_KEYS keys a
  split, counted from the sequence's first key, its tiles counted from there as well; every
  split's partial goes through the combine, whose sum over the splits runs in one order. A
  caller's num_splits is refused. One tile size (BLOCK_M 16 query rows) for every call.
- attention() runs on the Triton kernels, one program per (batch row, head, query block): a
  batch row's result does not depend on the others.
- LayerNorm, RMSNorm and softmax run on the Triton kernels, one program per row, the tiles
  chosen from the row length only.
- `auto` picks Triton; the torch and CUDA backends are refused (SDPA's and cuBLAS-backed
  paths choose their reductions by shape), so is a Triton call that could not hold the property.
  The reference backend is exempt (float64 ground truth, not a serving path).
"""

from __future__ import annotations

import os

ENV_VAR = "FUSEDATTN_BATCH_INVARIANT"
SPLIT_KEYS_ENV = "FUSEDATTN_SPLIT_KEYS"

# Keys per split: fixed for the process, never derived from the batch. On a GPU 1024 (a 32k
# cache: 32 splits, 256 programs with 8 kv heads at batch 1, about two per SM of an H200);
# in the CPU interpreter 64 (4 of its 16-key tiles), so tests cross splits at small sizes.
SPLIT_KEYS_GPU = 1024
SPLIT_KEYS_CPU = 64

_enabled = os.environ.get(ENV_VAR, "") == "1"


def enabled() -> bool:
    """Whether batch invariance is on."""
    return _enabled


def split_keys(on_gpu: bool) -> int:
    """Keys per split under the switch ($FUSEDATTN_SPLIT_KEYS if set, a multiple of 64)."""
    value = os.environ.get(SPLIT_KEYS_ENV)
    if value:
        keys = int(value)
        if keys <= 0 or keys % 64:
            raise ValueError(f"{SPLIT_KEYS_ENV} must be a positive multiple of 64, got {value}")
        return keys
    return SPLIT_KEYS_GPU if on_gpu else SPLIT_KEYS_CPU


class batch_invariant:
    """fusedattn.batch_invariant(True) turns batch invariance on for the process
    (batch_invariant(False) off); `with fusedattn.batch_invariant():` turns it on for the
    block and restores the previous state after."""

    def __init__(self, enable: bool = True):
        global _enabled
        self.previous = _enabled
        _enabled = bool(enable)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        global _enabled
        _enabled = self.previous
        return False

    def __repr__(self) -> str:
        return f"fusedattn.batch_invariant({_enabled})"


REFUSAL = "batch_invariant is on: {what} is not batch invariant (the Triton kernels are)"


def refusal(what: str) -> list[str]:
    """A backend's refusal under the switch ([] when it is off)."""
    return [REFUSAL.format(what=what)] if _enabled else []
