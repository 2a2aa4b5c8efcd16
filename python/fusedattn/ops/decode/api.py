"""`fusedattn.attention_with_kvcache`: the KV-cache decoding family's public function and its
dispatch (validation, the plan of an eager call, the in-place append, the backend).

The family's files: this one (the public function, the backends' registration, the value
checks' switch), plans.py (the eager calls' plans), reference_backend.py, torch_backend.py,
triton_backend.py (each backend's run and refusals), custom_ops.py (what torch.compile
records). The Triton decode launcher and the append are shared with the paged prefill
(ops/shared/decode_launch.py).

Inference only. The layout is flash-attention's `flash_attn_with_kvcache` (sequence before
heads), so its callers port by renaming. The append happens here, once, before any backend
runs; the backends then see sequence b's keys at cache positions
[cache_leftpad[b], cache_seqlens[b] + Tnew).
"""

from __future__ import annotations

import torch

from ... import invariance
from ...checks import check_kvcache_args, check_tensor
from ..core import backends
from ..core.plans import tracing
from ..shared.decode_launch import (  # noqa: F401 (CHECK_VALUES_ENV: the switch's name)
    CHECK_VALUES_ENV,
    NO_DESCALES,
    key_mask_bounds,
    values_checked,
)
from . import custom_ops, plans, reference_backend, torch_backend, triton_backend

backends.register("attention_with_kvcache", "reference", reference_backend.attention,
                  backends.no_refusals)  # fmt: skip
backends.register("attention_with_kvcache", "torch", torch_backend.attention,
                  torch_backend.refusals)  # fmt: skip
