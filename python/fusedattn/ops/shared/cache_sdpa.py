"""SDPA over a KV cache, for the torch backends of the cache-reading families (KV-cache decoding,
MLA decoding): the cache gathered to (B, Hkv, capacity, D), each sequence's keys and positions
in one mask (SDPA has no per-sequence length or paged form, so the cache is read and written
at least twice: the Triton kernels read it once)."""

from __future__ import annotations

import torch

from ...cache_layout import dense_cache
from ...fp8 import dequantize_heads, is_fp8, output_dtype
from ...masks import NO_WINDOW
from . import sdpa


def visible_cache_keys(seqlens_k, cache_leftpad, key_mask, Tq: int, capacity: int, window):
    """((B, 1, Tq, capacity) bool: query i of sequence b may see cache position j, (B, Tq, 1)
    its position L_b - Tq + i), on the device (no sync)."""
    j = torch.arange(capacity, device=seqlens_k.device)
    end = seqlens_k.long()[:, None, None]  # (B, 1, 1)
    start = 0 if cache_leftpad is None else cache_leftpad.long()[:, None, None]
    pos = end - Tq + torch.arange(Tq, device=seqlens_k.device)[None, :, None]  # (B, Tq, 1)
    keep = (j >= start) & (j < end)
    if key_mask is not None:
        keep = keep & key_mask[:, None, :capacity]
    if window.right >= 0:
        keep = keep & (j <= pos + window.right)
    if window.left >= 0:
        keep = keep & (j >= pos - window.left)
    return keep[:, None], pos


def cache_attention(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, scale,
              window, softcap, alibi_slopes, sinks, num_splits, return_lse, q_descale=None,
              k_descale=None, v_descale=None):  # fmt: skip
    """SDPA over the whole cache capacity with one (B, 1 or Hq, Tq, capacity) mask: the positions
    of each sequence differ, so they go in the mask (ALiBi as a float bias, in float64 for
    float64 inputs: the fp32 slopes' products rounded to fp32 would cost float64 its accuracy).
    An fp8 cache (and q) is dequantized to float32 first, the output in q's dtype (bfloat16
    for an fp8 q): correct, not fast."""
    B, Tq = q.shape[:2]
    keys, values = dense_cache(k_cache, block_table, B), dense_cache(v_cache, block_table, B)
    if is_fp8(k_cache):
        dtype = output_dtype(q, None)
        keys, values = dequantize_heads(keys, k_descale), dequantize_heads(values, v_descale)
        q = q.float() if q_descale is None else dequantize_heads(q.transpose(1, 2), q_descale)
        q = q if q_descale is None else q.transpose(1, 2)
        return cache_attention(q, keys.transpose(1, 2), values.transpose(1, 2), seqlens_k, None,
                         cache_leftpad, key_mask, scale, window, softcap, alibi_slopes, sinks,
                         num_splits, return_lse).to(dtype)  # fmt: skip
    keep, pos = visible_cache_keys(seqlens_k, cache_leftpad, key_mask, Tq, keys.shape[2], window)
    # Slots no query sees (unused, left padding, pages past the end) may hold anything, NaN
    # included (an empty cache): zeroed here, as the cache is read, so that a masked slot adds
    # exactly 0 (SDPA masks by adding -inf, and NaN + -inf is NaN).
    unseen = ~keep.any(dim=2)[:, 0][:, None, :, None]  # (B, 1, capacity, 1)
    keys, values = keys.masked_fill(unseen, 0.0), values.masked_fill(unseen, 0.0)
    mask = keep
    if alibi_slopes is not None:
        compute = torch.float64 if q.dtype == torch.float64 else alibi_slopes.dtype
        slopes = alibi_slopes.to(compute)
        slopes = slopes.reshape(-1 if slopes.dim() == 2 else 1, q.shape[2], 1, 1)
        j = torch.arange(keys.shape[2], device=q.device)
        bias = -slopes * (pos[:, None] - j).abs().to(compute)  # (B or 1, Hq, Tq, cap)
        mask = bias.masked_fill(~keep, float("-inf"))
    out = sdpa.attention(
        q.transpose(1, 2), keys, values, mask, 0.0, scale, q.shape[2] != keys.shape[1], None,
        NO_WINDOW, 0.0, None, sinks, False,
    )  # fmt: skip
    return out.transpose(1, 2)
