"""Naive RMSNorm: the plain-torch twin of `fusedattn.rms_norm` (F.rms_norm's semantics).

y = x / sqrt(mean(x^2) + eps) * weight over the trailing dims; statistics in fp32 (fp64
kept), output in the input dtype; eps=None is torch.finfo(x.dtype).eps.
"""

from __future__ import annotations

import torch

from ..checks import check_rms_norm_args


def rms_norm(x, normalized_shape, weight=None, eps=None):
    shape, eps = check_rms_norm_args(x, normalized_shape, weight, eps)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    dims = tuple(range(-len(shape), 0))
    y = xf * torch.rsqrt(xf.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.to(compute)
    return y.to(x.dtype)
