"""FlexAttention's API on fusedattn's kernels, eagerly: no torch.compile, no recompiles.

    from fusedattn.compat.flex_attention import create_block_mask, flex_attention

Everything torch.nn.attention.flex_attention exports: `flex_attention` (score_mod and
block_mask, return_lse and return_aux), `create_block_mask` (torch's keywords; the mask built
in chunks, never as a Q_LEN x KV_LEN tensor), `BlockMask` (torch's class in full),
`create_mask`, `noop_mask`, `and_masks`, `or_masks`, `AuxRequest`, `AuxOutput`. The
differences from torch's are listed in docs/block_masks.md.

A score_mod is traced once per structure and written out as a Triton function the kernels
call per tile (fusedattn/score_mod/); a block mask's listed blocks are the only ones the
kernels visit. A BlockMask from torch's own create_block_mask works as well (its kernels'
form made once, kept with the object).
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import AuxOutput, AuxRequest

from ..block_mask import BlockMask, create_block_mask, noop_mask
from ..masks import and_masks, create_mask, or_masks
from ..ops import attention

__all__ = [
    "AuxOutput",
    "AuxRequest",
    "BlockMask",
    "and_masks",
    "create_block_mask",
    "create_mask",
    "flex_attention",
    "noop_mask",
    "or_masks",
]


def _broadcast_kv(query, key, value, block_mask):
    """K/V of batch 1 with a query batch Bq, as Flex takes them with a block mask of query's
    batch: every batch reads the one K/V (a stride-0 view)."""
    Bq, Bkv = query.size(0), key.size(0)
    if Bq == Bkv:
        return key, value
    if block_mask is None:
        raise ValueError(
            f"Expect query and key/value to have the same batch size, or non-none block_mask, "
            f"but got block_mask=None, Bq={Bq}, and Bkv={Bkv}."
        )
    if block_mask.kv_num_blocks.size(0) != Bq:
        raise ValueError(
            f"Expect query and key/value to have the same batch size, or block_mask and query "
            f"to have the same batch size, but got Bq={Bq}, Bkv={Bkv}, "
            f"B_block_mask={block_mask.kv_num_blocks.size(0)}."
        )
    if Bkv != 1:  # torch's own check (torch/_higher_order_ops/flex_attention.py)
        raise RuntimeError(f"Bq and Bkv must broadcast. Got Bq={Bq} and Bkv={Bkv}")
    return key.expand(Bq, *key.shape[1:]), value.expand(Bq, *value.shape[1:])


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
    *,
    return_aux: AuxRequest | None = None,
):
    """torch.nn.attention.flex_attention.flex_attention's signature: (B, Hq, L, E) query,
    (B, Hkv, S, E) key, (B, Hkv, S, Ev) value -> (B, Hq, L, Ev), with the lse (B, Hq, L)
    float32 for return_lse=True, or (out, AuxOutput) for return_aux.

    score_mod(score, b, h, q_idx, kv_idx) changes each score (float32, scale·q·k) before the
    softmax; block_mask hides keys (ANDed with what the mod returns). kernel_options are
    Flex's Triton tile settings and are ignored (fusedattn picks its tiles);
    AuxRequest(max_scores=True) is refused (the kernels keep no row maxima). A query that
    sees no key gives 0 and lse -inf, as in Flex."""
    del kernel_options
    if return_lse and return_aux is not None:
        raise ValueError(
            "Cannot specify both return_lse and return_aux. return_lse is deprecated, please "
            "use return_aux=AuxRequest(lse=True) instead."
        )
    if return_aux is not None and return_aux.max_scores:
        raise ValueError("AuxRequest(max_scores=True): fusedattn's kernels do not return the "
                         "rows' maximum scores (lse=True is available)")  # fmt: skip
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise NotImplementedError("NYI: query, key, and value must be 4D tensors")
    key, value = _broadcast_kv(query, key, value, block_mask)
    want_lse = return_lse or (return_aux is not None and return_aux.lse)
    result = attention(query, key, value, scale=scale, enable_gqa=enable_gqa,
                       block_mask=block_mask, score_mod=score_mod, return_lse=want_lse)  # fmt: skip
    if return_aux is None:
        return result
    out, lse = result if want_lse else (result, None)
    return out, AuxOutput(lse=lse, max_scores=None)
