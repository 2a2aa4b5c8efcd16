"""Hugging Face transformers models on fusedattn's attention (`pip install fusedattn[hf]`).

    import fusedattn.integrations.huggingface as fa_hf
    fa_hf.register()                                   # once per process
    model = AutoModel.from_config(config, attn_implementation="fusedattn")
    # or: model.set_attn_implementation("fusedattn")

`register` adds an attention function to transformers' `AttentionInterface` and, for its
masks, SDPA's mask builder to `AttentionMaskInterface` (fusedattn takes SDPA's conventions:
bool True = may attend, or an additive float mask; None with is_causal for plain causal).
"""

from __future__ import annotations

import functools

import torch

from ..ops import attention

NAME = "fusedattn"


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    position_bias: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q (B, Hq, Tq, D), k/v (B, Hkv, Tk, D) ->
    (out (B, Tq, Hq, Dv), None). Attention weights are not returned (as with "sdpa")."""
    if kwargs.get("softcap") is not None:
        raise ValueError("fusedattn attention does not support `softcap`; use 'eager'")
    # As transformers' SDPA path: the module (or the call) says whether it is a decoder, and a
    # single query token (decoding) sees every cached key.
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    if position_bias is not None:  # a learned bias (T5-style) joins the mask
        attention_mask = position_bias if attention_mask is None else (
            position_bias.masked_fill(~attention_mask, float("-inf"))
            if attention_mask.dtype == torch.bool
            else position_bias + attention_mask
        )  # fmt: skip
        if is_causal:
            Tq, Tk = query.shape[2], key.shape[2]
            causal = torch.ones(Tq, Tk, dtype=torch.bool, device=query.device).tril(Tk - Tq)
            attention_mask = attention_mask.masked_fill(~causal, float("-inf"))
            is_causal = False
    out = attention(
        query,
        key,
        value,
        attention_mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
        backend=backend,
    )
    return out.transpose(1, 2).contiguous(), None


def register(name: str = NAME, *, backend: str = "auto") -> str:
    """Make `attn_implementation=name` available to every transformers model, running
    fusedattn's `backend`; returns name."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(name, functools.partial(attention_forward, backend=backend))
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
