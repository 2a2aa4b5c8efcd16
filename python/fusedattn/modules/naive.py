"""Naive nn.Modules: the fused modules pinned to the reference backend (the attention module
also does the attention step itself, naively), with torch's parameter names and state_dicts.

The reference transformer (fusedattn.reference.transformer) is made of these, so
`fusedattn.swap_modules` can replace each with its fused twin and one set of weights runs
either way. They live with the modules, not in fusedattn.reference: the naive ops import
nothing of the package but its checks and masks, and ops/ imports them without a circle.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..reference.attention import attention_scores, expand_kv_heads
from .attention import MultiheadAttention as FusedMultiheadAttention
from .layernorm import LayerNorm as FusedLayerNorm
from .rmsnorm import RMSNorm as FusedRMSNorm
from .softmax import Softmax as FusedSoftmax


class Softmax(FusedSoftmax):
    """nn.Softmax computed by the naive `fusedattn.reference.softmax`."""

    def __init__(self, dim=None):
        super().__init__(dim, backend="reference")


class LayerNorm(FusedLayerNorm):
    """nn.LayerNorm computed by the naive `fusedattn.reference.layer_norm`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, backend="reference")


class RMSNorm(FusedRMSNorm):
    """nn.RMSNorm computed by the naive `fusedattn.reference.rms_norm`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, backend="reference")


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
