"""`fusedattn.attention` and `fusedattn.varlen_attention`: the attention family's public
functions and their dispatch (validation, the float-mask shift, the plan of an eager call, the
backend).

The family's files: this one (public functions, the backends' registration), plans.py (the
eager calls' plans), reference_backend.py, torch_backend.py, triton_backend.py,
cuda_backend.py (each backend's runs and refusals), custom_ops.py (the kernel backends'
forward and backward as torch.library ops, autograd, and the paged prefill's op),
triton_args.py and cuda_args.py (what each kernel backend is handed).
"""

from __future__ import annotations

import torch

from ...autocast import apply_autocast
from ...block_mask import as_block_mask
from ...checks import check_attention_args, check_varlen_args
from ...fp8 import is_fp8, output_dtype
from ...masks import shift_float_mask, visible_keys
from ...score_mod import prepare as prepare_score_mod
from ..core import backends
from ..core.plans import tracing
from . import (
    cuda_backend,
    custom_ops,
    flex,
    plans,
    reference_backend,
    torch_backend,
    triton_backend,
)

backends.register("attention", "reference", reference_backend.attention, backends.no_refusals)
backends.register("attention", "torch", torch_backend.attention, torch_backend.refusals)
backends.register("attention", "triton", triton_backend.attention, triton_backend.refusals)
backends.register("attention", "cuda", cuda_backend.attention, cuda_backend.refusals)
backends.register("varlen_attention", "reference", reference_backend.varlen_attention,
                  backends.no_refusals)  # fmt: skip
backends.register("varlen_attention", "torch", torch_backend.varlen_attention,
                  torch_backend.refusals)  # fmt: skip
backends.register("varlen_attention", "triton", triton_backend.varlen_attention,
                  triton_backend.refusals)  # fmt: skip
