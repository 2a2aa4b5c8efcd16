"""Naive MLA decoding: the plain-torch twin of `fusedattn.mla_attention_with_kvcache`, the
gathered float form. Keys are each cache row whole, values its first head_dim_v columns of
the same row, one KV head: `attention_with_kvcache` with K = the cache, V = a view of it."""

from __future__ import annotations

import torch

from ..cache_layout import append_to_cache
from ..checks import check_kvcache_values
from ..fp8 import dequantize_mla_ds, is_fp8, is_mla_ds, output_dtype, quantize_mla_ds
from ..masks import Window
from ..mla_checks import (
    check_index_values,
    check_mla_args,
    check_slot_values,
    check_sparse_indices,
)
from .attention import attention
from .decode import cached_attention


def append_latent(kv_cache, kv_c, k_pe, seqlens, block_table, kv_descale=None) -> None:
    """kv_c (B, Tnew, Dl) and k_pe (B, Tnew, Dr) written into kv_cache (rows, slots, 1, Dl + Dr)
    at positions seqlens[b] .. + Tnew - 1, in place (an fp8 cache: x / kv_descale, saturating):
    the latent into the first Dl columns, the rope part into the rest (two column views of one
    buffer, cache_layout.append_to_cache's writes)."""
    Dl = kv_c.shape[-1]
    rope = k_pe if k_pe is not None else kv_c[..., :0]
    if is_mla_ds(kv_cache):  # DeepSeek's 656-byte rows: quantized whole, written as bytes
        rows = quantize_mla_ds(torch.cat([kv_c, rope], dim=-1))[:, :, None]
        append_to_cache(kv_cache, kv_cache[..., :0], rows, rows[..., :0], seqlens, block_table)
        return
    append_to_cache(kv_cache[..., :Dl], kv_cache[..., Dl:], kv_c[:, :, None], rope[:, :, None],
                    seqlens, block_table, kv_descale, kv_descale)  # fmt: skip


def mla_attention_with_kvcache(
    q, kv_cache, kv_c=None, k_pe=None, *, cache_seqlens, block_table=None, head_dim_v=512,
    scale=None, is_causal=False, sinks=None, num_splits=0, return_lse=False, kv_descale=None,
    indices=None, topk_length=None,
):  # fmt: skip
    """See `fusedattn.mla_attention_with_kvcache`: one sequence at a time through the naive
    attention (its lengths read to the host); with indices, each query over its listed keys.
    Returns out (B, Tq, Hq, head_dim_v) [, lse (B, Hq, Tq) fp32]."""
    call = check_mla_args(q, kv_cache, kv_c, k_pe, cache_seqlens, block_table, head_dim_v,
                          scale, is_causal, sinks, num_splits, return_lse, kv_descale)  # fmt: skip
    check_sparse_indices(indices, topk_length, call, block_table is not None, is_causal)
    check_kvcache_values(call.seqlens, None, block_table, call.kv_cache, call.Tnew,
                         descales=dict(kv_descale=kv_descale))  # fmt: skip
    seqlens_k = call.seqlens + call.Tnew
    slots = None
    if indices is not None:
        check_index_values(indices, topk_length)
        slots = sparse_slots(indices, topk_length)
        check_slot_values(slots, seqlens_k, block_table, call.kv_cache)
    if call.Tnew:
        append_latent(call.kv_cache, kv_c, k_pe, call.seqlens, block_table, kv_descale)
    if slots is not None:
        q_full = call.q if call.q_pe is None else torch.cat([call.q, call.q_pe], dim=-1)
        return sparse_attention(q_full, call.kv_cache, slots, seqlens_k, block_table is not None,
                                call.Dv, scale, is_causal, sinks, return_lse, kv_descale)  # fmt: skip
    return gathered_attention(call, block_table, scale, is_causal, sinks, return_lse,
                              kv_descale, seqlens_k)  # fmt: skip


