"""The argument checks of `fusedattn.mla_attention_with_kvcache`: metadata only (no tensor
values, no sync), each naming the argument and the expected layout, before anything is
written; the values (lengths, block table) are checks.check_kvcache_values'."""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

from .checks import (
    check_bool,
    check_descale,
    check_float_dtype,
    check_scale,
    check_tensor,
    shape_str,
)
from .fp8 import MLA_DS_BYTES, MLA_DS_LATENT, MLA_DS_ROPE, is_fp8, is_mla_ds


@dataclass(frozen=True)
class MLACall:
    """One call's normalised tensors: q as (B, Tq, Hq, D) or its two parts, the cache as
    (rows, slots, 1, D), the new rows as (B, Tnew, 1, D) (None without an append)."""

    q: torch.Tensor  # (B, Tq, Hq, Dv): the latent part (a view of q's first Dv columns)
    q_pe: torch.Tensor | None  # (B, Tq, Hq, Dr): the rope part (None when Dr = 0)
    kv_cache: torch.Tensor  # (rows, slots, 1, D)
    seqlens: torch.Tensor  # (B,) int32: the keys before the append
    Dv: int
    Dr: int
    Tnew: int


def check_mla_args(q, kv_cache, kv_c, k_pe, cache_seqlens, block_table, head_dim_v, scale,
                   is_causal, sinks, num_splits, return_lse, kv_descale) -> MLACall:  # fmt: skip
    """Validate a call and normalise its layouts (views, no copy but the q parts' where q
    comes as two tensors whose split is not at head_dim_v)."""
    if isinstance(q, tuple | list):
        if len(q) != 2:
            raise TypeError(f"q must be a tensor or the pair (q_nope, q_pe), got {len(q)} items")
        q_nope, q_pe = q
        check_tensor("q_nope", q_nope, dims=4, layout="(B, Tq, Hq, Dl)")
        check_tensor("q_pe", q_pe, dims=4, layout="(B, Tq, Hq, Dr)")
        if tuple(q_pe.shape[:3]) != tuple(q_nope.shape[:3]):
            raise ValueError(f"q_pe must match q_nope's (B, Tq, Hq) = "
                             f"{shape_str(q_nope.shape[:3])}, got {shape_str(q_pe.shape)}")  # fmt: skip
        if q_pe.dtype != q_nope.dtype or q_pe.device != q_nope.device:
            raise ValueError(f"q_pe must have q_nope's dtype and device ({q_nope.dtype}, "
                             f"{q_nope.device}), got {q_pe.dtype}, {q_pe.device}")  # fmt: skip
        head = q_nope
        D = q_nope.shape[-1] + q_pe.shape[-1]
    else:
        check_tensor("q", q, dims=4, layout="(B, Tq, Hq, D)")
        head, q_nope, q_pe, D = q, None, None, q.shape[-1]
    check_float_dtype("q", head)  # float64 too: the Triton kernels refuse it by name
    B, _, Hq = head.shape[:3]
    if isinstance(head_dim_v, bool) or not isinstance(head_dim_v, numbers.Integral):
        raise TypeError(f"head_dim_v must be an int, got {head_dim_v!r}")
    Dv = int(head_dim_v)
    if not 1 <= Dv <= D:
        raise ValueError(f"head_dim_v must be in [1, D] = [1, {D}] (V is the first head_dim_v "
                         f"columns of each cache row), got {Dv}")  # fmt: skip
    Dr = D - Dv
    paged = block_table is not None
    check_tensor("kv_cache", kv_cache)
    if kv_cache.dim() == 3 and paged:
        kv4 = kv_cache.unsqueeze(2)
    elif kv_cache.dim() == 4:
        kv4 = kv_cache
    else:
        layouts = ("(num_pages, page_size, D) or (num_pages, page_size, 1, D) with block_table"
                   if paged else "(B, S, 1, D) (or a paged cache with block_table)")  # fmt: skip
        raise ValueError(f"kv_cache must be {layouts}, got {shape_str(kv_cache.shape)}")
    if kv4.shape[2] != 1:
        raise ValueError(f"kv_cache holds one latent head (its third dimension 1), got "
                         f"{shape_str(kv_cache.shape)}")  # fmt: skip
    ds = is_mla_ds(kv4)  # DeepSeek's 656-byte fp8 rows (fp8.quantize_mla_ds)
    if ds and (D, Dv) != (MLA_DS_LATENT + MLA_DS_ROPE, MLA_DS_LATENT):
        raise ValueError(f"kv_cache holds DeepSeek's {MLA_DS_BYTES}-byte rows (512 latent + 64 "
                         f"rope values): q's D must be 576 and head_dim_v 512, got D = {D}, "
                         f"head_dim_v = {Dv}")  # fmt: skip
    if kv4.shape[-1] != D and not ds:
        raise ValueError(f"kv_cache rows must have q's D = {D} columns (latent + rope), got "
                         f"{kv4.shape[-1]}")  # fmt: skip
    if kv4.stride(-1) != 1:
        raise ValueError(f"kv_cache must have a unit last stride (read and appended to in "
                         f"place), got strides {tuple(kv_cache.stride())}")  # fmt: skip
    if kv4.device != head.device:
        raise ValueError(f"kv_cache must be on {head.device}, got {kv4.device}")
    if is_fp8(kv4):
        if kv4.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise TypeError(f"an fp8 kv_cache is float8_e4m3fn or float8_e5m2, got {kv4.dtype}")
        if kv_descale is None:
            raise ValueError(f"kv_cache is {kv4.dtype}: kv_descale is required (a stored "
                             "element means stored x kv_descale)")  # fmt: skip
        check_descale("kv_descale", kv_descale, B, 1, head.device)
        if kv_descale.numel() != 1:
            raise ValueError(f"kv_descale is one value for the whole cache (per-tensor, as "
                             f"vLLM's fp8 MLA cache), got {shape_str(kv_descale.shape)}")  # fmt: skip
        if head.dtype == torch.float64:
            raise TypeError("an fp8 kv_cache is read with q in float16, bfloat16 or float32")
    elif ds:
        if kv_descale is not None:
            raise ValueError(f"kv_descale is given but kv_cache holds {MLA_DS_BYTES}-byte rows, "
                             "whose scales are in each row")  # fmt: skip
        if head.dtype == torch.float64:
            raise TypeError(f"a {MLA_DS_BYTES}-byte kv_cache is read with q in float16, bfloat16 "
                            "or float32")  # fmt: skip
    else:
        if kv_descale is not None:
            raise ValueError(f"kv_descale is given but kv_cache is {kv4.dtype}: descales belong "
                             "to fp8 caches")  # fmt: skip
        if kv4.dtype != head.dtype:
            raise TypeError(f"kv_cache must have q's dtype {head.dtype} (or be fp8), got "
                            f"{kv4.dtype}")  # fmt: skip
    if paged:
        check_tensor("block_table", block_table, dims=2, layout="(B, max_pages) int32")
        if block_table.dtype != torch.int32:
            raise TypeError(f"block_table must be int32, got {block_table.dtype}")
        if block_table.shape[0] != B:
            raise ValueError(f"block_table must have one row per sequence (B = {B}), got "
                             f"{shape_str(block_table.shape)}")  # fmt: skip
        if block_table.device != head.device:
            raise ValueError(f"block_table must be on {head.device}, got {block_table.device}")
    elif kv4.shape[0] < B:
        raise ValueError(f"kv_cache holds {kv4.shape[0]} sequences but q has B = {B} (a paged "
                         "cache needs block_table)")  # fmt: skip
    seqlens = _seqlens(cache_seqlens, B, head.device)
    Tnew = 0
    if (kv_c is None) != (k_pe is None) and Dr:
        raise ValueError("kv_c and k_pe are appended together: pass both or neither")
    if kv_c is not None:
        check_tensor("kv_c", kv_c, dims=3, layout="(B, Tnew, Dl)")
        Tnew = kv_c.shape[1]
        parts = [("kv_c", kv_c)] + ([("k_pe", k_pe)] if k_pe is not None else [])
        if k_pe is not None:
            check_tensor("k_pe", k_pe, dims=3, layout="(B, Tnew, Dr)")
        width = sum(t.shape[-1] for _, t in parts)
        for name, t in parts:
            if tuple(t.shape[:2]) != (B, Tnew):
                raise ValueError(f"{name} must be (B, Tnew, ...) with B = {B}, Tnew = {Tnew}, "
                                 f"got {shape_str(t.shape)}")  # fmt: skip
            if t.device != head.device:
                raise ValueError(f"{name} must be on {head.device}, got {t.device}")
            if is_fp8(kv4) or ds:
                if t.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                    raise TypeError(f"{name} (written into an fp8 cache) must be float16, "
                                    f"bfloat16 or float32, got {t.dtype}")  # fmt: skip
            elif t.dtype != head.dtype:
                raise TypeError(f"{name} must have q's dtype {head.dtype}, got {t.dtype}")
        if width != D:
            raise ValueError(f"kv_c and k_pe must hold a cache row's D = {D} columns together, "
                             f"got {width}")  # fmt: skip
    check_scale(scale)
    check_bool("is_causal", is_causal)
    check_bool("return_lse", return_lse)
    if sinks is not None:
        check_tensor("sinks", sinks, dims=1, layout=f"(Hq,) = ({Hq},)")
        if sinks.shape[0] != Hq:
            raise ValueError(f"sinks must have shape (Hq,) = ({Hq},), got {shape_str(sinks.shape)}")
        if sinks.device != head.device:
            raise ValueError(f"sinks must be on {head.device}, got {sinks.device}")
    if isinstance(num_splits, bool) or not isinstance(num_splits, numbers.Integral):
        raise TypeError(f"num_splits must be an int, got {num_splits!r}")
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 picks it per call), got {num_splits}")
    if q_nope is None:  # one tensor: its two parts as views
        q_v, q_r = q[..., :Dv], (q[..., Dv:] if Dr else None)
    elif q_nope.shape[-1] == Dv:  # split where V's columns end: read in place
        q_v, q_r = q_nope, (q_pe if Dr else None)
    else:  # another split: one tensor first (a q-sized copy)
        whole = torch.cat([q_nope, q_pe], dim=-1)
        q_v, q_r = whole[..., :Dv], (whole[..., Dv:] if Dr else None)
    for name, t in (("q", q_v), ("q_pe", q_r)):
        if t is not None and t.stride(-1) != 1:
            raise ValueError(f"{name} must have a unit last stride, got {tuple(t.stride())}")
    return MLACall(q_v, q_r, kv4, seqlens, Dv, Dr, Tnew)


