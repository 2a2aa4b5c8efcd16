"""Naive nn.Modules built on the reference ops, with torch's parameter names and state_dicts.

The reference transformer is made of these, so `fusedattn.swap_modules` can replace each with
its fused twin and one set of weights runs either way.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ..modules.attention import MultiheadAttention as FusedMultiheadAttention
from .attention import attention_scores, expand_kv_heads
from .layernorm import layer_norm
from .softmax import softmax


class Softmax(nn.Softmax):
    """nn.Softmax computed by `fusedattn.reference.softmax` (fully masked rows give 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dim = self.dim
        if dim is None:  # nn.Softmax's legacy implicit dim, with its warning
            warnings.warn(
                "Implicit dimension choice for softmax has been deprecated. "
                "Change the call to include dim=X as an argument.",
                stacklevel=2,
            )
            dim = 0 if x.dim() in (0, 1, 3) else 1
        return softmax(x, dim)


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm computed by `fusedattn.reference.layer_norm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class MultiheadAttention(FusedMultiheadAttention):
    """Naive O(T²) nn.MultiheadAttention: every option, torch's state_dict and return values.

    The fused module's projections and mask handling with the attention itself done naively:
    scores materialised and normalised by the `softmax` submodule (so swapping only the
    softmax is possible), dropout on the probabilities, and the weights returned after
    dropout, as torch does.
    """

    def __init__(self, *args, **kwargs):
        kwargs["backend"] = "reference"
        super().__init__(*args, **kwargs)
        self.softmax = Softmax(dim=-1)

    def _attend(self, q, k, v, attn_mask, key_padding_mask, is_causal, need_weights, average):
        scores = attention_scores(q, k, attn_mask, is_causal, key_padding_mask=key_padding_mask)
        probs = F.dropout(self.softmax(scores), p=self.dropout, training=self.training)
        out = torch.matmul(probs.to(v.dtype), expand_kv_heads(v, q.shape[1]))
        if not need_weights:
            return out, None
        weights = probs.to(out.dtype)
        return out, weights.mean(dim=1) if average else weights
