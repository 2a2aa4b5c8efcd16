"""`fusedattn.mla_attention_with_kvcache`: multi-head latent attention (DeepSeek-V2/V3, Kimi
K2, GLM) decoding over a latent KV cache, and its dispatch (validation, the in-place append,
the backend).

The family's files: this one, reference_backend.py, torch_backend.py, triton_backend.py (each
backend's run and refusals), backend_args.py (what the reference and torch backends share),
custom_ops.py (what torch.compile records). The checks are fusedattn.mla_checks (the
reference twin, fusedattn.reference.mla, runs them too). The CUDA backend has no MLA kernel:
backend="cuda" is refused by name.
"""

from __future__ import annotations

import torch

from ... import invariance
from ...checks import check_kvcache_values
from ...mla_checks import (
    check_index_values,
    check_mla_args,
    check_slot_values,
    check_sparse_indices,
)
from ...reference.mla import sparse_slots
from ..core import backends
from ..core.plans import tracing
from ..shared.decode_launch import values_checked
from . import custom_ops, reference_backend, torch_backend, triton_backend

OP = "mla_attention_with_kvcache"
backends.register(OP, "reference", reference_backend.attention, backends.no_refusals)
backends.register(OP, "torch", torch_backend.attention, torch_backend.refusals)
backends.register(OP, "triton", triton_backend.attention, triton_backend.refusals)


