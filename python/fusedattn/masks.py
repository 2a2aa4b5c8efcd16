"""Mask builders, in the conventions of `fusedattn.attention` (bool True = may attend).

`is_causal=True` is top-left aligned (query i sees keys j <= i), as in SDPA. For the
bottom-right alignment of flash-attn and KV-cache decoding (the last query sees every key),
pass `causal_mask(Tq, Tk, bottom_right=True)` as `attn_mask`.
"""

from __future__ import annotations

import torch


def causal_mask(Tq: int, Tk: int, *, bottom_right: bool = False, device=None) -> torch.Tensor:
    """(Tq, Tk) bool, True where query i may attend key j.

    Top-left: j <= i. Bottom-right: j <= i + (Tk - Tq); with Tq > Tk the first Tq - Tk rows
    see no key at all (and give 0, as every fully masked row does).
    """
    shift = Tk - Tq if bottom_right else 0
    rows = torch.arange(Tq, device=device).unsqueeze(-1)
    cols = torch.arange(Tk, device=device)
    return cols <= rows + shift


def padding_mask_from_lengths(lengths: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) key_padding_mask from sequence lengths: True marks a padding position."""
    return torch.arange(T, device=lengths.device) >= lengths.unsqueeze(-1)


def key_padding_to_attn_mask(key_padding_mask: torch.Tensor) -> torch.Tensor:
    """(B, Tk) key_padding_mask (True = padding) -> (B, 1, 1, Tk) attn_mask (True = may attend)."""
    return ~key_padding_mask[:, None, None, :]


def merge_masks(
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    is_causal: bool,
    Tq: int,
    Tk: int,
    device=None,
) -> torch.Tensor | None:
    """One mask equivalent to attn_mask AND key padding AND causal, or None when all are absent.

    The result is bool when attn_mask is bool or absent, else float (additive, -inf where a
    padding or causal rule hides the key). It broadcasts to (B, H, Tq, Tk) and is only as large
    as its inputs need: (Tq, Tk) for causal alone, (B, 1, 1, Tk) for padding alone.
    """
    visible = None
    if key_padding_mask is not None:
        visible = key_padding_to_attn_mask(key_padding_mask)
    if is_causal:
        causal = causal_mask(Tq, Tk, device=device)
        visible = causal if visible is None else visible & causal
    if attn_mask is None:
        return visible
    if visible is None:
        return attn_mask
    if attn_mask.dtype == torch.bool:
        return attn_mask & visible
    return torch.where(visible, attn_mask, float("-inf"))
