"""Naive attention over a KV cache: the plain-torch twin of `fusedattn.attention_with_kvcache`
(the cache's layouts and the in-place append: fusedattn.cache_layout).

One sequence at a time, through the naive `attention` with bottom-right positions: sequence
b's keys are cache positions cache_leftpad[b] .. L_b - 1 with L_b = cache_seqlens[b] + Tnew,
and query i of Tq sits at position L_b - Tq + i. It reads the lengths to the host: the
correctness oracle of the tests, not a fast path.
"""

from __future__ import annotations

import torch

from ..cache_layout import append_to_cache, cache_rows
from ..checks import check_kvcache_args, check_kvcache_values
from ..fp8 import dequantize_heads, is_fp8, output_dtype
from .attention import attention


def attention_with_kvcache(
    q, k_cache, v_cache, k=None, v=None, *, cache_seqlens, block_table=None, cache_leftpad=None,
    scale=None, is_causal=False, window_size=None, softcap=0.0, alibi_slopes=None, sinks=None,
    num_splits=0, return_lse=False, q_descale=None, k_descale=None, v_descale=None,
):  # fmt: skip
    """See `fusedattn.attention_with_kvcache`. num_splits is accepted and has no effect (one
    pass per sequence). Returns out (B, Tq, Hq, Dv) [, lse (B, Hq, Tq) fp32]."""
    window, seqlens = check_kvcache_args(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, scale,
        is_causal, window_size, softcap, alibi_slopes, sinks, num_splits, return_lse,
        q_descale, k_descale, v_descale,
    )  # fmt: skip
    Tnew = 0 if k is None else k.shape[1]
    descales = dict(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    check_kvcache_values(seqlens, cache_leftpad, block_table, k_cache, Tnew, descales=descales)
    if k is not None:
        append_to_cache(k_cache, v_cache, k, v, seqlens, block_table, k_descale, v_descale)
    return cached_attention(
        q, k_cache, v_cache, seqlens + Tnew, block_table, cache_leftpad, scale, window,
        softcap, alibi_slopes, sinks, return_lse, **descales,
    )  # fmt: skip


def cached_attention(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, scale, window,
                     softcap, alibi_slopes, sinks, return_lse, key_mask=None, q_descale=None,
                     k_descale=None, v_descale=None):  # fmt: skip
    """Attention of q over each sequence's keys [cache_leftpad[b], seqlens_k[b]) (the append
    done), one sequence at a time; key_mask (B, capacity) bool hides more positions. An fp8
    cache (and an fp8 q) is dequantized to float32 per sequence, the output in q's dtype
    (bfloat16 for an fp8 q)."""
    B, Tq, Hq, _ = q.shape
    dtype = output_dtype(q, None)
    fp8 = is_fp8(k_cache)
    if fp8:
        q = q.float() if q_descale is None else dequantize_heads(q.transpose(1, 2), q_descale)
        q = q if q_descale is None else q.transpose(1, 2)
    ends = seqlens_k.tolist()
    starts = [0] * B if cache_leftpad is None else cache_leftpad.tolist()
    outs, lses = [], []
    for b in range(B):
        start, end = starts[b], max(ends[b], starts[b])
        keys = cache_rows(k_cache, block_table, b, start, end).transpose(0, 1)[None]
        values = cache_rows(v_cache, block_table, b, start, end).transpose(0, 1)[None]
        if fp8:
            keys = dequantize_heads(keys, _sequence(k_descale, b))
            values = dequantize_heads(values, _sequence(v_descale, b))
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        hidden = None if key_mask is None else key_mask[b : b + 1, start:end]
        if hidden is not None:  # a hidden key never contributes, even a NaN in it
            keys = keys.masked_fill(~hidden[:, None, :, None], 0.0)
            values = values.masked_fill(~hidden[:, None, :, None], 0.0)
            hidden = hidden[:, None, None, :]
        res = attention(
            q[b : b + 1].transpose(1, 2), keys, values, hidden, scale=scale,
            enable_gqa=Hq != keys.shape[1], window_size=(window.left, window.right),
            softcap=softcap, alibi_slopes=slopes, sinks=sinks, causal_alignment="bottom_right",
            return_lse=True,
        )  # fmt: skip
        outs.append(res[0].transpose(1, 2).to(dtype))
        lses.append(res[1])
    Dv = v_cache.shape[-1]
    out = torch.cat(outs) if outs else q.new_zeros(0, Tq, Hq, Dv, dtype=dtype)
    if not return_lse:
        return out
    lse = torch.cat(lses) if lses else q.new_zeros(0, Hq, Tq, dtype=torch.float32)
    return out, lse


def _sequence(descale, b: int):
    """Sequence b's descale: its (1, Hkv) row, or the one value."""
    return descale if descale.numel() == 1 else descale[b : b + 1]