backends.register("varlen_attention", "cuda", cuda_backend.attention,
                  cuda_backend.varlen_refusals)  # fmt: skip


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    key_padding_mask: torch.Tensor | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    causal_alignment: str = "top_left",
    return_lse: bool = False,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    block_mask=None,
    score_mod=None,
    backend: str = "auto",
):
    """Masked multi-head scaled-dot-product attention, SDPA's layout and mask conventions.

    q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv); attn_mask bool (True = may
    attend) or float (added to the scores), broadcastable to (B, Hq, Tq, Tk);
    key_padding_mask bool (B, Tk), True = padding key.

    Positions: query i sits at key position p = i (causal_alignment="top_left", SDPA) or
    p = i + Tk - Tq ("bottom_right", flash-attention / KV-cache decoding); is_causal shows it
    keys j <= p; window_size=(left, right) keys p - left <= j <= p + right (-1 = unbounded).
    Scores: s = scale·q·k, softcap·tanh(s / softcap) if softcap > 0, then -slope·|p - j| for
    alibi_slopes ((Hq,) or (B, Hq) float32), then the float mask. sinks ((Hq,)) adds one
    logit per head to every row's normaliser. Returns out (B, Hq, Tq, Dv), and lse
    (B, Hq, Tq) float32 when return_lse=True. A query that sees no key gives 0 output,
    0 gradients and lse = -inf (the sink with sinks). A float mask's finite values are
    finite, however large: without sinks each row is shifted by its largest mask entry
    over the keys it can see (key padding, causal, window) before any backend runs (the same softmax; masks.shift_float_mask), so a row masked
    with -1e9 or finfo.min on every key gives the softmax of its scores.

    block_mask: a torch.nn.attention.flex_attention.BlockMask or a fusedattn.masks.BlockMask
    (fusedattn.masks.create_block_mask, no compile): query i of batch b and head h sees key j
    iff mask_mod(b, h, i, j), ANDed with every other mask of the call; a mask built with B or
    H None applies to all. The Triton kernels visit only the blocks it lists (forward and
    backward); the reference and torch backends run its dense form (O(Tq x Tk) memory); the
    CUDA backend refuses it. A torch BlockMask is converted once and kept with the object.

    score_mod: FlexAttention's score_mod(score, b, h, q_idx, kv_idx) -> score, applied to
    each score scale·q·k (float32; h the query head) before softcap, ALiBi, the float mask
    and the masks (a hidden key stays hidden whatever the mod returns). Traced once per
    structure into a Triton function the kernels call per tile (no compile; captured tensors
    read by pointer, their gradients computed); the reference and torch backends run it
    densely (O(Tq x Tk)); CUDA refuses it. What it may contain: docs/block_masks.md.

    FP8 (inference): q, k, v in torch.float8_e4m3fn with q_descale, k_descale, v_descale
    (float32, (B, Hkv) or one value: a stored element means stored × descale); the products
    on fp8 tensor cores, the output in out_dtype (bfloat16 by default; float16 or float32),
    the lse in float32. P is rounded to float8_e4m3fn for the P·V product, as
    flash-attention 3 does (its error: docs/api.md). Refused where a gradient would be
    needed, and with dropout.
    """
    plan_key = bm = mod = None
    fp8 = q_descale is not None or out_dtype is not None
    fp8 = fp8 or k_descale is not None or v_descale is not None
    flex_call = block_mask is not None or score_mod is not None
    if not tracing():  # an eager call of known metadata: its plan
        plan_key = plans.key(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
                             key_padding_mask, window_size, softcap, alibi_slopes, sinks,
                             causal_alignment, return_lse, backend)  # fmt: skip
        if flex_call:  # no fp8 plans: an fp8 flex call takes the full path
            plan_key, bm, mod = plans.flex_key(None if fp8 else plan_key, q, attn_mask,
                                               block_mask, score_mod)  # fmt: skip
            plan = plans.PLANS.get(plan_key)
            if plan is not None:
                return plan(q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, bm, mod)
        else:
            if fp8:
                plan_key = plans.fp8_key(plan_key, q_descale, k_descale, v_descale, out_dtype)
            plan = plans.PLANS.get(plan_key)
            if plan is not None:
                return plan(q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks,
                            (q_descale, k_descale, v_descale))  # fmt: skip
    inputs, shift = _checked_inputs(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
        key_padding_mask=key_padding_mask, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, causal_alignment=causal_alignment,
        return_lse=return_lse, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
        out_dtype=out_dtype,
    )  # fmt: skip
    if flex_call:
        return _flex_call(inputs, shift, block_mask, score_mod, backend, return_lse, plan_key,
                          mod)  # fmt: skip
    impl = backends.select("attention", backend, q.device, inputs)
    if plan_key is not None:
        plan = plans.AttentionPlan(impl, inputs)
        plans.PLANS.remember(plan_key, plan)
        return _shifted(plan.run(inputs), shift, return_lse)
    return _shifted(impl.run(**inputs), shift, return_lse)


def _flex_call(inputs, shift, block_mask, score_mod, backend, return_lse, plan_key=None,
               mod=None):  # fmt: skip
    """attention() with a block mask or a score_mod (FlexAttention's two halves), its
    arguments checked (_checked_inputs): the Triton kernels (the listed blocks, the mod per
    tile), or on the reference and torch backends the dense mask and the mod on every
    score. plan_key, mod: plans.flex_key's (None: not planned, or not looked up); a Triton
    call that succeeds leaves its plan under the key."""
    q = inputs["q"]
    bm = None if block_mask is None else check_block_mask(block_mask, q, inputs["k"])
    if mod is None and score_mod is not None:
        mod = prepare_score_mod(score_mod, q.device)
    backend = flex_backend(backend, q, block_mask, score_mod)
    if mod is not None:
        inputs["score_mod"] = mod
    impl = backends.select("attention", backend, q.device, inputs)
    if impl.backend == "triton":
        inputs.pop("enable_gqa")
        if plan_key is None:
            return _shifted(flex.run(block_mask=bm, **inputs), shift, return_lse)
        plan = plans.FlexPlan(impl, inputs, bm, mod)
        result = _shifted(plan.run(inputs, bm), shift, return_lse)
        plans.PLANS.remember(plan_key, plan)  # after the call: a refusal inside leaves none
        return result
    if impl.backend == "cuda":  # only through FUSEDATTN_BACKEND: the argument is refused above
        raise ValueError(f"{_flex_names(block_mask, score_mod)}: the CUDA attention has no "
                         "kernel for it; use backend='triton' (or 'auto')")  # fmt: skip
    if bm is not None:
        inputs["attn_mask"] = flex.merge_dense(inputs["attn_mask"], bm)
    return _shifted(impl.run(**inputs), shift, return_lse)