def _seqlens(cache_seqlens, B: int, device) -> torch.Tensor:
    if isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        if cache_seqlens < 0:
            raise ValueError(f"cache_seqlens must be >= 0, got {cache_seqlens}")
        return torch.full((B,), int(cache_seqlens), dtype=torch.int32, device=device)
    if not isinstance(cache_seqlens, torch.Tensor):
        raise TypeError(f"cache_seqlens must be an int32 tensor of shape (B,) (or an int), got "
                        f"{type(cache_seqlens).__name__}")  # fmt: skip
    check_tensor("cache_seqlens", cache_seqlens, dims=1, layout=f"(B,) = ({B},) int32")
    if cache_seqlens.dtype != torch.int32:
        raise TypeError(f"cache_seqlens must be int32, got {cache_seqlens.dtype}")
    if cache_seqlens.shape[0] != B:
        raise ValueError(f"cache_seqlens must have shape (B,) = ({B},), got "
                         f"{shape_str(cache_seqlens.shape)}")  # fmt: skip
    if cache_seqlens.device != device:
        raise ValueError(f"cache_seqlens must be on {device}, got {cache_seqlens.device}")
    return cache_seqlens


def check_sparse_indices(indices, topk_length, call: MLACall, paged: bool, is_causal: bool):
    """DeepSeek sparse attention's arguments (metadata only): indices (B, Tq, topk) int32 on
    q's device, topk_length (B,) int32 or None; causal masking on a paged cache refused (a
    slot's position in its sequence is not known without the block table's inverse)."""
    if indices is None:
        if topk_length is not None:
            raise ValueError("topk_length is given without indices: it is the valid prefix of "
                             "each row of indices")  # fmt: skip
        return
    B, Tq = call.q.shape[:2]
    check_tensor("indices", indices, dims=3, layout=f"(B, Tq, topk) = ({B}, {Tq}, topk) int32")
    if indices.dtype != torch.int32:
        raise TypeError(f"indices must be int32, got {indices.dtype}")
    if tuple(indices.shape[:2]) != (B, Tq) or indices.shape[2] < 1:
        raise ValueError(f"indices must be (B, Tq, topk) = ({B}, {Tq}, topk >= 1), got "
                         f"{shape_str(indices.shape)}")  # fmt: skip
    if indices.device != call.q.device:
        raise ValueError(f"indices must be on {call.q.device}, got {indices.device}")
    if topk_length is not None:
        check_tensor("topk_length", topk_length, dims=1, layout=f"(B,) = ({B},) int32")
        if topk_length.dtype != torch.int32:
            raise TypeError(f"topk_length must be int32, got {topk_length.dtype}")
        if topk_length.shape[0] != B:
            raise ValueError(f"topk_length must have shape (B,) = ({B},), got "
                             f"{shape_str(topk_length.shape)}")  # fmt: skip
        if topk_length.device != call.q.device:
            raise ValueError(f"topk_length must be on {call.q.device}, got {topk_length.device}")
    if is_causal and paged:
        raise ValueError(
            "is_causal with indices over a paged cache: an index is a cache slot (page x "
            "page_size + offset), whose position in its sequence the kernel does not know; "
            "select only visible keys in indices, or use a contiguous cache (indices are "
            "positions there)"
        )


