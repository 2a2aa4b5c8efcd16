"""Naive nn.Modules built on the reference ops, with torch's parameter names and state_dicts.

The reference transformer is made of these, so `fusedattn.swap_modules` can later replace each
with its fused twin and one set of weights runs either way. `MultiheadAttention` covers the
options the reference transformer uses (self- and cross-attention with equal dims, bias,
dropout, batch_first, bool/float masks, need_weights); the full drop-in for
`nn.MultiheadAttention` is `fusedattn.MultiheadAttention`.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

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


def mha_masks_to_ours(attn_mask, key_padding_mask, batch, num_heads, tq, tk, dtype):
    """nn.MultiheadAttention's masks (bool True = NOT allowed; 3-D attn_mask is (B*H, Tq, Tk))
    -> fusedattn's (bool True = may attend, broadcastable to (B, H, Tq, Tk); float added)."""
    if attn_mask is not None:
        if attn_mask.dim() == 3:
            attn_mask = attn_mask.view(batch, num_heads, tq, tk)
        attn_mask = ~attn_mask if attn_mask.dtype == torch.bool else attn_mask.to(dtype)
    if key_padding_mask is not None and key_padding_mask.dtype != torch.bool:
        # A float key padding mask is added to the scores, like a float attn_mask.
        pad = key_padding_mask.to(dtype)[:, None, None, :]
        if attn_mask is None:
            attn_mask = pad
        elif attn_mask.dtype == torch.bool:
            attn_mask = torch.where(attn_mask, pad, float("-inf"))
        else:
            attn_mask = attn_mask + pad
        key_padding_mask = None
    return attn_mask, key_padding_mask


class MultiheadAttention(nn.Module):
    """Naive O(T²) multi-head attention with nn.MultiheadAttention's interface and state_dict.

    Scores are materialised and normalised by the `softmax` submodule, so swapping only the
    softmax is possible too.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout = dropout
        self.batch_first = batch_first
        self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias, **factory)
        self.softmax = Softmax(dim=-1)
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        # nn.MultiheadAttention's initialisation.
        nn.init.xavier_uniform_(self.in_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    def _project(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """Project (B, T, E) with the index-th third of in_proj -> (B, H, T, head_dim)."""
        E = self.embed_dim
        w = self.in_proj_weight[index * E : (index + 1) * E]
        b = None if self.in_proj_bias is None else self.in_proj_bias[index * E : (index + 1) * E]
        y = F.linear(x, w, b)
        return y.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        if not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        B, Tq, _ = query.shape
        Tk = key.shape[1]
        q, k, v = self._project(query, 0), self._project(key, 1), self._project(value, 2)
        attn_mask, key_padding_mask = mha_masks_to_ours(
            attn_mask, key_padding_mask, B, self.num_heads, Tq, Tk, q.dtype
        )
        # As in torch, is_causal is a hint that attn_mask is causal; it only builds the causal
        # mask when no attn_mask is given.
        scores = attention_scores(
            q,
            k,
            attn_mask,
            is_causal=is_causal and attn_mask is None,
            key_padding_mask=key_padding_mask,
        )
        probs = F.dropout(self.softmax(scores), p=self.dropout, training=self.training)
        out = torch.matmul(probs.to(v.dtype), expand_kv_heads(v, self.num_heads))
        out = self.out_proj(out.transpose(1, 2).reshape(B, Tq, self.embed_dim))
        if not self.batch_first:
            out = out.transpose(0, 1)
        if not need_weights:
            return out, None
        weights = probs.to(query.dtype)
        return out, weights.mean(dim=1) if average_attn_weights else weights