def mla_attention_with_kvcache(
    q,
    kv_cache: torch.Tensor,
    kv_c: torch.Tensor | None = None,
    k_pe: torch.Tensor | None = None,
    *,
    cache_seqlens,
    block_table: torch.Tensor | None = None,
    head_dim_v: int = 512,
    scale: float | None = None,
    is_causal: bool = False,
    sinks: torch.Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    kv_descale: torch.Tensor | None = None,
    indices: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    backend: str = "auto",
):
    """Multi-head latent attention over a latent KV cache: exactly `attention_with_kvcache`
    with one KV head whose keys are each cache row whole and whose values are the row's first
    `head_dim_v` columns, read from the same buffer (never copied).

    q (B, Tq, Hq, D), or the pair (q_nope (B, Tq, Hq, Dl), q_pe (B, Tq, Hq, Dr)) with Dl + Dr
    = D (DeepSeek: 512 + 64 = 576, the absorbed queries). kv_cache (num_pages, page_size, D)
    or (num_pages, page_size, 1, D) with block_table (B, max_pages) int32 (any page size from
    1), or contiguous (B', S, 1, D), B' >= B; any strides with a unit last stride. In q's dtype,
    or float8_e4m3fn / float8_e5m2 with kv_descale (one float32 value: a stored element means
    stored x kv_descale, vLLM's fp8 MLA cache).

    cache_seqlens: int32 (B,) or an int, the keys of each sequence before the append. kv_c
    (B, Tnew, Dl) and k_pe (B, Tnew, Dr), when given, are written in place at positions
    cache_seqlens[b] .. + Tnew - 1 first (into an fp8 cache as x / kv_descale, saturating);
    sequence b's keys are then positions 0 .. L_b - 1, L_b = cache_seqlens[b] + Tnew. is_causal:
    query i of Tq sits at L_b - Tq + i (bottom-right: MTP, speculative verification). sinks
    (Hq,) as in `attention`. A sequence with no key gives 0 and lse -inf (the sink with
    sinks). num_splits: key splits per (sequence, query block), 0 picks them per call; fp32
    partials combined in a fixed order. Under fusedattn.batch_invariant the keys are split at
    fixed positions (num_splits other than 0 refused).

    indices (B, Tq, topk) int32 (DeepSeek sparse attention, DeepSeek-V3.2's top-k keys a
    query): query i of sequence b attends to exactly the keys indices[b, i] lists, no other.
    An entry is a key's row in the cache as the cache numbers it: for a paged cache the slot
    page x page_size + offset (page the cache's own page number, as FlashMLA's sparse API:
    the block table is not read for it), for a contiguous cache the key's position in row b.
    -1 marks an unused entry; topk_length (B,) int32 is each row's valid prefix (entries past
    it unused); a duplicate counts once. No causal mask on top unless is_causal (contiguous
    caches only: there an entry is a position). A query with no valid entry gives 0 and lse
    -inf (the sink with sinks). Sinks, return_lse, num_splits (over the entries) and batch
    invariance as in the dense call; an entry past the cache (paged) or past its sequence's
    length (contiguous) raises where the values are checked (below).

    Returns out (B, Tq, Hq, head_dim_v) in q's dtype [, lse (B, Hq, Tq) fp32]. Inference only
    (refused where autograd would record). Bad input raises before anything is written: the
    metadata and every refusal of the backend, then the values (cache_seqlens in [0, capacity
    - Tnew], the block-table entries of the pages a sequence uses). On a GPU the Triton
    backend skips the value check (a sync) unless FUSEDATTN_CHECK_VALUES=1 and never reads
    or writes outside the cache, the block table or the lengths. A NaN in a slot past a
    sequence's length never reaches the output.
    """
    if invariance._enabled and num_splits != 0:
        raise ValueError(
            f"num_splits={num_splits}: fusedattn.batch_invariant is on, which splits the keys "
            f"at fixed positions itself (pass num_splits=0)"
        )
    call = check_mla_args(q, kv_cache, kv_c, k_pe, cache_seqlens, block_table, head_dim_v,
                          scale, is_causal, sinks, num_splits, return_lse, kv_descale)  # fmt: skip
    check_sparse_indices(indices, topk_length, call, block_table is not None, is_causal)
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (call.q, call.q_pe, kv_cache, kv_c, k_pe, sinks)
    )
    if grads:
        raise ValueError(
            "mla_attention_with_kvcache is inference only: an input requires grad with grad "
            "mode on (run it under torch.no_grad() or torch.inference_mode())"
        )
    seqlens_k = call.seqlens + call.Tnew if call.Tnew else call.seqlens
    inputs = dict(
        q=call.q, q_pe=call.q_pe, kv_cache=call.kv_cache, seqlens_k=seqlens_k,
        block_table=block_table, Dv=call.Dv, Dr=call.Dr, scale=scale, is_causal=is_causal,
        sinks=sinks, num_splits=int(num_splits), return_lse=return_lse, kv_descale=kv_descale,
    )  # fmt: skip
    if indices is not None:
        inputs["indices"] = indices
    impl = backends.select(OP, backend, call.q.device, inputs)
    check = values_checked(call.q.is_cuda, impl.backend)
    if indices is not None:
        if check and not tracing():  # the entries as given (the keys they name: below)
            check_index_values(indices, topk_length)
        inputs["indices"] = sparse_slots(indices, topk_length)
    if tracing():  # torch.compile / jit.trace: the custom ops
        if call.Tnew:
            torch.ops.fusedattn.mla_append(call.kv_cache, kv_c, k_pe, call.seqlens, block_table,
                                           kv_descale, check)  # fmt: skip
            check = False
        out, lse = torch.ops.fusedattn.mla_attention(
            call.q, call.q_pe, call.kv_cache, seqlens_k, block_table, sinks, kv_descale,
            inputs.get("indices"), call.Dv, call.Dr, scale, is_causal, int(num_splits),
            return_lse, check, impl.backend,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    if check:  # the values, before anything is written
        check_kvcache_values(call.seqlens, None, block_table, call.kv_cache, call.Tnew,
                             descales=dict(kv_descale=kv_descale))  # fmt: skip
        if indices is not None:
            check_slot_values(inputs["indices"], seqlens_k, block_table, call.kv_cache)
    if call.Tnew:
        custom_ops.append_impl(call.kv_cache, kv_c, k_pe, call.seqlens, block_table,
                               kv_descale, False)  # fmt: skip
    return impl.run(**inputs)
