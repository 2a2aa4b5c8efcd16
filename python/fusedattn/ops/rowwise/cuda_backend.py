"""The cuda backend of the row-wise ops: the kernels of csrc/layernorm/ (both norms) and csrc/softmax/ in
fusedattn._C, launched by norm_ops.py and softmax_ops.py
(the custom ops and autograd are shared with the other kernel backend)."""

from __future__ import annotations

from ..core.kernels import dtype_refusals, extension_op_refusals
from . import norm_ops, softmax_ops

BACKEND = "cuda"


def layer_norm(x, normalized_shape, weight, bias, eps):
    return norm_ops.run_layer_norm(x, normalized_shape, weight, bias, eps, BACKEND)


def rms_norm(x, normalized_shape, weight, eps):
    return norm_ops.run_rms_norm(x, normalized_shape, weight, eps, BACKEND)


def softmax(x, dim, mask, scale, is_causal):
    scale = 1.0 if scale is None else float(scale)
    return softmax_ops.softmax(x, dim, mask, scale, is_causal, BACKEND)


def layer_norm_refusals(*, x, weight, bias, **_inputs) -> list[str]:
    return dtype_refusals(x, weight, bias, backend=BACKEND) + extension_op_refusals("layer_norm")


def rms_norm_refusals(*, x, weight, **_inputs) -> list[str]:
    return dtype_refusals(x, weight, backend=BACKEND) + extension_op_refusals("rms_norm")


def softmax_refusals(*, x, mask, **_inputs) -> list[str]:
    reasons = dtype_refusals(x, backend=BACKEND) + extension_op_refusals("softmax")
    if mask is not None and mask.requires_grad:
        reasons.append(f"the {BACKEND} softmax has no gradient for a float mask")
    return reasons