backends.register("attention_with_kvcache", "triton", triton_backend.attention,
                  triton_backend.refusals)  # fmt: skip


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens,
    block_table: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    backend: str = "auto",
):
    """Attention of a few new queries per sequence over a KV cache (decoding, speculative
    decoding, chunked prefill); flash-attention's `flash_attn_with_kvcache` layout.

    q (B, Tq, Hq, D). A contiguous cache k_cache (B', S, Hkv, D), v_cache (B', S, Hkv, Dv)
    with B' >= B (sequence b is row b), or a paged one (num_pages, page_size, Hkv, D) with
    block_table (B, max_pages) int32: page p of sequence b is k_cache[block_table[b, p]]; any
    page size from 1. Any strides with a unit last stride (Hugging Face's (B, Hkv, S, D) cache
    passed as .transpose(1, 2) is read in place).

    cache_seqlens: int32 (B,) or an int; cache_leftpad: int32 (B,) or None (0). With k, v
    (B, Tnew, Hkv, D[v]) they are first written into the cache in place at positions
    cache_seqlens[b] .. + Tnew - 1 (nothing else in the cache is written; the caller advances
    cache_seqlens). Sequence b's keys are then positions
    cache_leftpad[b] .. L_b - 1, L_b = cache_seqlens[b] + Tnew, and query i sits at position
    L_b - Tq + i for is_causal, window_size and alibi_slopes (bottom-right). softcap, sinks,
    GQA/MQA, scale and a row that sees no key (0 output, lse -inf or the sink) as in
    `attention`. num_splits: key splits per (sequence, kv head); 0 picks them per call so
    that batch 1 fills the GPU; fp32 partials combined in a fixed order (the same inputs give
    the same bits). Under fusedattn.batch_invariant the keys are split at fixed positions
    whatever the batch, and a num_splits other than 0 is refused. Returns out (B, Tq, Hq, Dv) [, lse (B, Hq, Tq) fp32].

    FP8 caches: k_cache and v_cache in torch.float8_e4m3fn or torch.float8_e5m2 (one type for
    both), in every layout above, with k_descale and v_descale (float32, (B, Hkv) or one
    value: a stored element means stored × descale), read one byte an element and converted
    in the kernel; q in bfloat16, float16 or float32 (the output in q's dtype), or q in fp8
    with q_descale (the output bfloat16). The appended k, v (bfloat16, float16 or float32) are
    written as x / descale rounded to nearest-even, saturating at the type's largest finite
    value; NaN stays NaN (fusedattn.fp8).

    Inference only: refused (ValueError) where autograd would record, i.e. with grad mode on
    and an input that requires grad; under torch.no_grad() or inference_mode() parameters
    that require grad (GPT-OSS's sinks) are fine.

    Bad input raises before anything is written: the metadata and every refusal of the
    backend first, then the values (cache_seqlens in [0, capacity - Tnew], cache_leftpad in
    [0, cache_seqlens + Tnew], the block-table entries of the pages a sequence uses in
    [0, num_pages)). Values are checked on the CPU and by the reference and torch backends; the
    Triton kernels on a GPU skip the check (a host sync) unless FUSEDATTN_CHECK_VALUES=1, and
    never read or write outside the caches, the block table or the lengths whatever the
    values.
    """
    if invariance._enabled and num_splits != 0:  # an attribute, not a call: every step reads it
        raise ValueError(
            f"num_splits={num_splits}: fusedattn.batch_invariant is on, which splits the keys "
            f"at fixed positions itself (pass num_splits=0)"
        )
    plan_key = None
    if not tracing():  # an eager call of known metadata: its plan (plans.py)
        plan_key = plans.key(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, scale,
            is_causal, window_size, softcap, alibi_slopes, sinks, num_splits, return_lse, backend,
            q_descale, k_descale, v_descale,
        )  # fmt: skip
        plan = plans.PLANS.get(plan_key)
        if plan is not None:
            return plan(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad,
                        alibi_slopes, sinks, (q_descale, k_descale, v_descale))  # fmt: skip
    window, seqlens = check_kvcache_args(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, scale,
        is_causal, window_size, softcap, alibi_slopes, sinks, num_splits, return_lse,
        q_descale, k_descale, v_descale,
    )  # fmt: skip
    Tnew = 0 if k is None else k.shape[1]
    descales = (q_descale, k_descale, v_descale)
    inputs = _inputs(
        q, k_cache, v_cache, seqlens + Tnew if Tnew else seqlens, block_table, cache_leftpad,
        None, scale, window, softcap, alibi_slopes, sinks, num_splits, return_lse, descales,
    )  # fmt: skip
    # Every refusal, then the values, before anything is written into the caches.
    impl = backends.select("attention_with_kvcache", backend, q.device, inputs)
    check_values = values_checked(q.is_cuda, impl.backend)
    if tracing():  # torch.compile / jit.trace: the custom ops (custom_ops.py)
        return custom_ops.record(q, k_cache, v_cache, k, v, seqlens, inputs, check_values,
                                 impl.backend)  # fmt: skip
    int_seqlens = None if isinstance(cache_seqlens, torch.Tensor) else seqlens
    if impl.run is triton_backend.attention:  # the Triton backend's own (not a wrapper of it)
        plan = plans.TritonPlan(
            impl, q, k_cache, v_cache, k, v, seqlens, block_table, cache_leftpad, scale, window,
            softcap, alibi_slopes, sinks, num_splits, return_lse, check_values, int_seqlens,
            descales,
        )  # fmt: skip
    else:
        plan = plans.Plan(impl, window, scale, softcap, num_splits, return_lse,
                                check_values, int_seqlens, Tnew)  # fmt: skip
    plans.PLANS.remember(plan_key, plan)
    return plan(q, k_cache, v_cache, k, v, seqlens, block_table, cache_leftpad, alibi_slopes,
                sinks, descales)  # fmt: skip


def _inputs(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, scale, window,
            softcap, alibi_slopes, sinks, num_splits, return_lse,
            descales=NO_DESCALES) -> dict:  # fmt: skip
    q_descale, k_descale, v_descale = descales
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, seqlens_k=seqlens_k, block_table=block_table,
        cache_leftpad=cache_leftpad, key_mask=key_mask, scale=scale, window=window,
        softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks,
        num_splits=int(num_splits), return_lse=return_lse, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale,
    )  # fmt: skip


