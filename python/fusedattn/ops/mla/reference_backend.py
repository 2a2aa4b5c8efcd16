"""The reference backend of `fusedattn.mla_attention_with_kvcache`: the naive attention over
each sequence's gathered latent rows, or each query's listed rows with indices
(fusedattn.reference.mla)."""

from __future__ import annotations

from ...fp8 import is_mla_ds
from ...mla_checks import MLACall
from ...reference.decode import cached_attention
from ...reference.mla import gathered_attention, sparse_attention
from .backend_args import full_q, window_of


def attention(*, q, q_pe, kv_cache, seqlens_k, block_table, Dv, Dr, scale, is_causal, sinks,
              num_splits, return_lse, kv_descale, indices=None):  # fmt: skip
    if indices is not None:  # DeepSeek sparse attention: each query's listed keys
        return sparse_attention(full_q(q, q_pe), kv_cache, indices, seqlens_k,
                                block_table is not None, Dv, scale, is_causal, sinks,
                                return_lse, kv_descale)  # fmt: skip
    if is_mla_ds(kv_cache):  # DeepSeek's 656-byte rows: the reference twin dequantizes them
        call = MLACall(q, q_pe, kv_cache, seqlens_k, Dv, Dr, 0)
        return gathered_attention(call, block_table, scale, is_causal, sinks, return_lse, None,
                                  seqlens_k)  # fmt: skip
    return cached_attention(
        full_q(q, q_pe), kv_cache, kv_cache[..., :Dv], seqlens_k, block_table, None, scale,
        window_of(is_causal), 0.0, None, sinks, return_lse, k_descale=kv_descale,
        v_descale=kv_descale,
    )  # fmt: skip
