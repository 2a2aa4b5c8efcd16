"""What fusedattn's two vLLM backends share (vllm.py: the dense layers; vllm_mla.py: the MLA
layers): the environment switches, the backend they choose, vLLM's fp8 cache dtype names."""

from __future__ import annotations

import os

import torch

SELECT_ENV = "FUSEDATTN_VLLM"
BACKEND_ENV = "FUSEDATTN_VLLM_BACKEND"
INVARIANT_ENV = "VLLM_BATCH_INVARIANT"
BACKENDS = ("auto", "triton", "torch", "reference", "cuda")
# vLLM's cache dtype names and the fp8 types fusedattn reads them as.
FP8_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def chosen_backend() -> str:
    """fusedattn's backend for the served calls (FUSEDATTN_VLLM_BACKEND, default auto)."""
    name = os.environ.get(BACKEND_ENV, "auto") or "auto"
    if name not in BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={name!r}: expected one of {', '.join(BACKENDS)}")
    return name


def invariance_requested() -> bool:
    """VLLM_BATCH_INVARIANT=1 (vLLM's batch-invariant mode)."""
    return os.environ.get(INVARIANT_ENV, "0") not in ("", "0")