def gathered_attention(call, block_table, scale, is_causal, sinks, return_lse, kv_descale,
                       seqlens_k):  # fmt: skip
    """The attention of a checked call over each sequence's keys [0, seqlens_k[b])."""
    q = call.q if call.q_pe is None else torch.cat([call.q, call.q_pe], dim=-1)
    kv = call.kv_cache
    if is_mla_ds(kv):  # the 656-byte rows as the values they hold (float32), out in q's dtype
        kv, out_dtype = dequantize_mla_ds(kv), q.dtype
        result = cached_attention(
            q.float(), kv, kv[..., : call.Dv], seqlens_k, block_table, None, scale,
            Window(-1, 0, True) if is_causal else Window(), 0.0, None, sinks, return_lse,
        )  # fmt: skip
        out, lse = result if return_lse else (result, None)
        return (out.to(out_dtype), lse) if return_lse else out.to(out_dtype)
    window = Window(-1, 0, True) if is_causal else Window()
    return cached_attention(
        q, kv, kv[..., : call.Dv], seqlens_k, block_table, None, scale, window, 0.0, None,
        sinks, return_lse, k_descale=kv_descale, v_descale=kv_descale,
    )  # fmt: skip


def sparse_slots(indices: torch.Tensor, topk_length: torch.Tensor | None) -> torch.Tensor:
    """The keys a sparse call attends to, as the kernels read them: indices (B, Tq, topk) with
    every entry past topk_length[b] and every repeat of an index set to -1 (a duplicate counts
    once), sorted per row (no host sync; one sort of the indices)."""
    if topk_length is not None:
        topk = indices.shape[-1]
        listed = torch.arange(topk, device=indices.device) < topk_length.view(-1, 1, 1)
        indices = torch.where(listed, indices, -1)
    slots = indices.sort(dim=-1).values
    repeat = slots[..., 1:] == slots[..., :-1]
    return torch.cat([slots[..., :1], torch.where(repeat, -1, slots[..., 1:])], dim=-1)


def sparse_attention(q, kv_cache, slots, seqlens_k, paged, Dv, scale, is_causal, sinks,
                     return_lse, kv_descale=None):  # fmt: skip
    """DeepSeek sparse attention, naively: query i of sequence b attends to the cache rows
    slots[b, i] lists (>= 0; a paged cache's slot page x page_size + offset, a contiguous
    cache's position in row b), through the naive attention with every other key of the
    gathered set masked (and past the query's position with is_causal: bottom-right, query i
    at L_b - Tq + i). q (B, Tq, Hq, D) whole; kv_cache (rows, slots, 1, D)."""
    B, Tq, Hq, D = q.shape
    dtype = output_dtype(q, None)
    if is_mla_ds(kv_cache):  # the 656-byte rows as the values they hold
        kv_cache = dequantize_mla_ds(kv_cache)
        D = kv_cache.shape[-1]
    rows = kv_cache[:, :, 0]
    flat = rows.reshape(-1, D) if paged else None
    capacity = flat.shape[0] if paged else rows.shape[1]
    outs, lses = [], []
    for b in range(B):
        listed = (slots[b] >= 0) & (slots[b] < (capacity if paged else int(seqlens_k[b])))
        at = torch.where(listed, slots[b], 0).long()  # (Tq, topk)
        keys = flat[at] if paged else rows[b][at]  # (Tq, topk, D)
        keys = keys.float() * kv_descale.float() if is_fp8(kv_cache) else keys
        keys = keys.masked_fill(~listed[..., None], 0.0)  # an unlisted slot never contributes
        if is_causal:
            position = int(seqlens_k[b]) - Tq + torch.arange(Tq, device=slots.device)[:, None]
            listed = listed & (slots[b] <= position)
        qb = q[b].to(keys.dtype).transpose(0, 1)[None]  # (1, Hq, Tq, D)
        out = torch.empty(Tq, Hq, Dv, dtype=keys.dtype, device=q.device)
        lse = torch.empty(Hq, Tq, dtype=torch.float32, device=q.device)
        for i in range(Tq):  # each query its own keys
            o, s = attention(qb[:, :, i : i + 1], keys[i][None, None], keys[i][None, None, :, :Dv],
                             listed[i][None, None, None, :], scale=scale, enable_gqa=True,
                             sinks=sinks, return_lse=True)  # fmt: skip
            out[i], lse[:, i] = o[0, :, 0], s[0, :, 0]
        outs.append(out.to(dtype))
        lses.append(lse)
    out = torch.stack(outs) if outs else q.new_zeros(0, Tq, Hq, Dv, dtype=dtype)
    lse = torch.stack(lses) if lses else torch.zeros(0, Hq, Tq, device=q.device)
    return (out, lse) if return_lse else out
