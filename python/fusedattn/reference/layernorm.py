"""Naive LayerNorm: the plain-torch twin of `fusedattn.layer_norm`.

Statistics in fp32 (fp64 kept), biased variance as torch, output in the input dtype.
"""

from __future__ import annotations

import torch

from ..checks import check_layer_norm_args


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    shape = check_layer_norm_args(x, normalized_shape, weight, bias, eps)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    xf = x.to(compute)
    dims = tuple(range(-len(shape), 0))
    mean = xf.mean(dims, keepdim=True)
    var = (xf - mean).square().mean(dims, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight.to(compute)
    if bias is not None:
        y = y + bias.to(compute)
    return y.to(x.dtype)
