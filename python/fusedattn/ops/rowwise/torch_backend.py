"""The torch backend of the row-wise ops: torch's own F.layer_norm, F.rms_norm and softmax,
wrapped to fusedattn's semantics (mixed parameter dtypes, exact CPU LayerNorm, rows that keep
nothing give 0)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...masks import causal_mask


def layer_norm(x, normalized_shape, weight, bias, eps):
    """F.layer_norm; parameters of another dtype than x (fp32 weights with a half input, as
    autocast leaves them) are computed in fp32 and the output rounded once to x's dtype: the
    eager CUDA kernel takes parameters only in x's dtype (pytorch/pytorch#188503; this backend's
    mixed-dtype GPU test failed on the H200 with torch 2.11). On a CPU see _cpu_layer_norm."""
    if x.device.type == "cpu":
        return _cpu_layer_norm(x, normalized_shape, weight, bias, eps)
    params = [t for t in (weight, bias) if t is not None]
    if any(t.dtype != x.dtype for t in params):
        weight = None if weight is None else weight.float()
        bias = None if bias is None else bias.float()
        return F.layer_norm(x.float(), normalized_shape, weight, bias, eps).to(x.dtype)
    return F.layer_norm(x, normalized_shape, weight, bias, eps)


def _cpu_layer_norm(x, normalized_shape, weight, bias, eps):
    """F.layer_norm on a CPU, made exact where torch's CPU kernel is not (torch 2.14, issue
    #31): a constant row in float16 at eps=1e-12 (BERT's) gave NaN dx and dweight, and rows
    with a large common offset (1000 + noise of 1e-2) lost their variance to cancellation
    (fp32 dx off by 0.47). Half inputs are computed in fp32, and each row's mean is taken
    out first, detached: LayerNorm does not change when a row is shifted, so the function and
    its gradient are the same, and the kernel's statistics see values near 0. One more pass
    over x, on the CPU only."""
    compute = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    dims = tuple(range(-len(normalized_shape), 0))
    xc = x.to(compute)
    if xc.numel():
        xc = xc - xc.detach().mean(dims, keepdim=True)
    weight = None if weight is None else weight.to(compute)
    bias = None if bias is None else bias.to(compute)
    return F.layer_norm(xc, normalized_shape, weight, bias, eps).to(x.dtype)


def rms_norm(x, normalized_shape, weight, eps):
    """F.rms_norm; a weight of another dtype than x (fp32 with a half input) is applied in fp32
    and the output rounded once to x's dtype, as F.rms_norm's own unfused fallback does."""
    if weight is not None and weight.dtype != x.dtype:
        return F.rms_norm(x.float(), normalized_shape, weight.float(), eps).to(x.dtype)
    return F.rms_norm(x, normalized_shape, weight, eps)


def softmax(x, dim, mask, scale, is_causal):
    """torch.softmax on the masked, scaled input; rows with no finite entry give 0."""
    dtype = x.dtype  # a float32 mask promotes a half input: compute in fp32, return x's dtype
    if scale is not None:
        x = x * scale
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else x + mask
    if is_causal:
        x = x.masked_fill(~causal_mask(x.shape[-2], x.shape[-1], device=x.device), float("-inf"))
    if x.shape[dim] == 0:  # nothing to normalise (amax cannot reduce an empty dim)
        return x.clone().to(dtype)
    # torch.softmax gives NaN on a row of -inf; zero it before and after (detached max, so the
    # zeroed rows also get a zero gradient).
    dead = x.detach().amax(dim, keepdim=True) == float("-inf")
    return torch.softmax(x.masked_fill(dead, 0.0), dim).masked_fill(dead, 0.0).to(dtype)
