"""The arithmetic of a KV cache's layouts, in plain torch: where sequence b's key positions live.

Two layouts, flash-attention's (sequence before heads): contiguous, (B', S, Hkv, D) with
sequence b in row b; paged, (num_pages, page_size, Hkv, D) with block_table (B, max_pages)
int32 naming page p of sequence b. Decoding (`attention_with_kvcache`) and the paged prefill
(`varlen_attention(..., block_table=...)`) both read caches through these helpers, in every
backend that gathers (reference and torch): the positions of a sequence, the gather of the
cache to a (B, Hkv, T, D) view, and the append by indexed writes. The Triton kernels do the
same arithmetic on the device (triton_kernels/decode.py).

Nothing here checks values: the callers do first (checks.check_kvcache_values), or clamp
what they gather and mask it.
"""

from __future__ import annotations

import torch

from .fp8 import is_fp8, quantize


def kvcache_capacity(k_cache: torch.Tensor, block_table) -> int:
    """Key positions per sequence: S of a contiguous cache, max_pages * page_size of a paged
    one."""
    if block_table is None:
        return k_cache.shape[1]
    return block_table.shape[1] * k_cache.shape[1]


def cache_rows(cache: torch.Tensor, block_table, b: int, start: int, end: int) -> torch.Tensor:
    """Sequence b's cache positions [start, end) as (end - start, Hkv, D) rows."""
    if block_table is None:
        return cache[b, start:end]
    pos = torch.arange(start, end, device=cache.device)
    page_size = cache.shape[1]
    return cache[block_table[b].long()[pos // page_size], pos % page_size]


def packed_rows(cache: torch.Tensor, block_table, lengths: list[int]) -> torch.Tensor:
    """Every sequence's first lengths[b] positions, packed as (sum(lengths), Hkv, D) rows."""
    rows = [cache_rows(cache, block_table, b, 0, n) for b, n in enumerate(lengths)]
    return torch.cat(rows) if rows else cache[:0, 0]


def dense_cache(cache: torch.Tensor, block_table, B: int) -> torch.Tensor:
    """(B, Hkv, capacity, D) view of the first B sequences of a contiguous cache, or the pages
    of a paged one gathered in block-table order (a copy; entries past a sequence's pages may
    hold anything, so they are clamped to a valid page and masked by the caller)."""
    if block_table is None:
        return cache[:B].transpose(1, 2)
    pages = block_table.long().clamp(0, cache.shape[0] - 1)
    gathered = cache[pages]  # (B, max_pages, page_size, Hkv, D)
    return gathered.flatten(1, 2).transpose(1, 2)


def paged_positions(cache: torch.Tensor, block_table: torch.Tensor, T: int) -> torch.Tensor:
    """A paged cache's first T positions of each sequence as (B, Hkv, T, D) (positions past a
    sequence's pages read some page of the cache; the caller masks them)."""
    page_size = cache.shape[1]
    j = torch.arange(T, device=cache.device)
    column = (j // page_size).clamp(max=max(block_table.shape[1] - 1, 0))
    pages = block_table.long()[:, column].clamp(0, cache.shape[0] - 1)  # (B, T)
    return cache[pages, j % page_size].transpose(1, 2)


def append_to_cache(k_cache, v_cache, k, v, cache_seqlens, block_table, k_descale=None,
                    v_descale=None):  # fmt: skip
    """Write k, v (B, Tnew, Hkv, D[v]) into the caches at positions cache_seqlens[b] ..
    cache_seqlens[b] + Tnew - 1 of each sequence, in place (through block_table when paged).
    Indexed writes on the device: no sync; nothing else in the cache is touched. The values
    were checked first (checks.check_kvcache_values): every index is inside the cache. An
    fp8 cache gets x / descale rounded to nearest-even, saturating (fusedattn.fp8.quantize;
    the descale per sequence and KV head, or one value)."""
    B, Tnew = k.shape[:2]
    if Tnew == 0 or B == 0:
        return
    if is_fp8(k_cache):
        k = quantize(k, _rows_layout(k_descale), k_cache.dtype)
        v = quantize(v, _rows_layout(v_descale), v_cache.dtype)
    pos = cache_seqlens.long()[:, None] + torch.arange(Tnew, device=k.device)  # (B, Tnew)
    if block_table is None:
        rows = torch.arange(B, device=k.device)[:, None].expand(B, Tnew)
        k_cache[rows, pos] = k
        v_cache[rows, pos] = v
    else:
        page_size = k_cache.shape[1]
        page = torch.gather(block_table.long(), 1, pos // page_size)
        k_cache[page, pos % page_size] = k
        v_cache[page, pos % page_size] = v


def _rows_layout(descale: torch.Tensor) -> torch.Tensor:
    """A descale laid out against new rows (B, Tnew, Hkv, D): (B, 1, Hkv, 1), or one value."""
    return descale.reshape(1) if descale.numel() == 1 else descale[:, None, :, None]
