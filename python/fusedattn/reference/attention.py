"""Naive O(T²) attention: the plain-torch twin of `fusedattn.attention` and
`fusedattn.varlen_attention`, every variant included.

It materialises the (B, H, Tq, Tk) scores, which is what the fused kernels avoid: it is the
correctness reference and the baseline that the benchmarks beat. Matmuls run in the input dtype
(what naive PyTorch code does); everything after the product (softcap, ALiBi, masks, softmax,
sinks) runs in fp32 (fp64 kept).
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.nn.functional as F

from ..cache_layout import packed_rows
from ..checks import (
    check_attention_args,
    check_descale_values,
    check_kvcache_values,
    check_varlen_args,
    check_varlen_values,
    paged_key_count,
)
from ..fp8 import dequantize_heads, dequantize_packed, is_fp8, output_dtype
from ..masks import (
    NO_WINDOW,
    Window,
    alibi_bias,
    make_window,
    merge_masks,
    shift_float_mask,
    visible_keys,
)
from .softmax import safe_softmax


def expand_kv_heads(t: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """Repeat k or v heads for grouped-query attention: q head h reads kv head h // group."""
    group = num_q_heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def apply_score_mod(score_mod, scores: torch.Tensor) -> torch.Tensor:
    """FlexAttention's score_mod(score, b, h, q_idx, kv_idx) on (B, H, Tq, Tk) scores, every
    score at once: b, h, q_idx and kv_idx are int32 index tensors that broadcast against them.
    Torch's semantics and autograd, O(Tq·Tk) memory: what a vmap of the mod computes,
    without the vmap."""
    B, H, Tq, Tk = scores.shape

    def index(n, dim):
        shape = [1, 1, 1, 1]
        shape[dim] = n
        return torch.arange(n, device=scores.device, dtype=torch.int32).view(shape)

    out = score_mod(scores, index(B, 0), index(H, 1), index(Tq, 2), index(Tk, 3))
    return torch.as_tensor(out, device=scores.device).to(scores.dtype).expand(B, H, Tq, Tk)


