"""What the CUDA C++ attention (fusedattn._C: csrc/attention/) is handed: the layouts its 16-byte
loads need, the masks as it reads them, and the backward kernel it runs."""

from __future__ import annotations

import os

import torch

# Which backward the CUDA attention runs (the extension's BackwardKernel): "split" is dQ by query
# block and dK/dV by key block; "fused" one pass per key block with per-split fp32 dQ partials,
# where it applies (no attn_mask or dropout, padded head dim 64 or 128, the shared memory, and
# enough (batch, kv head) pairs to fill the GPU with at most 4 splits), else "split". Both are
# deterministic. "auto" is the launch policy's choice (attention_launch.cuh:
# fused_backward_by_default, from the H100 timings). Read at every backward, so benchmarks and
# tests can switch it.
CUDA_BACKWARD_ENV = "FUSEDATTN_CUDA_BACKWARD"
CUDA_BACKWARD_KERNELS = {"auto": 0, "split": 1, "fused": 2}


def cuda_backward_kernel() -> int:
    """The extension's BackwardKernel for FUSEDATTN_CUDA_BACKWARD (unset: auto)."""
    name = os.environ.get(CUDA_BACKWARD_ENV, "").strip() or "auto"
    if name not in CUDA_BACKWARD_KERNELS:
        raise ValueError(
            f"{CUDA_BACKWARD_ENV}={name!r}: expected one of {', '.join(CUDA_BACKWARD_KERNELS)}"
        )
    return CUDA_BACKWARD_KERNELS[name]


def aligned(t: torch.Tensor) -> bool:
    """The CUDA kernels copy 16 bytes at a time: unit last stride, 16-byte aligned base and
    row/head/batch strides (dims of size 1 are never stepped over)."""
    if t.numel() == 0:
        return True
    strides_ok = all(
        s % 8 == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1], strict=True) if n > 1
    )
    return t.stride(-1) == 1 and strides_ok and t.data_ptr() % 16 == 0


def masks(q, k, attn_mask, key_padding_mask):
    """(attn_mask, key_padding_mask) as the CUDA kernels read them: the mask as a bool or fp32
    (B, H, Tq, Tk) broadcast view (a float mask is converted at its own, unexpanded size), the
    padding mask contiguous."""
    B, H, Tq, _ = q.shape
    mask = attn_mask
    if mask is not None:
        if mask.dtype != torch.bool:
            mask = mask.float()
        mask = mask.expand(B, H, Tq, k.shape[2])
    kpm = None if key_padding_mask is None else key_padding_mask.contiguous()
    return mask, kpm
