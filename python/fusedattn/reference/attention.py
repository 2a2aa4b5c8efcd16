"""Naive O(T²) attention: the plain-torch twin of `fusedattn.attention`.

It materialises the (B, H, Tq, Tk) scores, which is what the fused kernels avoid: it is the
correctness reference and the baseline that the benchmarks beat. Matmuls run in the input dtype
(what naive PyTorch code does); the softmax runs in fp32 (fp64 kept).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..masks import merge_masks
from ..ops.checks import check_attention_args
from .softmax import safe_softmax


def expand_kv_heads(t: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """Repeat k or v heads for grouped-query attention: q head h reads kv head h // group."""
    group = num_q_heads // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def attention_scores(
    q, k, attn_mask=None, is_causal=False, scale=None, *, key_padding_mask=None
) -> torch.Tensor:
    """(B, Hq, Tq, Tk) scaled scores with every mask applied (-inf where hidden), fp32/fp64."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    k = expand_kv_heads(k, q.shape[1])
    # Scale q before the product, as naive fp16 code must: q·k at D=256 can overflow fp16.
    scores = torch.matmul(q * scale, k.transpose(-2, -1))
    scores = scores.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    mask = merge_masks(
        attn_mask, key_padding_mask, is_causal, q.shape[-2], k.shape[-2], device=q.device
    )
    if mask is None:
        return scores
    if mask.dtype == torch.bool:
        return scores.masked_fill(~mask, float("-inf"))
    return scores + mask.to(scores.dtype)


def log_sum_exp(scores: torch.Tensor) -> torch.Tensor:
    """Row log-sum-exp in fp32; -inf (with zero gradient) for a row that sees no key."""
    dead = scores.detach().amax(-1) == float("-inf")
    lse = torch.logsumexp(scores.masked_fill(dead.unsqueeze(-1), 0.0), dim=-1)
    return lse.masked_fill(dead, float("-inf")).float()


def attention(
    q,
    k,
    v,
    attn_mask=None,
    dropout_p=0.0,
    is_causal=False,
    scale=None,
    enable_gqa=False,
    *,
    key_padding_mask=None,
    return_lse=False,
):
    """softmax(q·kᵀ·scale + mask)·v with SDPA's conventions; see `fusedattn.attention`.

    A query row with no visible key gives 0 output, 0 gradients and lse = -inf.
    """
    check_attention_args(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask
    )
    scores = attention_scores(q, k, attn_mask, is_causal, scale, key_padding_mask=key_padding_mask)
    probs = safe_softmax(scores, dim=-1)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    out = torch.matmul(probs.to(v.dtype), expand_kv_heads(v, q.shape[1]))
    if return_lse:
        return out, log_sum_exp(scores)
    return out