def check_index_values(indices, topk_length) -> None:
    """The entries as given (a sync: where values are checked): each listed one a key index or
    -1, topk_length in [0, topk]."""
    topk = indices.shape[2]
    if topk_length is not None:
        bad = (topk_length < 0) | (topk_length > topk)
        if bool(bad.any()):
            b = int(bad.nonzero()[0, 0])
            raise ValueError(f"topk_length[{b}] = {int(topk_length[b])} is outside [0, topk = "
                             f"{topk}]")  # fmt: skip
    listed = indices < -1
    if topk_length is not None:
        listed &= torch.arange(topk, device=indices.device) < topk_length.view(-1, 1, 1)
    if bool(listed.any()):
        where = tuple(int(i) for i in listed.nonzero()[0])
        raise ValueError(f"indices{list(where)} = {int(indices[where])}: an entry is a key "
                         "index or -1 (unused)")  # fmt: skip


def check_slot_values(slots, seqlens_k, block_table, kv_cache) -> None:
    """The keys the call reads (reference.mla.sparse_slots's, -1 unused) inside the cache: a
    paged cache's slot below num_pages x page_size, a contiguous cache's position below its
    sequence's length (cache_seqlens + the appended keys)."""
    if block_table is not None:
        limit = kv_cache.shape[0] * kv_cache.shape[1]
        what = f"the cache's {limit} slots (num_pages x page_size)"
    else:
        limit = seqlens_k.to(slots.dtype).view(-1, 1, 1)
        what = "its sequence's length (cache_seqlens + the appended keys)"
    past = slots >= limit
    if bool(past.any()):
        where = tuple(int(i) for i in past.nonzero()[0])
        raise ValueError(f"indices of sequence {where[0]}, query {where[1]}: key "
                         f"{int(slots[where])} is past {what}")  # fmt: skip
