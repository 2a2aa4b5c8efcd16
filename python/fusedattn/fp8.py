"""FP8 inputs and caches, in plain torch: the formats, the descales and the conversions every
backend that does not convert in a kernel uses (reference, torch, the Hugging Face cache).

Semantics (flash-attention 3's): a stored fp8 element means `stored × descale`, the descale a
float32 tensor of shape (B, Hkv) (per sequence and KV head; a query head h reads its KV head
h // group's) or a single value (0-dim or (1,)). Writing (`quantize`) is `x / descale` rounded
to nearest-even in the fp8 type, saturating at its largest finite value (±448 for
float8_e4m3fn, ±57344 for float8_e5m2): a finite input never becomes inf or NaN; NaN stays
NaN. torch's own cast rounds to nearest-even but turns an e5m2 overflow into inf, hence the
clamp before it.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
FORWARD_DTYPE = torch.float8_e4m3fn  # fp8 q/k/v of the attention forward (tensor cores)
FP8_MAX = {dtype: torch.finfo(dtype).max for dtype in FP8_DTYPES}


def is_fp8(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in FP8_DTYPES


def per_head(descale: torch.Tensor, B: int, H: int) -> torch.Tensor:
    """A descale as (B, H) float32 for H heads: a single value expanded, a (B, Hkv) one with
    each KV head's value repeated for the H // Hkv query heads that read it."""
    if descale.numel() == 1:
        return descale.reshape(1, 1).float().expand(B, H)
    group = H // descale.shape[1]
    return descale.float().repeat_interleave(group, dim=1) if group > 1 else descale.float()


def dequantize_heads(x: torch.Tensor, descale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """x (B, H, T, D) fp8 as `dtype` values: stored × descale (per sequence and head)."""
    scale = per_head(descale, x.shape[0], x.shape[1]).to(x.device)
    return (x.to(torch.float32) * scale[:, :, None, None]).to(dtype)


def quantize(x: torch.Tensor, descale, dtype: torch.dtype) -> torch.Tensor:
    """x / descale in fp8 `dtype`, rounded to nearest-even, saturating (NaN stays NaN).
    `descale` broadcasts against x (the caller lays it out)."""
    limit = FP8_MAX[dtype]
    scaled = x.to(torch.float32) / descale
    return torch.where(scaled.isnan(), scaled, scaled.clamp(-limit, limit)).to(dtype)


def amax_descale(x: torch.Tensor, dims, dtype: torch.dtype) -> torch.Tensor:
    """The descale that maps x's largest finite magnitude over `dims` to the fp8 type's
    largest value (a tiny floor keeps an all-zero x from a zero descale; an inf or NaN, as a
    padding row of some models gives, does not poison its sequence's descale): how a cache
    calibrates from its first tokens."""
    magnitude = x.detach().abs().to(torch.float32)
    amax = torch.where(magnitude.isfinite(), magnitude, 0.0).amax(dim=dims)
    return (amax / FP8_MAX[dtype]).clamp(min=torch.finfo(torch.float32).tiny)


def dequantize_packed(x: torch.Tensor, descale: torch.Tensor, cu_seqlens: torch.Tensor,
                      dtype=torch.float32) -> torch.Tensor:  # fmt: skip
    """Packed x (total, H, D) fp8 as `dtype` values, row r of sequence b scaled by b's
    descale (per head)."""
    B, H = cu_seqlens.shape[0] - 1, x.shape[1]
    scale = per_head(descale, max(B, 1), H).to(x.device)
    rows = torch.arange(x.shape[0], device=x.device)
    seq = torch.searchsorted(cu_seqlens[1:].long(), rows, right=True).clamp(max=max(B - 1, 0))
    return (x.to(torch.float32) * scale[seq][:, :, None]).to(dtype)


def output_dtype(q: torch.Tensor, out_dtype) -> torch.dtype:
    """The output's dtype of an attention over fp8 inputs: out_dtype, else bfloat16 for an
    fp8 q (flash-attention 3's), else q's."""
    if out_dtype is not None:
        return out_dtype
    return torch.bfloat16 if is_fp8(q) else q.dtype
