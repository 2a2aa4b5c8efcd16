"""Naive MLA decoding: the plain-torch twin of `fusedattn.mla_attention_with_kvcache`, the
gathered float form. Keys are each cache row whole, values its first head_dim_v columns of
the same row, one KV head: `attention_with_kvcache` with K = the cache, V = a view of it."""

from __future__ import annotations

import torch

from ..cache_layout import append_to_cache
from ..checks import check_kvcache_values
from ..masks import Window
from ..mla_checks import check_mla_args
from .decode import cached_attention


def append_latent(kv_cache, kv_c, k_pe, seqlens, block_table, kv_descale=None) -> None:
    """kv_c (B, Tnew, Dl) and k_pe (B, Tnew, Dr) written into kv_cache (rows, slots, 1, Dl + Dr)
    at positions seqlens[b] .. + Tnew - 1, in place (an fp8 cache: x / kv_descale, saturating):
    the latent into the first Dl columns, the rope part into the rest (two column views of one
    buffer, cache_layout.append_to_cache's writes)."""
    Dl = kv_c.shape[-1]
    rope = k_pe if k_pe is not None else kv_c[..., :0]
    append_to_cache(kv_cache[..., :Dl], kv_cache[..., Dl:], kv_c[:, :, None], rope[:, :, None],
                    seqlens, block_table, kv_descale, kv_descale)  # fmt: skip


def mla_attention_with_kvcache(
    q, kv_cache, kv_c=None, k_pe=None, *, cache_seqlens, block_table=None, head_dim_v=512,
    scale=None, is_causal=False, sinks=None, num_splits=0, return_lse=False, kv_descale=None,
):  # fmt: skip
    """See `fusedattn.mla_attention_with_kvcache`: one sequence at a time through the naive
    attention (its lengths read to the host). Returns out (B, Tq, Hq, head_dim_v) [, lse
    (B, Hq, Tq) fp32]."""
    call = check_mla_args(q, kv_cache, kv_c, k_pe, cache_seqlens, block_table, head_dim_v,
                          scale, is_causal, sinks, num_splits, return_lse, kv_descale)  # fmt: skip
    check_kvcache_values(call.seqlens, None, block_table, call.kv_cache, call.Tnew,
                         descales=dict(kv_descale=kv_descale))  # fmt: skip
    if call.Tnew:
        append_latent(call.kv_cache, kv_c, k_pe, call.seqlens, block_table, kv_descale)
    return gathered_attention(call, block_table, scale, is_causal, sinks, return_lse,
                              kv_descale, call.seqlens + call.Tnew)  # fmt: skip


def gathered_attention(call, block_table, scale, is_causal, sinks, return_lse, kv_descale,
                       seqlens_k):  # fmt: skip
    """The attention of a checked call over each sequence's keys [0, seqlens_k[b])."""
    q = call.q if call.q_pe is None else torch.cat([call.q, call.q_pe], dim=-1)
    kv = call.kv_cache
    window = Window(-1, 0, True) if is_causal else Window()
    return cached_attention(
        q, kv, kv[..., : call.Dv], seqlens_k, block_table, None, scale, window, 0.0, None,
        sinks, return_lse, k_descale=kv_descale, v_descale=kv_descale,
    )  # fmt: skip
