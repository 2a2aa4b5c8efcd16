"""Positional windows and mask builders, in the conventions of `fusedattn.attention` (bool
True = may attend).

Positions: query i sits at key position p = i (`causal_alignment="top_left"`, SDPA's
`is_causal`) or p = i + Tk - Tq (`"bottom_right"`, flash-attention and KV-cache decoding, where
the last query sees every key). A `Window(left, right)` lets the query at p see key j iff
p - left <= j <= p + right, -1 meaning unbounded on that side: causal is `Window(-1, 0)`.
The kernels skip the tiles a window hides; the dense builders here are for the reference and
torch backends and for users who want an explicit mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class Window:
    """Keys a query sees by position: p - left <= j <= p + right (-1 = unbounded side)."""

    left: int = -1
    right: int = -1
    bottom_right: bool = False

    @property
    def bounded(self) -> bool:
        return self.left >= 0 or self.right >= 0

    @property
    def is_top_left_causal(self) -> bool:
        """Exactly SDPA's is_causal=True."""
        return self.left < 0 and self.right == 0 and not self.bottom_right

    def offset(self, Tq: int, Tk: int) -> int:
        """Key position of query 0."""
        return Tk - Tq if self.bottom_right else 0


NO_WINDOW = Window()


def make_window(
    is_causal: bool,
    window_size: tuple[int, int] | None,
    causal_alignment: str,
    Tq: int | None,
    Tk: int | None,
    *,
    alibi: bool = False,
) -> Window:
    """The normalised positional rule of one attention call: is_causal makes the right side
    0; the alignment is kept only where it changes something (a bounded window or ALiBi, and
    Tq != Tk; None lengths, as in a packed batch, may differ per sequence)."""
    left, right = (-1, -1) if window_size is None else (int(window_size[0]), int(window_size[1]))
    if is_causal:
        right = 0
    positional = left >= 0 or right >= 0 or alibi
    bottom_right = causal_alignment == "bottom_right" and positional and (Tq is None or Tq != Tk)
    return Window(left, right, bottom_right)


def window_mask(window: Window, Tq: int, Tk: int, device=None) -> torch.Tensor | None:
    """(Tq, Tk) bool, True where the window lets query i see key j; None when unbounded."""
    if not window.bounded:
        return None
    p = torch.arange(Tq, device=device).unsqueeze(-1) + window.offset(Tq, Tk)
    j = torch.arange(Tk, device=device)
    visible = torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    if window.right >= 0:
        visible &= j <= p + window.right
    if window.left >= 0:
        visible &= j >= p - window.left
    return visible


def alibi_bias(
    slopes: torch.Tensor, Tq: int, Tk: int, *, bottom_right: bool = False, dtype=None
) -> torch.Tensor:
    """-slope·|p - j| for slopes (Hq,) or (B, Hq): (1 or B, Hq, Tq, Tk), in `dtype` (default the
    slopes' dtype)."""
    dtype = dtype or slopes.dtype
    p = torch.arange(Tq, device=slopes.device).unsqueeze(-1) + (Tk - Tq if bottom_right else 0)
    j = torch.arange(Tk, device=slopes.device)
    distance = (p - j).abs().to(dtype)
    per_head = slopes.to(dtype).reshape(-1 if slopes.dim() == 2 else 1, slopes.shape[-1], 1, 1)
    return -per_head * distance


def causal_mask(Tq: int, Tk: int, *, bottom_right: bool = False, device=None) -> torch.Tensor:
    """(Tq, Tk) bool, True where query i may attend key j.

    Top-left: j <= i. Bottom-right: j <= i + (Tk - Tq); with Tq > Tk the first Tq - Tk rows
    see no key at all (and give 0, as every fully masked row does).
    """
    return window_mask(Window(-1, 0, bottom_right), Tq, Tk, device=device)


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
    *,
    window: Window | None = None,
) -> torch.Tensor | None:
    """One mask equivalent to attn_mask AND key padding AND the positional rule (`window`, or
    top-left causal when is_causal), or None when all are absent.

    The result is bool when attn_mask is bool or absent, else float in attn_mask's dtype
    (additive, -inf where padding or position hides the key; convert a float mask to the
    compute dtype before merging, so its gradient is reduced in that dtype). It broadcasts to
    (B, H, Tq, Tk) and is only as large as its inputs need: (Tq, Tk) for a window alone,
    (B, 1, 1, Tk) for padding alone.
    """
    if window is None:
        window = Window(-1, 0) if is_causal else NO_WINDOW
    visible = None
    if key_padding_mask is not None:
        visible = key_padding_to_attn_mask(key_padding_mask)
    positional = window_mask(window, Tq, Tk, device=device)
    if positional is not None:
        visible = positional if visible is None else visible & positional
    if attn_mask is None:
        return visible
    if visible is None:
        return attn_mask
    if attn_mask.dtype == torch.bool:
        return attn_mask & visible
    return torch.where(visible, attn_mask, float("-inf"))