def decode_with_key_mask(q, k_cache, v_cache, key_mask, *, scale=None, is_causal=False,
                         window_size=None, softcap=0.0, sinks=None, backend="auto",
                         k_descale=None, v_descale=None):  # fmt: skip
    """One new query per sequence over a cache whose visible positions a (B, S) bool row
    gives, holes allowed (the last row of Hugging Face's decode-step mask; its (B, 1, 1, S)
    decode mask is taken as it is, read in place by the kernels): the keys run from
    the first visible position to the last, the query sits at the last, and the invisible
    positions in between are neither read nor weighed. None: every slot is visible. An fp8
    cache comes with its k_descale, v_descale (the Hugging Face fp8 caches'). Internal
    (the Hugging Face integration's); lengths stay on the device (no sync). Eager calls of
    known metadata run their plan (plans.MaskedPlan; on Triton the kernel finds the mask's
    bounds itself)."""
    plan_key = None
    if not tracing():
        plan_key = plans.masked_key(q, k_cache, v_cache, key_mask, sinks, scale, is_causal,
                                    window_size, softcap, backend, k_descale, v_descale)  # fmt: skip
        plan = plans.MASKED.get(plan_key)
        if plan is not None:
            return plan(q, k_cache, v_cache, key_mask, sinks, (None, k_descale, v_descale))
    B, S = q.shape[0], k_cache.shape[1]
    if key_mask is None:
        seqlens, leftpad = S, None
    else:
        check_tensor("key_mask", key_mask)
        shape = tuple(key_mask.shape)
        if key_mask.dtype != torch.bool or shape not in ((B, S), (B, 1, 1, S)):
            raise ValueError(f"key_mask must be (B, S) or (B, 1, 1, S) bool, B = {B}, S = {S}, "
                             f"got {shape} {key_mask.dtype}")  # fmt: skip
        if key_mask.device != q.device:
            raise ValueError(f"key_mask must be on {q.device}, got {key_mask.device}")
        if key_mask.stride(-1) != 1:  # the kernels read a row with a unit stride
            key_mask = key_mask.contiguous()
        # lengths derived on the device, valid by construction: no value check, no sync
        seqlens, leftpad = key_mask_bounds(key_mask)
    window, seqlens = check_kvcache_args(
        q, k_cache, v_cache, None, None, seqlens, None, leftpad, scale, is_causal,
        window_size, softcap, None, sinks, 0, k_descale=k_descale, v_descale=v_descale,
    )  # fmt: skip
    # the descales come from fusedattn's fp8 caches, which check given ones when they take them
    descales = (None, k_descale, v_descale)
    rows = None if key_mask is None else key_mask.view(B, S)  # the backends' (B, S) view
    inputs = _inputs(q, k_cache, v_cache, seqlens, None, leftpad, rows, scale, window,
                     softcap, None, sinks, 0, False, descales)  # fmt: skip
    impl = backends.select("attention_with_kvcache", backend, q.device, inputs)
    if tracing():
        return custom_ops.record(q, k_cache, v_cache, None, None, seqlens, inputs, False,
                                 impl.backend)  # fmt: skip
    masked = key_mask is not None
    fixed_lengths = None if masked else seqlens  # every slot: the same tensor each step
    if impl.run is triton_backend.attention:  # the Triton backend's own (not a wrapper of it)
        plan = plans.TritonMaskedPlan(impl, q, k_cache, v_cache, key_mask, sinks, window, scale,
                                      softcap, masked, fixed_lengths, descales)  # fmt: skip
    else:
        plan = plans.MaskedPlan(impl, window, scale, softcap, masked, fixed_lengths)
    plans.MASKED.remember(plan_key, plan)
    return plan.launch(q, k_cache, v_cache, key_mask, sinks, seqlens, leftpad, descales)
