"""`fusedattn.attention`: validation, backend dispatch, and the reference / torch backends."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .. import reference
from ..masks import merge_masks
from . import backends, flash_attention
from .autocast import apply_autocast
from .checks import check_attention_args


def _torch_refusals(*, return_lse, **_inputs) -> list[str]:
    if return_lse:
        return ["torch's scaled_dot_product_attention does not return the log-sum-exp"]
    return []


def _torch_attention(
    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, return_lse
):
    """F.scaled_dot_product_attention with our masks folded into the one mask it takes.

    SDPA refuses attn_mask together with is_causal and has no key padding argument, so the
    three are merged; a float mask is cast to q's dtype, as SDPA requires.
    """
    if key_padding_mask is not None or (is_causal and attn_mask is not None):
        attn_mask = merge_masks(
            attn_mask, key_padding_mask, is_causal, q.shape[-2], k.shape[-2], device=q.device
        )
        is_causal = False
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        dropout_p=dropout_p,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
    )


def _reference_attention(
    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, return_lse
):
    return reference.attention(
        q,
        k,
        v,
        attn_mask,
        dropout_p,
        is_causal,
        scale,
        enable_gqa,
        key_padding_mask=key_padding_mask,
        return_lse=return_lse,
    )


backends.register("attention", "reference", _reference_attention, backends.no_refusals)
backends.register("attention", "torch", _torch_attention, _torch_refusals)
backends.register(
    "attention", "triton", flash_attention.run_triton, flash_attention.triton_refusals
)
backends.register("attention", "cuda", flash_attention.run_cuda, flash_attention.cuda_refusals)


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
    return_lse: bool = False,
    backend: str = "auto",
):
    """Masked multi-head scaled-dot-product attention, SDPA's layout and mask conventions.

    q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv); attn_mask bool (True = may
    attend) or float (added to the scaled scores), broadcastable to (B, Hq, Tq, Tk);
    key_padding_mask bool (B, Tk), True = padding key; is_causal is top-left aligned.
    Returns out (B, Hq, Tq, Dv), and lse (B, Hq, Tq) float32 when return_lse=True. A query
    that sees no key gives 0 output, 0 gradients and lse = -inf.
    """
    cast = apply_autocast("attention", dict(q=q, k=k, v=v, attn_mask=attn_mask))
    q, k, v, attn_mask = cast["q"], cast["k"], cast["v"], cast["attn_mask"]
    check_attention_args(
        q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask
    )
    inputs = dict(
        q=q,
        k=k,
        v=v,
        attn_mask=attn_mask,
        dropout_p=float(dropout_p),
        is_causal=is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        key_padding_mask=key_padding_mask,
        return_lse=return_lse,
    )
    return backends.select("attention", backend, q.device, inputs).run(**inputs)
