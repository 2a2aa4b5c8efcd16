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


# DeepSeek's fp8 MLA cache row (FlashMLA's and vLLM's `fp8_ds_mla`): per token 512 e4m3 latent
# values, 4 float32 scales (one per 128 values), 64 bfloat16 rope values: 656 bytes.
MLA_DS_LATENT, MLA_DS_ROPE, MLA_DS_GROUP = 512, 64, 128
MLA_DS_SCALES = MLA_DS_LATENT // MLA_DS_GROUP
MLA_DS_BYTES = MLA_DS_LATENT + 4 * MLA_DS_SCALES + 2 * MLA_DS_ROPE  # 656


def is_mla_ds(t) -> bool:
    """Whether t holds DeepSeek 656-byte MLA rows (uint8, the last dimension 656)."""
    return isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.shape[-1] == MLA_DS_BYTES


def quantize_mla_ds(x: torch.Tensor) -> torch.Tensor:
    """x (..., 576) (512 latent then 64 rope columns) as 656-byte rows (..., 656) uint8: each
    group of 128 latent values divided by its scale, amax / 448 rounded up to a power of two
    (an all-zero group: scale 1), in float8_e4m3fn (nearest-even, saturating); the 4 scales
    as float32; the rope columns as bfloat16."""
    if x.shape[-1] != MLA_DS_LATENT + MLA_DS_ROPE:
        raise ValueError(f"quantize_mla_ds takes rows of {MLA_DS_LATENT} latent + {MLA_DS_ROPE} "
                         f"rope values, got {x.shape[-1]}")  # fmt: skip
    lead = x.shape[:-1]
    latent = x[..., :MLA_DS_LATENT].float().reshape(*lead, MLA_DS_SCALES, MLA_DS_GROUP)
    amax = latent.abs().amax(dim=-1)
    limit = FP8_MAX[torch.float8_e4m3fn]
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / limit))), 1.0)
    values = quantize(latent, scale[..., None], torch.float8_e4m3fn).reshape(*lead, MLA_DS_LATENT)
    rope = x[..., MLA_DS_LATENT:].to(torch.bfloat16)
    return torch.cat([values.view(torch.uint8), scale.contiguous().view(torch.uint8),
                      rope.contiguous().view(torch.uint8)], dim=-1)  # fmt: skip


def dequantize_mla_ds(rows: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """656-byte rows (..., 656) uint8 as (..., 576) `dtype` values: latent = e4m3 x its
    group's scale, rope the stored bfloat16."""
    if not is_mla_ds(rows):
        raise ValueError(f"dequantize_mla_ds takes uint8 rows of {MLA_DS_BYTES} bytes, got "
                         f"{rows.dtype} {tuple(rows.shape)}")  # fmt: skip
    lead = rows.shape[:-1]
    rows = rows.contiguous()
    values = rows[..., :MLA_DS_LATENT].view(torch.float8_e4m3fn).float()
    scale = rows[..., MLA_DS_LATENT : MLA_DS_LATENT + 4 * MLA_DS_SCALES].view(torch.float32)
    latent = values.reshape(*lead, MLA_DS_SCALES, MLA_DS_GROUP) * scale[..., None]
    rope = rows[..., MLA_DS_LATENT + 4 * MLA_DS_SCALES :].view(torch.bfloat16).float()
    return torch.cat([latent.reshape(*lead, MLA_DS_LATENT), rope], dim=-1).to(dtype)