def _flex_names(block_mask, score_mod) -> str:
    return " and ".join(n for n, x in (("block_mask", block_mask), ("score_mod", score_mod))
                        if x is not None)  # fmt: skip


def flex_backend(backend: str, q: torch.Tensor, block_mask, score_mod) -> str:
    """The backend a block-mask or score_mod call asks for: CUDA refused by name; auto the
    Triton kernels on a GPU (they skip what the mask hides and run the mod in the tile),
    torch's dense path off one."""
    if backend == "cuda":
        raise ValueError(f"{_flex_names(block_mask, score_mod)}: the CUDA attention has no "
                         "kernel for it; use backend='triton' (or 'auto')")  # fmt: skip
    if backend == "auto":
        return "triton" if q.is_cuda else "auto"
    return backend


def _checked_inputs(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, *,
                    key_padding_mask, window_size, softcap, alibi_slopes, sinks,
                    causal_alignment, return_lse, q_descale, k_descale, v_descale, out_dtype):  # fmt: skip
    """A call's autocast, every argument check and the float-mask shift: (the keyword
    arguments every backend takes, the shift the lse gets back, or None)."""
    cast = apply_autocast("attention", dict(q=q, k=k, v=v, attn_mask=attn_mask))
    q, k, v, attn_mask = cast["q"], cast["k"], cast["v"], cast["attn_mask"]
    window = check_attention_args(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        causal_alignment=causal_alignment, return_lse=return_lse, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )  # fmt: skip
    shift = None
    if attn_mask is not None and sinks is None:  # exact, and a large offset kept exact
        visible = visible_keys(key_padding_mask, window, q.shape[2], k.shape[2], q.device)
        attn_mask, shift = shift_float_mask(attn_mask, visible)
    inputs = dict(
        q=q, k=k, v=v, attn_mask=attn_mask, dropout_p=float(dropout_p), scale=scale,
        enable_gqa=enable_gqa, key_padding_mask=key_padding_mask, window=window,
        softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse,
    )  # fmt: skip
    if is_fp8(q):
        inputs.update(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                      out_dtype=output_dtype(q, out_dtype))  # fmt: skip
    return inputs, shift


def _shifted(result, shift, return_lse):
    """The result with the float-mask shift given back to its lse."""
    if return_lse and shift is not None:
        out, lse = result
        return out, lse + shift.float()
    return result


def _varlen_flex(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                 scale, window, softcap, alibi_slopes, sinks, return_lse, score_mod, **fp8):  # fmt: skip
    """varlen_attention with a score_mod on the Triton kernels (flex.py)."""
    return flex.run(q, k, v, None, dropout_p, scale, None, window, softcap, alibi_slopes, sinks,
                    return_lse, score_mod=score_mod, cu_seqlens_q=cu_seqlens_q,
                    cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                    max_seqlen_k=max_seqlen_k, **fp8)  # fmt: skip


