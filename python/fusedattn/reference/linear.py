"""Naive linear: the plain-torch twin of `fusedattn.linear` (F.linear's semantics),
y = x @ weight^T + bias, in x's dtype."""

from __future__ import annotations

import torch

from ..checks import check_linear_args


def linear(x, weight, bias=None):
    check_linear_args(x, weight, bias)
    y = torch.matmul(x, weight.t())
    return y if bias is None else y + bias
