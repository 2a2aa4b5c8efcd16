"""torch's F.scaled_dot_product_attention wrapped to fusedattn's semantics: the torch backend of
every attention op (dense, packed, KV-cache decoding and the paged prefill) runs its SDPA call
here, with the masks and variants folded into the one mask SDPA takes, and the refusals of what
SDPA cannot express (the same for every op)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...masks import alibi_bias, merge_masks

HALF = (torch.float16, torch.bfloat16)


def refusals(*, q, return_lse, softcap, alibi_slopes, sinks, **_inputs) -> list[str]:
    reasons = []
    if return_lse:
        reasons.append("torch's scaled_dot_product_attention does not return the log-sum-exp")
    if softcap > 0.0:
        reasons.append(
            "torch's scaled_dot_product_attention cannot apply softcap (a tanh of the scores)"
        )
    if q.dtype in HALF and alibi_slopes is not None:
        reasons.append(
            f"ALiBi reaches torch's scaled_dot_product_attention only as a mask in q's dtype "
            f"({q.dtype}), which rounds -slope·|i - j| (by up to 0.4% in bfloat16)"
        )
    if q.dtype in HALF and sinks is not None and sinks.dtype != q.dtype:
        reasons.append(
            f"sinks reach torch's scaled_dot_product_attention only as a mask column in q's "
            f"dtype ({q.dtype}), which would round the {sinks.dtype} sinks"
        )
    return reasons


def attention(
    q, k, v, attn_mask, dropout_p, scale, enable_gqa, key_padding_mask, window, softcap,
    alibi_slopes, sinks, return_lse,
):  # fmt: skip
    """F.scaled_dot_product_attention with our masks and variants folded into the one mask it
    takes, built once: key padding and the positional window as a bool mask, ALiBi as a float
    bias, each sink as one more key of value 0 whose score is the sink (q·0 + sink: exact).
    Around a direct SDPA call with the same mask, an inference call with key padding adds no
    kernel (the mask's `~` is the one a user writes too); a call that records a backward adds
    one pass over the output where a row could see no key (tests/test_torch_backend.py
    counts them)."""
    B, Hq, Tq, _ = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    # A padded key gets probability 0 through the mask, as SDPA masks it; K and V are not
    # copied to zero the padded rows (two K/V-sized writes per call, issue #70), so a NaN or
    # inf stored at a padded position reaches the output here as it does in SDPA itself
    # (docs/backends.md). The reference and the kernels never read those rows.
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)  # SDPA's dtype, converted before any broadcast
    # SDPA's own is_causal only for causal alone, with a positive scale: its CPU flash kernel
    # returns NaN for is_causal with scale <= 0 (seen with torch 2.14).
    is_causal = (
        window.is_top_left_causal
        and attn_mask is None
        and key_padding_mask is None
        and alibi_slopes is None
        and sinks is None
        and (scale is None or scale > 0)
    )
    mask = None
    if not is_causal:
        mask = merge_masks(attn_mask, key_padding_mask, False, Tq, Tk, q.device, window=window)
    if alibi_slopes is not None:
        bias = alibi_bias(alibi_slopes, Tq, Tk, bottom_right=window.bottom_right, dtype=q.dtype)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = mask + bias
    if sinks is not None:
        k = torch.cat([k, k.new_zeros(B, Hkv, 1, k.shape[-1])], dim=2)
        v = torch.cat([v, v.new_zeros(B, Hkv, 1, v.shape[-1])], dim=2)
        if mask is None:
            mask = q.new_zeros(Tq, Tk)
        elif mask.dtype == torch.bool:
            mask = q.new_zeros(mask.shape).masked_fill(~mask, float("-inf"))
        shape = torch.broadcast_shapes(mask.shape, (1, Hq, Tq, Tk))
        sink = sinks.to(q.dtype)[None, :, None, None].expand(shape[0], Hq, Tq, 1)
        mask = torch.cat([mask.expand(shape), sink], dim=-1)
    if mask is not None and mask.dim() < 2:  # SDPA needs (..., Tq, Tk)
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    # Rows that see no key: SDPA's forward gives them 0, but its cuDNN backward returned NaN
    # gradients for them (H100, torch 2.11). When a backward can run, they attend to every key
    # instead and their output is zeroed, which makes every gradient through them exactly 0 (a
    # sink column keeps every row alive). One more pass over the mask, only then: inference
    # calls pay nothing.
    dead = None
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, attn_mask)
    )
    if mask is not None and sinks is None and grads:
        live = mask if mask.dtype == torch.bool else mask != float("-inf")
        dead = ~live.any(-1, keepdim=True)
        mask = mask | dead if mask.dtype == torch.bool else mask.masked_fill(dead, 0.0)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
        enable_gqa=enable_gqa,
    )  # fmt: skip
    return out if dead is None else out.masked_fill(dead, 0.0)