def attention_scores(
    q, k, attn_mask=None, is_causal=False, scale=None, *, key_padding_mask=None, window=None,
    softcap=0.0, alibi_slopes=None, score_mod=None,
) -> torch.Tensor:  # fmt: skip
    """(B, Hq, Tq, Tk) scores with every mask applied (-inf where hidden), fp32/fp64:
    scale·q·k, the score_mod (Flex's, on scale·q·k), softcap, ALiBi, the float mask added;
    padding, bool mask and the positional `window` (default: top-left causal if is_causal)
    exclude."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    compute = _compute_dtype(q.dtype)
    Tq, Tk = q.shape[-2], k.shape[-2]
    k = expand_kv_heads(k, q.shape[1])
    # The product in fp32 from the input-dtype values: rounding the scores to fp16/bf16 (what
    # naive half code does) costs up to half an ulp of |s| per score, 0.016 at |s| = 45 in
    # fp16, which made this reference 3.4x less accurate than naive fp16 PyTorch on
    # flash-attention's overflow test (q·5, k·3, D=32). The kernels keep their scores in fp32.
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * scale
    if score_mod is not None:
        scores = apply_score_mod(score_mod, scores)
    if softcap > 0.0:
        scores = softcap * torch.tanh(scores / softcap)
    if window is None:
        window = Window(-1, 0) if is_causal else NO_WINDOW
    if alibi_slopes is not None:
        scores = scores + alibi_bias(
            alibi_slopes, Tq, Tk, bottom_right=window.bottom_right, dtype=compute
        )
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        # before the merge: the mask's gradient is then reduced over its broadcast in fp32
        attn_mask = attn_mask.to(compute)
    mask = merge_masks(attn_mask, key_padding_mask, False, Tq, Tk, q.device, window=window)
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask


def attention_p_rounded(
    q, k, v, *, is_causal=False, window_size=None, causal_alignment="top_left", scale=None,
    softcap=0.0, key_padding_mask=None, alibi_slopes=None, sinks=None, p_shift=8.0,
) -> torch.Tensor:  # fmt: skip
    """The fp8 forward's yardstick (docs/api.md, "FP8"): naive attention in float32 on q, k, v
    as given (an fp8 call's dequantized values, (B, H, T, D), GQA by head count), computing
    as the Triton kernel does: P = exp(s - m) scaled by 2^p_shift and rounded to
    float8_e4m3fn for P·V, the normaliser the unrounded sum (a sink joins the max and the
    sum). Returns float32 (B, Hq, Tq, Dv)."""
    Tq, Tk = q.shape[-2], k.shape[-2]
    window = make_window(is_causal, window_size, causal_alignment, Tq, Tk)
    s = attention_scores(q.float(), k.float(), scale=scale, key_padding_mask=key_padding_mask,
                         window=window, softcap=softcap, alibi_slopes=alibi_slopes)  # fmt: skip
    m = s.amax(-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.float()[:, None, None])
    m = m.nan_to_num(0.0, neginf=0.0)  # a row that sees nothing
    p = torch.exp(s - m) * 2.0**p_shift
    total = p.sum(-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sinks.float()[:, None, None] - m) * 2.0**p_shift
    rounded = p.to(torch.float8_e4m3fn).float()
    out = torch.matmul(rounded, expand_kv_heads(v.float(), q.shape[1]))
    return out / torch.where(total == 0, 1.0, total)


def log_sum_exp(scores: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Row log-sum-exp in `dtype` (fp32, the API's; float64 for context parallelism's float64
    merge); -inf (with zero gradient) for a row that sees no key."""
    if scores.shape[-1] == 0:
        return scores.new_full(scores.shape[:-1], float("-inf")).to(dtype)
    dead = scores.detach().amax(-1) == float("-inf")
    lse = torch.logsumexp(scores.masked_fill(dead.unsqueeze(-1), 0.0), dim=-1)
    return lse.masked_fill(dead, float("-inf")).to(dtype)


def attention(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False, *,
    key_padding_mask=None, window_size=None, softcap=0.0, alibi_slopes=None, sinks=None,
    causal_alignment="top_left", return_lse=False, q_descale=None, k_descale=None,
    v_descale=None, out_dtype=None, score_mod=None,
):  # fmt: skip
    """softmax(scores)·v with SDPA's conventions and every variant; see `fusedattn.attention`.

    fp8 q, k, v (with their descales) are dequantized to float32 first and the output is
    out_dtype (bfloat16 by default).

    With sinks, each head's sink logit joins the row's normaliser (a column whose value is
    0). A query row with no visible key gives 0 output, 0 gradients and lse = -inf (the sink
    with sinks). Without sinks a float mask is shifted per row by its largest entry over the
    keys the row can see first
    (masks.shift_float_mask: the same function, computed without rounding a large common
    offset away; the lse gets the shift back), as every backend does.
    """
    window = check_attention_args(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        causal_alignment=causal_alignment, return_lse=return_lse, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )  # fmt: skip
    if is_fp8(q):
        dtype = output_dtype(q, out_dtype)
        q, k, v = (dequantize_heads(t, d) for t, d in ((q, q_descale), (k, k_descale),
                                                         (v, v_descale)))  # fmt: skip
        result = attention(
            q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa,
            key_padding_mask=key_padding_mask, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, causal_alignment=causal_alignment,
            return_lse=return_lse, score_mod=score_mod,
        )  # fmt: skip
        return (result[0].to(dtype), result[1]) if return_lse else result.to(dtype)
    if key_padding_mask is not None:  # a padded key never contributes, even a NaN in it
        pad = key_padding_mask[:, None, :, None]
        k, v = k.masked_fill(pad, 0.0), v.masked_fill(pad, 0.0)  # k too: dq sums dS * k
    shift = None
    if attn_mask is not None and sinks is None:
        visible = visible_keys(key_padding_mask, window, q.shape[2], k.shape[2], q.device)
        attn_mask, shift = shift_float_mask(attn_mask, visible)
    scores = attention_scores(
        q, k, attn_mask, scale=scale, key_padding_mask=key_padding_mask, window=window,
        softcap=float(softcap), alibi_slopes=alibi_slopes, score_mod=score_mod,
    )  # fmt: skip
    if sinks is not None:
        B, Hq, Tq, _ = scores.shape
        sink = sinks.to(scores.dtype)[None, :, None, None].expand(B, Hq, Tq, 1)
        scores = torch.cat([scores, sink], dim=-1)
    probs = safe_softmax(scores, dim=-1)
    if sinks is not None:
        probs = probs[..., :-1]
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(probs.to(v.dtype), expand_kv_heads(v, q.shape[1]))
    if not return_lse:
        return out
    lse = log_sum_exp(scores)
    return out, lse if shift is None else lse + shift.float()


def varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
    is_causal=False, scale=None, enable_gqa=False, *, window_size=None, softcap=0.0, alibi_slopes=None,
    sinks=None, causal_alignment="top_left", return_lse=False, block_table=None, q_descale=None,
    k_descale=None, v_descale=None, out_dtype=None, score_mod=None,
):  # fmt: skip
    """Packed variable-length attention, one sequence at a time through `attention`; see
    `fusedattn.varlen_attention`. With block_table, k and v are a paged cache: sequence b's
    keys are its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions, gathered page by page
    (the values checked first). fp8 inputs are dequantized to float32 (a paged cache after
    its gather: each sequence's descale). Returns (total_q, Hq, Dv) [, lse (Hq, total_q)
    fp32]."""
    check_varlen_args(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, is_causal,
        scale, enable_gqa, window_size=window_size, softcap=softcap,
        alibi_slopes=alibi_slopes, sinks=sinks, causal_alignment=causal_alignment,
        block_table=block_table, return_lse=return_lse, q_descale=q_descale,
        k_descale=k_descale, v_descale=v_descale, out_dtype=out_dtype,
    )  # fmt: skip
    if block_table is not None:
        k, v = gather_pages(k, v, cu_seqlens_q, cu_seqlens_k, q.shape[0], max_seqlen_q,
                            max_seqlen_k, block_table)  # fmt: skip
    if is_fp8(k):
        check_descale_values(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        dtype = output_dtype(q, out_dtype)
        q = dequantize_packed(q, q_descale, cu_seqlens_q) if is_fp8(q) else q.float()
        k = dequantize_packed(k, k_descale, cu_seqlens_k)
        v = dequantize_packed(v, v_descale, cu_seqlens_k)
        result = varlen_attention(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
            is_causal, scale, enable_gqa, window_size=window_size, softcap=softcap,
            alibi_slopes=alibi_slopes, sinks=sinks, causal_alignment=causal_alignment,
            return_lse=return_lse, score_mod=score_mod,
        )  # fmt: skip
        return (result[0].to(dtype), result[1]) if return_lse else result.to(dtype)
    kwargs = {} if score_mod is None else dict(score_mod=score_mod)  # with b its sequence's
    return per_sequence(
        attention, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        alibi_slopes, return_lse,
        dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=q.shape[1] != k.shape[1], window_size=window_size, softcap=softcap,
        sinks=sinks, causal_alignment=causal_alignment, **kwargs,
    )  # fmt: skip


def gather_pages(k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, total_q, max_seqlen_q,
                 max_seqlen_k, block_table):  # fmt: skip
    """Packed (total_k, Hkv, D[v]) keys and values of a paged cache: sequence b's first
    cu_seqlens_k[b + 1] - cu_seqlens_k[b] positions, in order. The prefix sums, lengths and
    block-table entries are checked on the host first (ValueError)."""
    _, bounds = check_varlen_values(cu_seqlens_q, cu_seqlens_k, total_q, None, max_seqlen_q,
                                    max_seqlen_k)  # fmt: skip
    lengths = [b - a for a, b in itertools.pairwise(bounds)]
    check_kvcache_values(torch.tensor(lengths, dtype=torch.int32), None, block_table, k_cache,
                         0, paged_key_count)  # fmt: skip
    return packed_rows(k_cache, block_table, lengths), packed_rows(v_cache, block_table, lengths)


def _offset_batch(score_mod, b: int):
    """score_mod for a batch of one that is sequence b of a packed batch."""

    def offset(score, batch, head, q_idx, kv_idx):
        return score_mod(score, batch + b, head, q_idx, kv_idx)

    return offset


def per_sequence(dense_attention, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                 max_seqlen_k, alibi_slopes, return_lse, **kwargs):  # fmt: skip
    """A packed batch through a dense (B, H, T, D) attention, one sequence at a time (the
    sequence bounds are read to the host: reference and torch backends only)."""
    bounds_q, bounds_k = check_varlen_values(
        cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k
    )
    outs, lses = [], []
    for b in range(len(bounds_q) - 1):
        qs = q[bounds_q[b] : bounds_q[b + 1]].transpose(0, 1).unsqueeze(0)
        ks = k[bounds_k[b] : bounds_k[b + 1]].transpose(0, 1).unsqueeze(0)
        vs = v[bounds_k[b] : bounds_k[b + 1]].transpose(0, 1).unsqueeze(0)
        slopes = alibi_slopes
        if slopes is not None and slopes.dim() == 2:
            slopes = slopes[b]
        call = kwargs
        if kwargs.get("score_mod") is not None:  # sequence b's mod sees b
            call = dict(kwargs, score_mod=_offset_batch(kwargs["score_mod"], b))
        res = dense_attention(qs, ks, vs, alibi_slopes=slopes, return_lse=return_lse, **call)
        out, lse = res if return_lse else (res, None)
        outs.append(out[0].transpose(0, 1))
        if return_lse:
            lses.append(lse[0])
    Hq, Dv = q.shape[1], v.shape[-1]
    if not outs:  # no sequence: a batch of 0 through the dense op, so autograd sees the inputs
        res = dense_attention(*(t.transpose(0, 1)[None, :, :0][:0] for t in (q, k, v)),
                              alibi_slopes=alibi_slopes, return_lse=return_lse, **kwargs)  # fmt: skip
        out, lse = res if return_lse else (res, None)
        outs = [out.reshape(0, Hq, Dv)]
        lses = [] if lse is None else [lse.reshape(Hq, 0)]
    out = torch.cat(outs)
    return (out, torch.cat(lses, dim=-1)) if return_lse else out
