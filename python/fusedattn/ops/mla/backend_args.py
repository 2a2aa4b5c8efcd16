"""What the reference and torch backends of the MLA family share: q whole again, and the
positional rule of a call (bottom-right causal or none)."""

from __future__ import annotations

import torch

from ...masks import NO_WINDOW, Window

CAUSAL = Window(-1, 0, True)  # query i of Tq at key position L - Tq + i


def full_q(q: torch.Tensor, q_pe: torch.Tensor | None) -> torch.Tensor:
    """(B, Tq, Hq, Dv + Dr): the two parts side by side (a copy; the gathered form's)."""
    return q if q_pe is None else torch.cat([q, q_pe], dim=-1)


def window_of(is_causal: bool) -> Window:
    return CAUSAL if is_causal else NO_WINDOW
