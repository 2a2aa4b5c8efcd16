"""The cuda backend of `fusedattn.attention`: the CUDA C++ flash attention of fusedattn._C
(csrc/attention/), forward and backward through the custom ops of custom_ops.py."""

from __future__ import annotations

import functools

import torch

from ..._build import toolkit
from ...fp8 import FP8_DTYPES
from ...masks import NO_WINDOW
from ..core import backends
from ..core.kernels import MAX_HEAD_DIM, extension_op_refusals
from . import custom_ops

CUDA_DTYPES = (torch.float16, torch.bfloat16)

attention = functools.partial(custom_ops.run, backend="cuda")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _head_dims_of(extension) -> tuple[int, ...]:
    return tuple(extension.build_info()["attention_head_dims"])


def built_head_dims() -> tuple[int, ...]:
    """The attention head dims of the loaded fusedattn._C, or those a first-use build would
    compile (FUSEDATTN_CUDA_HEAD_DIMS; ValueError when it is malformed)."""
    if backends.EXTENSION is not None:
        return _head_dims_of(backends.EXTENSION)
    return toolkit.head_dims()


def refusals(
    *,
    q,
    k,
    v,
    window=NO_WINDOW,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    return_lse=False,
    attn_mask=None,
    score_mod=None,
    **_inputs,
) -> list[str]:
    """Why the CUDA C++ attention cannot take these inputs ([] = it can). fp32 is refused
    (tensor cores take fp16/bf16; auto then routes fp32 to torch or Triton), and so are the
    variants its kernels do not have yet (auto routes them to Triton), and an lse returned
    where a backward is recorded: its backward kernels have no term for the lse's gradient,
    so a loss reading the lse would lose that part of dq and dk (issue #82)."""
    reasons = extension_op_refusals("attention")
    if score_mod is not None:
        reasons.append("the CUDA attention takes no score_mod (backend='triton' runs it in its "
                       "kernels)")  # fmt: skip
    if (
        return_lse
        and torch.is_grad_enabled()
        and any(t is not None and t.requires_grad for t in (q, k, v, attn_mask, sinks))
    ):
        reasons.append(
            "the CUDA attention's backward has no gradient for the lse: return_lse=True with "
            "a backward recorded runs on backend='triton' (which differentiates it) or under "
            "torch.no_grad()"
        )
    if window.bounded and not window.is_top_left_causal:
        reasons.append(
            f"the CUDA attention has top-left causal only, not the window (left={window.left}, "
            f"right={window.right}{', bottom-right' if window.bottom_right else ''})"
        )
    for name, unused in (("softcap", softcap == 0.0), ("alibi_slopes", alibi_slopes is None),
                         ("sinks", sinks is None)):  # fmt: skip
        if not unused:
            reasons.append(f"the CUDA attention does not take {name} yet")
    if q.dtype in FP8_DTYPES or k.dtype in FP8_DTYPES:
        reasons.append("the CUDA attention has no fp8 path (the Triton backend runs fp8 fused)")
    elif q.dtype not in CUDA_DTYPES:
        reasons.append(f"the CUDA attention takes float16 and bfloat16, got {q.dtype}")
    D, Dv = q.shape[-1], v.shape[-1]
    try:
        largest = max(built_head_dims())
    except ValueError as exc:
        reasons.append(str(exc))
        largest = MAX_HEAD_DIM
    if max(D, Dv) > largest:
        built = "" if largest == MAX_HEAD_DIM else f" (this build: {toolkit.HEAD_DIMS_ENV})"
        reasons.append(f"head dims up to {largest}{built}, got D={D}, Dv={Dv}")
    if D % 8 or Dv % 8:
        reasons.append(f"the CUDA attention needs head dims that are multiples of 8 (16-byte "
                       f"loads), got D={D}, Dv={Dv}")  # fmt: skip
    if q.is_cuda and _capability(q.device.index or 0) < (8, 0):
        reasons.append("the CUDA attention needs compute capability 8.0 or newer")
    return reasons


def varlen_refusals(**inputs) -> list[str]:
    return ["the CUDA attention has no packed variable-length kernel yet (backend='triton' has)"]
