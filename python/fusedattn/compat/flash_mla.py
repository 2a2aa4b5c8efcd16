"""FlashMLA's Python API (deepseek-ai/FlashMLA, `flash_mla`), running fusedattn's MLA decode
(`fusedattn.mla_attention_with_kvcache`) on any GPU Triton supports, so code written for
FlashMLA runs unmodified:

    from fusedattn.compat.flash_mla import get_mla_metadata, flash_mla_with_kvcache
    sched_meta, _ = get_mla_metadata()          # or the older (cache_seqlens, s_q * h_q // h_kv, h_kv)
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, sched_meta,
                                      causal=True)

FlashMLA's names, shapes and return values, and its conventions where they differ from
fusedattn's: the lse of a row that sees no key is +inf (fusedattn's: -inf); the scale
defaults to 1/sqrt(head_dim); a scheduling object is reused only for calls of the same shapes
and options (asserted, as FlashMLA asserts). Where FlashMLA takes page size 64 only, Hopper or
Blackwell only and 64 or 128 heads only, this takes any page size, any GPU Triton runs on and
any head count. Sparse decode (`indices`, `topk_length`, `attn_sink`: DeepSeek-V3.2) runs
over a bf16/fp16 cache and over FlashMLA's 656-byte fp8 layout (`is_fp8_kvcache`). Not yet here:
the extra cache (refused by name). `flash_mla_sparse_fwd` (the sparse prefill) runs
`fusedattn.mla_sparse_attention`.
"""

from __future__ import annotations

import dataclasses

import torch

from ..fp8 import MLA_DS_BYTES
from ..ops import mla_attention_with_kvcache, mla_sparse_attention

__all__ = ["FlashMLASchedMeta", "flash_mla_sparse_fwd", "flash_mla_with_kvcache",
           "get_mla_metadata"]  # fmt: skip

MAX_LOGIT_CHUNK = 1 << 26  # gathered key elements per chunk of max_logits' queries


