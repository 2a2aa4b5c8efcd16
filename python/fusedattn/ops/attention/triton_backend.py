"""The triton backend of `fusedattn.attention` and `fusedattn.varlen_attention`: the flash
attention kernels of triton_kernels/attention.py (forward and backward through custom_ops.py,
launch arguments from triton_args.py), and for the paged prefill the decode kernel with packed
queries (shared/decode_launch.py)."""

from __future__ import annotations

import functools

import torch

from ... import invariance
from ...fp8 import is_fp8
from ..core.kernels import KERNEL_DTYPES, MAX_HEAD_DIM
from ..core.outputs import new_output
from ..core.plans import tracing
from ..shared.decode_launch import launch_decode
from . import custom_ops

attention = functools.partial(custom_ops.run, backend="triton")


def refusals(*, q, v, alibi_slopes=None, **inputs) -> list[str]:
    """Why the Triton attention cannot take these inputs ([] = it can)."""
    reasons = []
    if q.dtype not in KERNEL_DTYPES and not is_fp8(q):
        reasons.append(f"the Triton attention takes float16, bfloat16 and float32, got {q.dtype}")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        reasons.append(f"head dims up to {MAX_HEAD_DIM}, got D={q.shape[-1]}, Dv={v.shape[-1]}")
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        reasons.append("the Triton attention has no gradient for alibi_slopes (detach them)")
    return reasons


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                     scale, window, softcap, alibi_slopes, sinks, return_lse, block_table=None,
                     q_descale=None, k_descale=None, v_descale=None, out_dtype=None):  # fmt: skip
    """The Triton varlen attention; over a paged cache the decode kernel's packed-query form
    (shared/decode_launch.launch_decode): K/V read in place through the block table, never
    gathered."""
    descales = (q_descale, k_descale, v_descale)
    if block_table is None and _invariant_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, window,
                                                  dropout_p, alibi_slopes):  # fmt: skip
        # fusedattn.batch_invariant: the decode kernel's tiles and splits, so that a prompt's
        # prefill gives the bits of its chunked or token-by-token run (packed K/V read as a
        # paged cache of one-row pages)
        block_table = _row_table(cu_seqlens_k, max_seqlen_k)
        k, v = k.unsqueeze(1), v.unsqueeze(1)
    if block_table is None:
        return custom_ops.run_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale,
            window, softcap, alibi_slopes, sinks, return_lse, backend="triton",
            descales=descales, out_dtype=out_dtype,
        )  # fmt: skip
    if q.stride(-1) != 1:
        q = q.contiguous()
    dtype = q.dtype if out_dtype is None else out_dtype
    out = new_output((q.shape[0], q.shape[1], v.shape[-1]), dtype, q.device)
    lse = new_output((q.shape[1], q.shape[0]), torch.float32, q.device)
    if out.numel():
        lengths = cu_seqlens_k[1:] - cu_seqlens_k[:-1]
        launch_decode(q, k, v, out, lse, lengths, block_table, None, None, cu_seqlens_q,
                      cu_seqlens_q.shape[0] - 1, max_seqlen_q, scale, window, softcap,
                      alibi_slopes, sinks, 0, descales=descales)  # fmt: skip
    return (out, lse) if return_lse else out


def _invariant_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, window, dropout_p, alibi_slopes):
    """Whether a packed varlen call runs the decode kernel (batch invariance): inference, no
    dropout, and queries bottom-right of their keys as the decode kernel places them (a
    bottom-right call, or one with no positional term, or a top-left one whose sequences have
    as many queries as keys: equal prefix sums, a prefill). The prefix sums are compared by
    value (vLLM and flash-attn callers pass equal tensors that are not one object, issue
    #82): free on a CPU, a sync on a GPU, only for a top-left positional call under the
    switch; a traced call cannot read them and takes the decode kernel only when they are
    one tensor."""
    if not invariance.enabled() or dropout_p > 0.0:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return False
    positional = window.bounded or alibi_slopes is not None
    if not positional or window.bottom_right or cu_seqlens_q is cu_seqlens_k:
        return True
    if tracing():
        return False
    return cu_seqlens_q.shape == cu_seqlens_k.shape and torch.equal(cu_seqlens_q, cu_seqlens_k)


def _row_table(cu_seqlens_k, max_seqlen_k):
    """(B, max_seqlen_k) int32: sequence b's key j is packed row cu_seqlens_k[b] + j (entries
    past a sequence's length are never read)."""
    j = torch.arange(max(int(max_seqlen_k), 1), device=cu_seqlens_k.device, dtype=torch.int32)
    return (cu_seqlens_k[:-1, None].to(torch.int32) + j).contiguous()
