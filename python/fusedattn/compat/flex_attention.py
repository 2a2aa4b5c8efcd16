"""FlexAttention's API on fusedattn's kernels, eagerly: no torch.compile, no recompiles.

    from fusedattn.compat.flex_attention import create_block_mask, flex_attention

`create_block_mask` (torch's signature) builds the mask in chunks without a Q_LEN x KV_LEN
tensor; `flex_attention` runs it on the Triton kernels' block-sparse loops (the blocks the
mask lists, forward and backward). A BlockMask from torch's own create_block_mask works as
well (converted once, kept with the object).

`score_mod` is not taken: an arbitrary Python function of each score cannot run per element
without a compile. The score modifications attention-gym's examples use are built-in terms of
`fusedattn.attention`: softcap (tanh soft-capping), alibi_slopes (ALiBi), sinks (attention
sinks), window_size (sliding windows), and attn_mask as a float bias (relative positional
biases of any form). docs/block_masks.md lists them.
"""

from __future__ import annotations

import torch

from ..block_mask import BlockMask, create_block_mask
from ..masks import and_masks, or_masks
from ..ops import attention

__all__ = ["BlockMask", "and_masks", "create_block_mask", "flex_attention", "or_masks"]


def flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    score_mod=None,
    block_mask=None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict | None = None,
):
    """torch.nn.attention.flex_attention.flex_attention's signature: (B, Hq, L, E) query,
    (B, Hkv, S, E) key, (B, Hkv, S, Ev) value -> (B, Hq, L, Ev) [, lse (B, Hq, L) float32].

    score_mod must be None (ValueError otherwise: use fusedattn.attention's softcap,
    alibi_slopes, sinks, window_size or a float attn_mask); kernel_options are Flex's Triton
    tile settings and are ignored (fusedattn picks its tiles). A query that sees no key gives
    0 and lse -inf, as in Flex."""
    if score_mod is not None:
        raise ValueError(
            "score_mod: fusedattn runs without a compile, so it cannot apply a Python function "
            "to every score; use fusedattn.attention's softcap, alibi_slopes, sinks, "
            "window_size or a float attn_mask (docs/block_masks.md lists the equivalents)"
        )
    del kernel_options
    return attention(query, key, value, scale=scale, enable_gqa=enable_gqa,
                     block_mask=block_mask, return_lse=return_lse)  # fmt: skip