@dataclasses.dataclass
class FlashMLASchedMeta:
    """FlashMLA's scheduling metadata: filled at the first call that uses it (fusedattn keeps
    the call's shapes and options there, to check that a reuse matches, as FlashMLA does)."""

    have_initialized: bool = False
    config: tuple | None = None
    tile_scheduler_metadata: torch.Tensor | None = None
    num_splits: torch.Tensor | None = None


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    """An empty FlashMLASchedMeta and None, as FlashMLA's current interface returns; the older
    arguments (cache_seqlens, num_heads_per_head_k, num_heads_k) are accepted and unused."""
    return FlashMLASchedMeta(), None


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None,
    head_dim_v: int,
    tile_scheduler_metadata: FlashMLASchedMeta,
    num_splits=None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    extra_k_cache: torch.Tensor | None = None,
    extra_indices_in_kvcache: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    extra_topk_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA's dense decode: q (batch_size, seq_len_q, num_heads_q, head_dim), k_cache
    (num_blocks, page_block_size, num_heads_k = 1, head_dim), block_table (batch_size,
    max_num_blocks_per_seq) int32, cache_seqlens (batch_size,) int32. Returns out (batch_size,
    seq_len_q, num_heads_q, head_dim_v) and softmax_lse (batch_size, num_heads_q, seq_len_q)
    float32. num_splits: None, or the tensor older callers got from get_mla_metadata (unused:
    the split is picked per call)."""
    extra = {"extra_k_cache": extra_k_cache, "extra_indices_in_kvcache": extra_indices_in_kvcache,
             "extra_topk_length": extra_topk_length}  # fmt: skip
    given = [name for name, value in extra.items() if value is not None]
    if given:
        raise ValueError(f"fusedattn.compat.flash_mla: a second (extra) cache ({', '.join(given)}) "
                         "is not implemented yet; one cache with indices is")  # fmt: skip
    if indices is not None:
        return _sparse_decode(q, k_cache, head_dim_v, tile_scheduler_metadata, softmax_scale,
                              causal, is_fp8_kvcache, indices, attn_sink, topk_length)  # fmt: skip
    if topk_length is not None:
        raise ValueError("flash_mla_with_kvcache: topk_length belongs to sparse attention "
                         "(with indices)")  # fmt: skip
    if attn_sink is not None:  # FlashMLA's dense decode asserts it None as well
        raise ValueError("flash_mla_with_kvcache: attn_sink must be None when dense attention "
                         "is used (as in FlashMLA)")  # fmt: skip
    if is_fp8_kvcache:
        k_cache = _ds_rows(k_cache)
    if not isinstance(tile_scheduler_metadata, FlashMLASchedMeta):
        raise AssertionError("tile_scheduler_metadata must be of type FlashMLASchedMeta")
    if block_table is None or cache_seqlens is None:
        raise AssertionError("block_table and cache_seqlens must be provided when dense "
                             "attention is used.")  # fmt: skip
    config = (q.shape[0], q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2],
              bool(causal), bool(is_fp8_kvcache))  # fmt: skip
    meta = tile_scheduler_metadata
    if not meta.have_initialized:
        meta.have_initialized, meta.config = True, config
    elif meta.config != config:
        raise AssertionError(
            f"sched_meta was made for (b, s_q, h_q, page_block_size, h_k, causal, "
            f"is_fp8_kvcache) = {meta.config}, this call is {config}: your input arguments are "
            "inconsistent with sched_meta (reuse it only across calls of the same shapes)"
        )
    if k_cache.dim() != 4 or k_cache.shape[2] != 1:
        raise ValueError(f"k_cache must be (num_blocks, page_block_size, 1, head_dim), got "
                         f"{tuple(k_cache.shape)}")  # fmt: skip
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    out, lse = mla_attention_with_kvcache(
        q, k_cache, cache_seqlens=cache_seqlens, block_table=block_table,
        head_dim_v=head_dim_v, scale=softmax_scale, is_causal=causal, return_lse=True,
    )  # fmt: skip
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))


def _check_meta(meta, config) -> None:
    if not isinstance(meta, FlashMLASchedMeta):
        raise AssertionError("tile_scheduler_metadata must be of type FlashMLASchedMeta")
    if not meta.have_initialized:
        meta.have_initialized, meta.config = True, config
    elif meta.config != config:
        raise AssertionError(
            f"sched_meta was made for {meta.config}, this call is {config}: your input "
            "arguments are inconsistent with sched_meta (reuse it only across calls of the "
            "same shapes)"
        )


def _sparse_decode(q, k_cache, head_dim_v, meta, softmax_scale, causal, is_fp8_kvcache, indices,
                   attn_sink, topk_length):  # fmt: skip
    """FlashMLA's sparse decode: indices (batch_size, seq_len_q, topk) int32, each a slot of
    k_cache viewed as (num_blocks x page_block_size) rows (block x page_block_size + offset),
    -1 unused; no block table or lengths (FlashMLA passes None for both); attn_sink (num_heads_q,)
    float32 and topk_length (batch_size,) int32 as FlashMLA's. FlashMLA runs it over its
    656-byte fp8 layout only (is_fp8_kvcache); here over that layout or a bf16/fp16 cache."""
    if is_fp8_kvcache:
        k_cache = _ds_rows(k_cache)
    if causal:
        raise ValueError("flash_mla_with_kvcache: causal must be False with indices (the "
                         "indices are the keys a query sees, as in FlashMLA)")  # fmt: skip
    if k_cache.dim() != 4 or k_cache.shape[2] != 1:
        raise ValueError(f"k_cache must be (num_blocks, page_block_size, 1, head_dim), got "
                         f"{tuple(k_cache.shape)}")  # fmt: skip
    B = q.shape[0]
    _check_meta(meta, (B, q.shape[1], q.shape[2], k_cache.shape[1], k_cache.shape[2], False,
                       False, "sparse", indices.shape[-1]))  # fmt: skip
    # the cache's slots, as fusedattn addresses a paged cache's (its own page numbers): a
    # block table is needed to say "paged", and is not read for the keys
    table = torch.zeros(B, 1, dtype=torch.int32, device=q.device)
    lengths = torch.zeros(B, dtype=torch.int32, device=q.device)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    out, lse = mla_attention_with_kvcache(
        q, k_cache, cache_seqlens=lengths, block_table=table, head_dim_v=head_dim_v,
        scale=scale, sinks=attn_sink, indices=indices, topk_length=topk_length, return_lse=True,
    )  # fmt: skip
    return out, lse.masked_fill(lse == float("-inf"), float("inf"))


def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """FlashMLA's sparse prefill: q (s_q, h_q, d_qk), kv (s_kv, h_kv = 1, d_qk), indices (s_q,
    h_kv, topk) int32 (rows of kv, -1 unused), attn_sink (h_q,) float32, topk_length (s_q,)
    int32. Returns (out (s_q, h_q, d_v), max_logits (s_q, h_q) float32, lse (s_q, h_q)
    float32), the logits scaled by sm_scale, natural log; a query with no key: out 0,
    max_logits and lse -inf. out and lse are fusedattn.mla_sparse_attention's; max_logits is
    computed here over the gathered keys (q·k again, in chunks: the kernel keeps no row
    maxima), which costs another q·kᵀ over the listed keys."""
    with torch.no_grad():
        out, lse = mla_sparse_attention(q, kv, indices, scale=sm_scale, head_dim_v=d_v,
                                        sinks=attn_sink, topk_length=topk_length,
                                        return_lse=True)  # fmt: skip
        rows = kv.reshape(kv.shape[0], -1)
        entries = indices.reshape(q.shape[0], -1)
        listed = (entries >= 0) & (entries < rows.shape[0])
        if topk_length is not None:
            listed &= torch.arange(entries.shape[1], device=entries.device) < topk_length[:, None]
        chunk = max(1, MAX_LOGIT_CHUNK // max(1, entries.shape[1] * rows.shape[1]))
        maxes = []
        for start in range(0, q.shape[0], chunk):
            part = slice(start, start + chunk)
            keys = rows[torch.where(listed[part], entries[part], 0).long()]  # (c, topk, d_qk)
            logits = torch.einsum("chd,ctd->cht", q[part].float(), keys.float()) * sm_scale
            logits = logits.masked_fill(~listed[part][:, None, :], float("-inf"))
            maxes.append(logits.amax(dim=-1) if logits.shape[-1] else logits.sum(-1) - float("inf"))
        max_logits = torch.cat(maxes) if maxes else lse.new_empty(lse.shape)
    return out, max_logits, lse


def _ds_rows(k_cache: torch.Tensor) -> torch.Tensor:
    """FlashMLA's fp8 cache (is_fp8_kvcache): 656-byte rows, held as float8_e4m3fn or uint8
    (num_blocks, page_block_size, 1, 656), as fusedattn reads them (uint8, in place)."""
    if k_cache.shape[-1] != MLA_DS_BYTES or k_cache.element_size() != 1:
        raise ValueError(f"is_fp8_kvcache: k_cache must hold {MLA_DS_BYTES}-byte rows (float8 or "
                         f"uint8, last dimension {MLA_DS_BYTES}), got {k_cache.dtype} "
                         f"{tuple(k_cache.shape)}")  # fmt: skip
    return k_cache.view(torch.uint8)
