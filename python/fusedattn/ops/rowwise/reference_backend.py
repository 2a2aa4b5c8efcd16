"""The reference backend of the row-wise ops: the naive twins of fusedattn.reference."""

from __future__ import annotations

from ... import reference


def layer_norm(x, normalized_shape, weight, bias, eps):
    return reference.layer_norm(x, normalized_shape, weight, bias, eps)


def rms_norm(x, normalized_shape, weight, eps):
    return reference.rms_norm(x, normalized_shape, weight, eps)


def softmax(x, dim, mask, scale, is_causal):
    return reference.softmax(x, dim, mask=mask, scale=scale, is_causal=is_causal)
