"""flash-attention 2's functions on fusedattn's kernels: switch by changing the import.

    # from flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache
    from fusedattn.compat.flash_attn import (
        flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache,
    )

Signatures, argument names, defaults, layouts (sequence before heads) and return values are
flash-attention 2's (`flash_attn/flash_attn_interface.py`): causal masks and windows are
aligned bottom-right, GQA/MQA is implied by fewer K/V heads, `return_attn_probs=True` returns
(out, softmax_lse, None) (flash-attention's third value is the dropout pattern, returned only
with dropout; asking for it with dropout_p > 0 is refused), `deterministic` is accepted (every
fusedattn backward is deterministic). What fusedattn cannot honour raises a ValueError naming
it: rotary embedding inside `flash_attn_with_kvcache` (apply it to q and k first),
`cache_batch_idx`, and a `block_table` in `flash_attn_varlen_func`. fp32 inputs, which
flash-attention refuses, are accepted.

`BACKEND` ("auto" by default, or FUSEDATTN_BACKEND) picks fusedattn's backend for every call.
"""

from __future__ import annotations

import torch

from ..ops import attention, attention_with_kvcache, varlen_attention

BACKEND = "auto"

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]


def _window(window_size) -> tuple[int, int] | None:
    left, right = (int(w) for w in window_size)
    return None if (left, right) == (-1, -1) else (left, right)


def _probs_result(out, lse, dropout_p, return_attn_probs):
    if not return_attn_probs:
        return out
    return out, lse, None


def _refuse_attn_probs_with_dropout(dropout_p, return_attn_probs):
    if return_attn_probs and dropout_p > 0.0:
        raise ValueError(
            "return_attn_probs=True with dropout_p > 0: flash-attention then returns the "
            "dropout pattern (S_dmask), which fusedattn's kernels do not materialise; pass "
            "dropout_p=0.0 to get (out, softmax_lse, None)"
        )


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """q (B, Tq, Hq, D), k (B, Tk, Hkv, D), v (B, Tk, Hkv, Dv) -> out (B, Tq, Hq, Dv)
    [, softmax_lse (B, Hq, Tq), None]; see the module docstring."""
    _refuse_attn_probs_with_dropout(dropout_p, return_attn_probs)
    result = attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=dropout_p,
        is_causal=causal, scale=softmax_scale, enable_gqa=q.shape[2] != k.shape[2],
        window_size=_window(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
        causal_alignment="bottom_right", return_lse=return_attn_probs, backend=BACKEND,
    )  # fmt: skip
    out, lse = result if return_attn_probs else (result, None)
    return _probs_result(out.transpose(1, 2), lse, dropout_p, return_attn_probs)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Packed q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv) with int32
    cu_seqlens (B + 1,) -> out (total_q, Hq, Dv) [, softmax_lse (Hq, total_q), None]."""
    if block_table is not None:
        raise ValueError(
            "flash_attn_varlen_func with a block_table (a paged K/V cache) is not supported by "
            "fusedattn; use flash_attn_with_kvcache for paged caches"
        )
    _refuse_attn_probs_with_dropout(dropout_p, return_attn_probs)
    result = varlen_attention(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
        is_causal=causal, scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1],
        window_size=_window(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
        causal_alignment="bottom_right", return_lse=return_attn_probs, backend=BACKEND,
    )  # fmt: skip
    out, lse = result if return_attn_probs else (result, None)
    return _probs_result(out, lse, dropout_p, return_attn_probs)


def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens: int | torch.Tensor | None = None,
    cache_batch_idx: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """fusedattn.attention_with_kvcache under flash-attention's name and argument order.
    cache_seqlens=None means every slot of the cache holds a key (flash-attention's
    default). Inference only: refused where autograd would record."""
    if rotary_cos is not None or rotary_sin is not None:
        raise ValueError(
            "rotary_cos/rotary_sin: fusedattn's flash_attn_with_kvcache applies no rotary "
            "embedding; rotate q and k before the call"
        )
    if cache_batch_idx is not None:
        raise ValueError(
            "cache_batch_idx is not supported by fusedattn: index the cache's sequences "
            "(or use a block_table) instead"
        )
    if cache_seqlens is None:
        if k is not None:
            raise ValueError("appending k and v needs cache_seqlens (where to write them)")
        pages = 1 if block_table is None else block_table.shape[1]
        cache_seqlens = k_cache.shape[1] * pages
    return attention_with_kvcache(
        q, k_cache, v_cache, k, v, cache_seqlens=cache_seqlens, block_table=block_table,
        cache_leftpad=cache_leftpad, scale=softmax_scale, is_causal=causal,
        window_size=_window(window_size), softcap=softcap, alibi_slopes=alibi_slopes,
        num_splits=num_splits, return_lse=return_softmax_lse, backend=BACKEND,
    )  # fmt: skip
