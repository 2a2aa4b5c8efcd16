"""The torch backend of `fusedattn.mla_attention_with_kvcache`: the latent cache gathered to a
dense copy and one SDPA call over it (shared/cache_sdpa.py, as KV-cache decoding's), K the
rows whole and V their first head_dim_v columns."""

from __future__ import annotations

import torch

from ...fp8 import is_fp8, is_mla_ds
from ..shared import sdpa
from ..shared.cache_sdpa import cache_attention
from .backend_args import full_q, window_of


def refusals(*, q, kv_cache, sinks, return_lse, indices=None, **_inputs) -> list[str]:
    """SDPA's: no lse, sinks only in q's dtype (an fp8 cache runs in float32); no sparse path
    (indices: the Triton kernel on a GPU, the reference elsewhere)."""
    probe = q.new_empty((0,), dtype=torch.float32) if is_fp8(kv_cache) else q
    reasons = sdpa.refusals(q=probe, return_lse=return_lse, softcap=0.0, alibi_slopes=None,
                            sinks=sinks)  # fmt: skip
    if indices is not None:
        reasons.append("indices (sparse attention): the torch backend has no sparse path; "
                       "backend='triton' runs it on a GPU, 'reference' anywhere")  # fmt: skip
    if is_mla_ds(kv_cache):
        reasons.append("kv_cache holds DeepSeek's 656-byte fp8 rows: the torch backend has no "
                       "path for them; backend='triton' on a GPU, 'reference' anywhere")  # fmt: skip
    return reasons


def attention(*, q, q_pe, kv_cache, seqlens_k, block_table, Dv, Dr, scale, is_causal, sinks,
              num_splits, return_lse, kv_descale):  # fmt: skip
    return cache_attention(
        full_q(q, q_pe), kv_cache, kv_cache[..., :Dv], seqlens_k, block_table, None, None,
        scale, window_of(is_causal), 0.0, None, sinks, num_splits, False,
        k_descale=kv_descale, v_descale=kv_descale,
    )  # fmt: skip