def shift_float_mask(
    attn_mask: torch.Tensor, visible: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float attn_mask minus each row's largest entry over the keys the row can see, and
    that shift.

    Softmax does not change when one value is added to a whole row, so attention with the
    shifted mask is the same function; the lse comes out short by the shift (the caller adds
    it back). What changes is precision: a row whose every key carries a large offset
    (`masked_fill(mask == 0, -1e9)`, `finfo(dtype).min`) would otherwise round the scores
    away in fp32 (ulp 64 at 1e9) and make the kernels' lse-based backward give each key a
    probability near 1 (dv summing to the row's key count; issue #31). Shifted, such a row
    is the softmax of its scores, what exact arithmetic gives. The maximum is taken over the
    visible keys only (`visible`, bool broadcastable to the mask: key padding, causal, a
    window; None = every key): a key the row cannot see must not set its shift, or a row at
    finfo.min on every visible key next to a hidden 0 keeps its offset (issue #50 item 8).
    The result then has the broadcast shape of the mask and `visible` (in fp32 if that is
    larger than a half-precision mask), 0 on the hidden keys.
    Rows whose largest
    visible entry is not finite (none visible, all -inf, or a +inf) are left alone. The shift
    is taken detached: softmax's invariance makes its gradient zero. Not for calls with
    sinks, whose logit does not move with the row (there a large offset only makes the sink
    win, as it should).

    Returns (shifted mask, shift of the shifted mask's shape without its last dim), or
    (attn_mask, None) for a bool mask or where there are no keys (the mask's own last dim,
    or its broadcast against `visible`, is 0)."""
    if attn_mask.dtype == torch.bool or attn_mask.dim() == 0 or attn_mask.shape[-1] == 0:
        return attn_mask, None
    entries = attn_mask.detach()
    if visible is not None:
        entries = entries.masked_fill(~visible, float("-inf"))
    if entries.shape[-1] == 0:  # a mask broadcast over no keys at all: no row sees a key
        return attn_mask, None
    row_max = entries.amax(dim=-1, keepdim=True)
    row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    if visible is None:
        return attn_mask - row_max, row_max.squeeze(-1)
    grows = torch.broadcast_shapes(attn_mask.shape, visible.shape) != attn_mask.shape
    if grows and attn_mask.dtype in HALF_DTYPES:
        # broadcast past the mask's own shape: its gradient is then summed back by autograd,
        # in fp32 as the kernels sum theirs (a bf16 bias's exact zero gradient came out 0.22)
        attn_mask, row_max = attn_mask.float(), row_max.float()
    # Hidden entries are never weighed (and get no gradient): 0, not their value minus the
    # visible maximum, which could reach 3.4e38 (0 - finfo.min) and overflow to inf inside a
    # kernel before its positional rule drops the key (NaN dq in the Triton backward).
    return torch.where(visible, attn_mask - row_max, 0.0), row_max.squeeze(-1)


def visible_keys(key_padding_mask, window: Window, Tq: int, Tk: int, device=None):
    """bool, broadcastable to (B, H, Tq, Tk): the keys a query may see by key padding and
    position (not by attn_mask); None when every key is visible."""
    return merge_masks(None, key_padding_mask, False, Tq, Tk, device, window=window)


# Block masks (FlexAttention's mask_mod and BlockMask, no compile): block_mask.py. Imported
# last: block_mask.py needs nothing from here, users find them here.
from .block_mask import BlockMask as BlockMask  # noqa: E402
from .block_mask import create_block_mask as create_block_mask  # noqa: E402
from .block_mask import create_mask as create_mask  # noqa: E402
from .block_mask import noop_mask as noop_mask  # noqa: E402


def and_masks(*mask_mods):
    """A mask_mod that sees a key iff every one of mask_mods does (torch's and_masks works too)."""

    def both(b, h, q_idx, kv_idx):
        result = q_idx >= 0
        for mod in mask_mods:
            result = result & mod(b, h, q_idx, kv_idx)
        return result

    return both


def or_masks(*mask_mods):
    """A mask_mod that sees a key iff any of mask_mods does (torch's or_masks works too)."""

    def either(b, h, q_idx, kv_idx):
        result = q_idx < 0
        for mod in mask_mods:
            result = result | mod(b, h, q_idx, kv_idx)
        return result

    return either
