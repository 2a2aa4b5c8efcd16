"""torch's F.scaled_dot_product_attention wrapped to fusedattn's semantics: the torch backend of
every attention op (dense, packed, KV-cache decoding and the paged prefill) runs its SDPA call
here, with the masks and variants folded into the one mask SDPA takes, and the refusals of what
SDPA cannot express (the same for every op)."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ...masks import alibi_bias, merge_masks
from ..core.plans import tracing

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
    takes, built once: the positional window as a bool mask, ALiBi as a float bias, each sink
    as one more key of value 0 whose score is the sink (q·0 + sink: exact).

    A padded key's content never reaches the output or a gradient (SDPA masks by adding
    -inf, and a NaN or inf key or value there turns the whole row into NaN): where each
    sequence's real keys are one run (right or left padding, or none) and the mask sits on
    the host, each run of sequences with the same key range gets one SDPA call on views of
    its keys, no copy; masks with holes, traced calls and GPU masks (reading them would sync)
    zero the padded rows of K and V in a copy first (tests/test_torch_backend.py counts the
    ops of each way)."""
    Tq, Tk = q.shape[2], k.shape[2]
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
    ranges = None if key_padding_mask is None else key_ranges(key_padding_mask)
    if key_padding_mask is not None and ranges is None:  # holes, a trace or a GPU mask
        padded = key_padding_mask[:, None, :, None]
        k, v = k.masked_fill(padded, 0.0), v.masked_fill(padded, 0.0)
    mask = None
    if not is_causal:
        padding = key_padding_mask if ranges is None else None  # views leave the padding out
        mask = merge_masks(attn_mask, padding, False, Tq, Tk, q.device, window=window)
    if alibi_slopes is not None:
        bias = alibi_bias(alibi_slopes, Tq, Tk, bottom_right=window.bottom_right, dtype=q.dtype)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = mask + bias
    if mask is not None and mask.dim() < 2:  # SDPA needs (..., Tq, Tk)
        mask = mask.reshape((1,) * (2 - mask.dim()) + tuple(mask.shape))
    call = (dropout_p, is_causal, scale, enable_gqa, sinks)
    if ranges is None or ranges == [(0, q.shape[0], 0, Tk)]:
        return _sdpa(q, k, v, mask, *call)
    outs = []
    for b0, b1, lo, hi in ranges:
        if lo == hi:  # a sequence of padding only: its rows see no key
            outs.append(q.new_zeros(b1 - b0, q.shape[1], Tq, v.shape[-1]))
            continue
        part = mask
        if part is not None:
            part = part[b0:b1] if part.dim() == 4 and part.shape[0] > 1 else part
            part = part[..., lo:hi]
        outs.append(_sdpa(q[b0:b1], k[b0:b1, :, lo:hi], v[b0:b1, :, lo:hi], part, *call))
    return torch.cat(outs)


def key_ranges(key_padding_mask: torch.Tensor) -> list[tuple[int, int, int, int]] | None:
    """(b0, b1, lo, hi): sequences b0 .. b1 - 1 all have exactly the keys lo .. hi - 1 (runs of
    equal ranges, in order), read on the host through numpy (no aten op, no copy) where the
    mask is a CPU tensor and nothing traces; None where some sequence's keys have a hole, or
    the mask is on a GPU or traced."""
    if key_padding_mask.device.type != "cpu" or tracing():
        return None
    real = ~key_padding_mask.numpy()  # (B, Tk)
    Tk = real.shape[1]
    if Tk == 0 or real.shape[0] == 0:  # nothing to view: the copy (of nothing) is as cheap
        return None
    count = real.sum(1)
    lo = np.where(count > 0, real.argmax(1), 0)
    hi = np.where(count > 0, Tk - real[:, ::-1].argmax(1), 0)
    if (hi - lo != count).any():
        return None
    ranges = []
    for b, (start, end) in enumerate(zip(lo.tolist(), hi.tolist(), strict=True)):
        if ranges and ranges[-1][2:] == (start, end):
            ranges[-1] = (ranges[-1][0], b + 1, start, end)
        else:
            ranges.append((b, b + 1, start, end))
    return ranges


def _sdpa(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa, sinks):
    """One SDPA call with the sinks as a key column and the rows that see no key kept alive."""
    if sinks is not None:
        B, Hq, Tq, _ = q.shape
        Hkv, Tk = k.shape[1], k.shape[2]
        k = torch.cat([k, k.new_zeros(B, Hkv, 1, k.shape[-1])], dim=2)
        v = torch.cat([v, v.new_zeros(B, Hkv, 1, v.shape[-1])], dim=2)
        if mask is None:
            mask = q.new_zeros(Tq, Tk)
        elif mask.dtype == torch.bool:
            mask = q.new_zeros(mask.shape).masked_fill(~mask, float("-inf"))
        shape = torch.broadcast_shapes(mask.shape, (1, Hq, Tq, Tk))
        sink = sinks.to(q.dtype)[None, :, None, None].expand(shape[0], Hq, Tq, 1)
        mask = torch.cat([mask.expand(shape), sink], dim=-1)
    # Rows that see no key: SDPA's forward gives them 0, but its cuDNN backward returned NaN
    # gradients for them (H100, torch 2.11). When a backward can run, they attend to every key
    # instead and their output is zeroed, which makes every gradient through them exactly 0 (a
    # sink column keeps every row alive). One more pass over the mask, only then: inference
    # calls pay nothing.
    dead = None
    grads = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, mask)
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
