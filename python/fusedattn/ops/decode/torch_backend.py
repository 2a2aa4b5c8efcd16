"""The torch backend of `fusedattn.attention_with_kvcache`: one SDPA call over the cache
gathered to (B, Hkv, capacity, D), each sequence's keys and positions in the mask
(shared/cache_sdpa.py)."""

from __future__ import annotations

import torch

from ...fp8 import is_fp8
from ..shared import sdpa
from ..shared.cache_sdpa import cache_attention as attention  # noqa: F401 (the backend's run)


def refusals(*, q, k_cache=None, **inputs) -> list[str]:
    """What SDPA cannot express, as for every attention op; over an fp8 cache the call runs
    in float32 (dequantized), so q's dtype rounds nothing."""
    if k_cache is not None and is_fp8(k_cache):
        q = q.new_empty((0,), dtype=torch.float32)
    return sdpa.refusals(q=q, **inputs)
