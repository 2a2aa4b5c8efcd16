"""Naive softmax: the plain-torch twin of `fusedattn.softmax`, computed in fp32 (fp64 kept)."""

from __future__ import annotations

import torch

from ..checks import check_softmax_args
from ..masks import causal_mask


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_scores(x, dim, mask, scale, is_causal) -> torch.Tensor:
    """x * scale with masked positions set to -inf (float masks added), in fp32 or fp64."""
    s = x.to(_compute_dtype(x.dtype))
    if scale is not None:
        s = s * scale
    if mask is not None:
        s = (
            s.masked_fill(~mask, float("-inf"))
            if mask.dtype == torch.bool
            else s + mask.to(s.dtype)
        )
    if is_causal:
        s = s.masked_fill(~causal_mask(x.shape[-2], x.shape[-1], device=x.device), float("-inf"))
    return s


def safe_softmax(s: torch.Tensor, dim: int) -> torch.Tensor:
    """exp(s - max) / sum along dim; a row with no finite entry (all masked) gives 0, not NaN.

    The max is detached: the result does not depend on it, so its gradient is exactly zero.
    An empty `dim` gives the empty result.
    """
    if s.shape[dim] == 0:
        return s.clone()
    row_max = s.detach().amax(dim, keepdim=True)
    dead = row_max == float("-inf")
    e = torch.exp(s - row_max.masked_fill(dead, 0.0))
    return e / e.sum(dim, keepdim=True).masked_fill(dead, 1.0)


def softmax(x, dim=-1, *, mask=None, scale=None, is_causal=False):
    """Softmax of `x * scale` along `dim` where `mask` keeps (bool True) or adds (float).

    is_causal applies to x of shape (..., Tq, Tk) along dim=-1, top-left aligned. Fully masked
    rows give 0 output and 0 gradient.
    """
    dim = check_softmax_args(x, dim, mask, scale, is_causal)
    if x.dim() == 0:  # torch's softmax of a scalar: the 1-element row's, reshaped back
        one = None if mask is None else mask.reshape(1)
        return softmax(x.reshape(1), 0, mask=one, scale=scale, is_causal=is_causal).reshape(())
    return safe_softmax(masked_scores(x, dim, mask, scale, is_causal), dim).to(x.dtype)