def check_block_mask(block_mask, q: torch.Tensor, k: torch.Tensor):
    """The kernels' form (block_mask.KernelBlocks) of the call's block mask on q's device;
    ValueError naming block_mask where its sizes are not the call's."""
    bm = as_block_mask(block_mask, q.device)
    B, H, Tq = q.shape[:3]
    Tk = k.shape[2]
    if tuple(bm.seq_lengths) != (Tq, Tk):
        raise ValueError(
            f"block_mask was built for (Q_LEN, KV_LEN) = {tuple(bm.seq_lengths)}, the call has "
            f"(Tq, Tk) = ({Tq}, {Tk})"
        )
    Bm, Hm = bm.kv_lists.shape[:2]
    if Bm not in (1, B) or Hm not in (1, H):
        raise ValueError(
            f"block_mask was built for B={Bm}, H={Hm}; the call has B={B} and {H} query heads "
            "(build it with B or H None to apply it to all)"
        )
    return bm


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    causal_alignment: str = "top_left",
    return_lse: bool = False,
    block_table: torch.Tensor | None = None,
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    score_mod=None,
    backend: str = "auto",
):
    """Attention over a packed batch of variable-length sequences, no padding computed.

    q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv); grouped-query attention
    (Hq a multiple of Hkv) with enable_gqa=True, as in `attention`; cu_seqlens_q/k int32
    (B + 1,) prefix sums: sequence b is rows cu[b]:cu[b + 1] (cu[0] = 0, cu[B] = total);
    max_seqlen_q/k bound every sequence's length. The kernels trust cu_seqlens and max_seqlen
    (reading them would cost a device sync): as in flash-attention, a cu_seqlens past the
    packed rows reads out of bounds, a max_seqlen below a length leaves rows unwritten; the
    reference and torch backends check both. Every option of `attention` (positions per sequence, windows,
    softcap, ALiBi, sinks, dropout) applies. Returns (total_q, Hq, Dv) [, lse (Hq, total_q)
    float32]. The reference backend runs one sequence at a time (reading cu_seqlens to the
    host), the torch backend one SDPA call over the batch padded on the device; the Triton
    kernels take the packed batch in one launch.

    Paged prefill (chunked prefill, prefix-cache hits, as flash-attention's
    `flash_attn_varlen_func(..., block_table=...)`): with block_table (B, max_pages) int32, k
    and v are a paged cache (num_pages, page_size, Hkv, D[v]) and sequence b's keys are its
    first cu_seqlens_k[b + 1] - cu_seqlens_k[b] cache positions (page p of sequence b is
    k[block_table[b, p]]; any page size from 1); its queries are the last of them, so
    is_causal, window_size and alibi_slopes need causal_alignment="bottom_right". Inference
    only (no dropout, refused where autograd would record). The Triton backend reads the
    pages in place (the split-key decode kernel with packed queries), the torch and reference
    backends gather them; values (prefix sums, key counts within the cache's capacity,
    block-table entries) are checked on the host there, as for attention_with_kvcache.

    FP8: q, k, v in torch.float8_e4m3fn as in `attention` (descales per sequence and KV
    head); a paged cache in either fp8 type (k_descale, v_descale) under a bfloat16, float16
    or float32 q (the output in q's dtype) or an fp8 q (q_descale; the output bfloat16 or
    out_dtype), as attention_with_kvcache reads it.

    score_mod: as in `attention`, with b the sequence's number and q_idx, kv_idx the query's
    and the key's positions in their sequence (the Triton kernels, or the reference and
    torch backends per sequence); not with block_table (a paged prefill).
    """
    cast = apply_autocast("attention", dict(q=q, k=k, v=v))
    q, k, v = cast["q"], cast["k"], cast["v"]
    window = check_varlen_args(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal,
        scale, enable_gqa, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, causal_alignment=causal_alignment,
        block_table=block_table, return_lse=return_lse, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )  # fmt: skip
    inputs = dict(
        q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=int(max_seqlen_q), max_seqlen_k=int(max_seqlen_k),
        dropout_p=float(dropout_p), scale=scale, window=window,
        softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks, return_lse=return_lse,
    )  # fmt: skip
    if block_table is not None:
        if score_mod is not None:
            raise ValueError("score_mod: varlen_attention over a paged cache (block_table) "
                             "runs the decode kernels, which take no score_mod")  # fmt: skip
        inputs["block_table"] = block_table
    if is_fp8(k):  # out_dtype: an fp8 q's output (a paged fp8 cache under q keeps q's)
        inputs.update(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale,
                      out_dtype=output_dtype(q, out_dtype) if is_fp8(q) else None)  # fmt: skip
    if score_mod is not None:
        inputs["score_mod"] = prepare_score_mod(score_mod, q.device)
        backend = flex_backend(backend, q, None, score_mod)
    impl = backends.select("varlen_attention", backend, q.device, inputs)
    if score_mod is not None and impl.backend == "triton":
        return _varlen_flex(**inputs)
    if block_table is not None and tracing():  # the whole call as one op (custom_ops.py)
        return custom_ops.record_paged_varlen(inputs, impl.backend)
    return impl.run(**inputs)
