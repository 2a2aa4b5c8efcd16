"""The torch backend of `fusedattn.attention` and `fusedattn.varlen_attention`: torch's SDPA
(shared/sdpa.py) on the dense call, and on a packed batch one SDPA call over the batch padded
on the device (a paged cache gathered the same way)."""

from __future__ import annotations

import torch

from ...cache_layout import paged_positions
from ...checks import (
    check_descale_values,
    check_kvcache_values,
    check_varlen_values,
    paged_key_count,
)
from ...fp8 import dequantize_heads
from ...masks import NO_WINDOW
from ..core.plans import tracing
from ..shared import sdpa
from . import reference_backend


def refusals(*, q, **inputs) -> list[str]:
    """What SDPA cannot express; an fp8 call runs in float32 (dequantized), so q's dtype
    rounds nothing. A score_mod call runs the naive dense path (below), which takes every
    variant."""
    if inputs.get("score_mod") is not None:
        return []
    if inputs.get("k_descale") is not None:
        q = q.new_empty((0,), dtype=torch.float32)
    return sdpa.refusals(q=q, **inputs)


def attention(q, k, v, attn_mask, dropout_p, scale, enable_gqa, key_padding_mask, window,
              softcap, alibi_slopes, sinks, return_lse, q_descale=None, k_descale=None,
              v_descale=None, out_dtype=None, score_mod=None):  # fmt: skip
    """SDPA (shared/sdpa.py); fp8 inputs dequantized to float32 first, the output in out_dtype
    (correct, not fast). With a score_mod (a function of every score, which SDPA cannot
    take): the naive dense attention of fusedattn.reference, products in q's dtype and the
    rest in float32, O(Tq x Tk) memory."""
    if score_mod is not None:
        return reference_backend.attention(
            q, k, v, attn_mask, dropout_p, scale, enable_gqa, key_padding_mask, window, softcap,
            alibi_slopes, sinks, return_lse, score_mod=score_mod,
            **({} if q_descale is None else dict(q_descale=q_descale, k_descale=k_descale,
                                                  v_descale=v_descale, out_dtype=out_dtype)),
        )  # fmt: skip
    if q_descale is not None:
        if not tracing():
            check_descale_values(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        q, k, v = (dequantize_heads(t, d) for t, d in ((q, q_descale), (k, k_descale),
                                                         (v, v_descale)))  # fmt: skip
        if attn_mask is not None and attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.float()
        out = sdpa.attention(q, k, v, attn_mask, dropout_p, scale, enable_gqa, key_padding_mask,
                             window, softcap, alibi_slopes, sinks, return_lse)  # fmt: skip
        return out.to(out_dtype)
    return sdpa.attention(q, k, v, attn_mask, dropout_p, scale, enable_gqa, key_padding_mask,
                          window, softcap, alibi_slopes, sinks, return_lse)  # fmt: skip


def varlen_attention(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, alibi_slopes, window,
    return_lse, dropout_p, scale, softcap, sinks, block_table=None, q_descale=None,
    k_descale=None, v_descale=None, out_dtype=None, score_mod=None,
):  # fmt: skip
    """One SDPA call over the batch gathered to (B, H, max_seqlen, D) on the device, no host
    read of the lengths (torch.compile traces it; it ran one SDPA call per sequence after a
    .tolist()): each sequence's key range and positions (bottom-right per sequence where the
    window or ALiBi asks) in one (B, 1, Tq, Tk) mask, the output gathered back to the packed
    rows. Rows past a sequence gather any row and are masked or dropped. With block_table the
    keys and values are gathered from the paged cache the same way. Eager calls check the
    prefix sums, max_seqlen (and the block table) on the host first, as the reference does."""
    lens_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    lens_k = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).long()
    if not tracing():
        total_k = None if block_table is not None else k.shape[0]
        check_varlen_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], total_k, max_seqlen_q,
                            max_seqlen_k)  # fmt: skip
        if block_table is not None:
            check_kvcache_values(lens_k, None, block_table, k, 0, paged_key_count)
        if k_descale is not None:
            check_descale_values(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    qd = _padded(q, cu_seqlens_q, max_seqlen_q)
    if block_table is None:
        kd, vd = _padded(k, cu_seqlens_k, max_seqlen_k), _padded(v, cu_seqlens_k, max_seqlen_k)
    else:
        kd, vd = (
            paged_positions(k, block_table, max_seqlen_k),
            paged_positions(v, block_table, max_seqlen_k),
        )
    if k_descale is not None:  # fp8: dequantized per sequence and head, computed in float32
        qd = qd.float() if q_descale is None else dequantize_heads(qd, q_descale)
        kd, vd = dequantize_heads(kd, k_descale), dequantize_heads(vd, v_descale)
    # Positions past a sequence gather another sequence's rows, the slack rows after the
    # last one, or whatever a page holds (NaN in an empty cache): zeroed in the gathered copy
    # (in place: it is ours), so a masked key adds exactly 0 (SDPA adds -inf to its score).
    past = (torch.arange(max_seqlen_k, device=q.device) >= lens_k[:, None])[:, None, :, None]
    kd, vd = kd.masked_fill_(past, 0.0), vd.masked_fill_(past, 0.0)
    i = torch.arange(max_seqlen_q, device=q.device)[None, :, None]
    j = torch.arange(max_seqlen_k, device=q.device)[None, None, :]
    p = i + (lens_k - lens_q)[:, None, None] if window.bottom_right else i  # query positions
    keep = j < lens_k[:, None, None]  # (B, Tq, Tk)
    if window.right >= 0:
        keep = keep & (j <= p + window.right)
    if window.left >= 0:
        keep = keep & (j >= p - window.left)
    mask = keep[:, None]
    if alibi_slopes is not None:  # float64 inputs keep a float64 bias (as masks.alibi_bias)
        compute = torch.float64 if qd.dtype == torch.float64 else alibi_slopes.dtype
        slopes = alibi_slopes.to(compute)
        slopes = slopes.reshape(-1 if slopes.dim() == 2 else 1, q.shape[1], 1, 1)
        bias = -slopes * (p - j).abs()[:, None].to(compute)
        mask = bias.to(qd.dtype).masked_fill(~mask, float("-inf"))
    if score_mod is not None:  # the padded batch: b is the sequence, q_idx and kv_idx its
        # positions
        out = reference_backend.attention(
            qd, kd, vd, mask, dropout_p, scale, q.shape[1] != k.shape[-2], None, NO_WINDOW,
            softcap, None, sinks, return_lse, score_mod=score_mod,
        )  # fmt: skip
        out, lse = out if return_lse else (out, None)
    else:
        out = sdpa.attention(
            qd, kd, vd, mask, dropout_p, scale, q.shape[1] != k.shape[-2], None, NO_WINDOW,
            softcap, None, sinks, False,
        )  # fmt: skip
    rows = torch.arange(q.shape[0], device=q.device)
    seq = torch.searchsorted(cu_seqlens_q[1:].long(), rows, right=True)
    pos = rows - cu_seqlens_q.long()[seq]
    out = out.transpose(1, 2)[seq, pos]  # (total_q, Hq, Dv)
    out = out.to(q.dtype if out_dtype is None else out_dtype)  # fp8: from float32
    if score_mod is not None and return_lse:  # (Hq, total_q), as the kernels lay it out
        return out, lse[seq, :, pos].transpose(0, 1)
    return out


def _padded(x: torch.Tensor, cu_seqlens: torch.Tensor, T: int) -> torch.Tensor:
    """Packed (total, H, D) rows -> (B, H, T, D): sequence b's rows first, then any rows (the
    caller masks them)."""
    B = cu_seqlens.shape[0] - 1
    if x.shape[0] == 0:  # zeros, still connected to x for autograd (fp8: no autograd)
        zeros = x.new_zeros(B, x.shape[1], T, x.shape[2])
        return zeros if x.element_size() == 1 else zeros + x.sum()
    index = (cu_seqlens[:-1].long()[:, None] + torch.arange(T, device=x.device)).clamp(
        max=x.shape[0] - 1
    )
    return x[index].transpose(1, 2)
