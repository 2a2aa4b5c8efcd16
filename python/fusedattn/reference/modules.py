"""Naive nn.Modules: torch's module interfaces computed by the naive ops of this package, with
torch's parameter names and state_dicts.

The reference transformer (fusedattn.reference.transformer) is made of these, so
`fusedattn.swap_modules` can replace each with its fused twin and one set of weights runs
either way. The attention module does the attention step itself, naively: scores
materialised and normalised by its `softmax` submodule (so swapping only the softmax is
possible), dropout on the probabilities, and the weights returned after dropout, as torch
does. Each module applies the autocast policy fusedattn's op applies (fusedattn.autocast), so
under torch.autocast a naive module and its fused twin see inputs of the same dtype.

They import nothing above fusedattn.reference: the interfaces they share with the fused
modules live in fusedattn.nn_interfaces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..autocast import apply_autocast
from ..nn_interfaces import FusedModule, MultiheadAttentionInterface, norm_shape, softmax_dim
from .attention import attention_scores, expand_kv_heads
from .layernorm import layer_norm
from .rmsnorm import rms_norm
from .softmax import softmax


class Softmax(nn.Softmax, FusedModule):
    """nn.Softmax computed by the naive `fusedattn.reference.softmax` (a row of -inf gives 0)."""

    backend = "reference"

    def __init__(self, dim=None):
        super().__init__(dim)
        self._register_fused_hooks()

    def forward(self, input):
        x = apply_autocast("softmax", dict(x=input))["x"]
        return softmax(x, softmax_dim(self.dim, input))


class LayerNorm(nn.LayerNorm, FusedModule):
    """nn.LayerNorm computed by the naive `fusedattn.reference.layer_norm`."""

    backend = "reference"

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True,
                 device=None, dtype=None):  # fmt: skip
        super().__init__(norm_shape(normalized_shape), eps, elementwise_affine, bias, device, dtype)
        self._register_fused_hooks()

    def forward(self, input):
        cast = apply_autocast("layer_norm", dict(x=input, weight=self.weight, bias=self.bias))
        return layer_norm(cast["x"], self.normalized_shape, cast["weight"], cast["bias"],
                          self.eps)  # fmt: skip


class RMSNorm(nn.RMSNorm, FusedModule):
    """nn.RMSNorm computed by the naive `fusedattn.reference.rms_norm`."""

    backend = "reference"

    def __init__(self, normalized_shape, eps=None, elementwise_affine=True, device=None,
                 dtype=None):  # fmt: skip
        super().__init__(norm_shape(normalized_shape), eps, elementwise_affine, device, dtype)
        self._register_fused_hooks()

    def forward(self, input):
        cast = apply_autocast("rms_norm", dict(x=input, weight=self.weight))
        return rms_norm(cast["x"], self.normalized_shape, cast["weight"], self.eps)


class MultiheadAttention(MultiheadAttentionInterface):
    """Naive O(T²) nn.MultiheadAttention: every option, torch's state_dict and return values."""

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
