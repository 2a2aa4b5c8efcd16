"""What a user of the reference transformer runs without fusedattn: its attention written with
torch's own `F.scaled_dot_product_attention` (the mask as a user writes it) and its LayerNorm
as `nn.LayerNorm` (`F.layer_norm`). Plain torch: no fusedattn op is called on this path; the
benchmark's `sdpa` rows time it.

`sdpa_model(model)` is a copy of a reference Transformer with the same weights whose
attention and LayerNorm modules are these.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from fusedattn.reference import modules as naive_modules


class SdpaSelfAttention(nn.Module):
    """The reference MultiheadAttention's parameters (in_proj_weight/bias, out_proj: torch's
    layout), batch_first, running one SDPA call. The masks as a user writes them for SDPA:
    `is_causal=True` alone when the call is causal without padding; otherwise one bool mask,
    `~key_padding_mask[:, None, None, :]`, ANDed with the causal triangle when causal."""

    def __init__(self, mha: nn.Module):
        super().__init__()
        self.num_heads, self.dropout = mha.num_heads, mha.dropout
        self.in_proj_weight, self.in_proj_bias = mha.in_proj_weight, mha.in_proj_bias
        self.out_proj = mha.out_proj

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False,
                attn_mask=None, is_causal=False):  # fmt: skip
        Tq = query.shape[1]
        if query is key and key is value:
            q, k, v = F.linear(query, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        else:
            w, b = self.in_proj_weight.chunk(3), (self.in_proj_bias.chunk(3)
                                                  if self.in_proj_bias is not None
                                                  else (None,) * 3)  # fmt: skip
            q, k, v = (
                F.linear(x, wi, bi) for x, wi, bi in zip((query, key, value), w, b, strict=True)
            )
        q, k, v = (t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2) for t in (q, k, v))
        mask = None
        if key_padding_mask is not None:
            mask = ~key_padding_mask[:, None, None, :]
            if is_causal:
                Tk = k.shape[2]
                mask = mask & torch.ones(Tq, Tk, dtype=torch.bool, device=q.device).tril()
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal and mask is None,
        )  # fmt: skip
        return self.out_proj(out.transpose(1, 2).flatten(2)), None


def sdpa_model(model: nn.Module) -> nn.Module:
    """A copy of a reference Transformer (same weights) on SDPA and nn.LayerNorm."""
    model = copy.deepcopy(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, naive_modules.MultiheadAttention):
                setattr(parent, name, SdpaSelfAttention(child))
            elif isinstance(child, naive_modules.LayerNorm):
                p = child.weight
                norm = nn.LayerNorm(child.normalized_shape, eps=child.eps, device=p.device,
                                    dtype=p.dtype)  # fmt: skip
                norm.load_state_dict(child.state_dict())
                setattr(parent, name, norm)
    return model
