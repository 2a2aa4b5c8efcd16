"""The reference backend of `fusedattn.attention_with_kvcache`: the naive attention over each
sequence's keys, one sequence at a time (fusedattn.reference.decode)."""

from __future__ import annotations

from ... import reference


def attention(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, scale,
              window, softcap, alibi_slopes, sinks, num_splits, return_lse, q_descale=None,
              k_descale=None, v_descale=None):  # fmt: skip
    return reference.decode.cached_attention(
        q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, scale, window, softcap,
        alibi_slopes, sinks, return_lse, key_mask=key_mask, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale,
    )  # fmt: skip
