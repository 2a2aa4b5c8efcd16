"""`fusedattn.attention(..., block_mask=)` on the Triton kernels: the block-sparse forward and
backward (triton_kernels/attention_blocks.py) as torch.library custom ops, so that
torch.compile(fullgraph=True) records one op each way with the mask's tensors as inputs.

The forward and backward are custom_ops.py's (_attention_forward, _attention_backward) with
the block mask handed to the Triton launch; the op carries the mask as its tensors and sizes,
rebuilt into a BlockMask inside (a dataclass: no copy). A user's attn_mask in the same call is
merged with the block mask here (dense, as the user's mask already is); the lists still skip
the blocks the mask hides.
"""

from __future__ import annotations

import math

import torch

from ...block_mask import BlockMask
from ...checks import check_descale_values
from ..core.plans import tracing
from . import custom_ops


def merge_dense(attn_mask: torch.Tensor | None, bm: BlockMask) -> torch.Tensor:
    """attn_mask AND the block mask, as one dense mask (bool stays bool; a float mask gets
    -inf where the block mask hides a key). O(Tq x Tk): the reference and torch backends run
    it, and the Triton kernels where the call has an attn_mask of its own."""
    dense = bm.to_dense()
    if attn_mask is None:
        return dense
    if attn_mask.dtype == torch.bool:
        return attn_mask & dense
    return attn_mask.masked_fill(~dense, float("-inf"))


def _mask(tensors, sizes) -> BlockMask:
    kv_lists, kv_kinds, q_lists, q_kinds, bits = tensors
    q_len, kv_len, bs_q, bs_k = sizes
    return BlockMask((q_len, kv_len), (bs_q, bs_k), kv_lists, kv_kinds, q_lists, q_kinds, bits)


def _parts(bm: BlockMask):
    return (bm.kv_lists, bm.kv_kinds, bm.q_lists, bm.q_kinds, bm.bits), [
        *bm.seq_lengths,
        *bm.block_size,
    ]


@torch.library.custom_op("fusedattn::block_sparse_attention_fwd", mutates_args=())
def block_sparse_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    block_tensors: list[torch.Tensor],
    block_sizes: list[int],
    window_left: int,
    window_right: int,
    bottom_right: bool,
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out (B, Hq, Tq, Dv), lse (B, Hq, Tq) fp32) over the blocks the mask lists."""
    out, lse, _ = custom_ops._attention_forward(
        q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, None, None, 0, 0, window_left,
        window_right, bottom_right, scale, softcap, dropout_p, seed, "triton",
        block=_mask(block_tensors, block_sizes),
    )  # fmt: skip
    return out, lse


@block_sparse_attention_fwd.register_fake
def _(q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, block_tensors, block_sizes,
      window_left, window_right, bottom_right, scale, softcap, dropout_p, seed):  # fmt: skip
    B, H, Tq, _ = q.shape
    return custom_ops._empty_out(q, v.shape[-1]), q.new_empty(B, H, Tq, dtype=torch.float32)


@torch.library.custom_op("fusedattn::block_sparse_attention_bwd", mutates_args=())
def block_sparse_attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    block_tensors: list[torch.Tensor],
    block_sizes: list[int],
    window_left: int,
    window_right: int,
    bottom_right: bool,
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    mask_grad: bool,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv, dS, dsinks) as custom_ops.attention_bwd, over the listed blocks (dlse:
    the lse's gradient)."""
    dq, dk, dv, dmask, dsinks = custom_ops._attention_backward(
        do, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, sinks, None, None, 0,
        0, window_left, window_right, bottom_right, scale, softcap, dropout_p, seed, mask_grad,
        "triton", block=_mask(block_tensors, block_sizes), dlse=dlse,
    )  # fmt: skip
    empty = q.new_empty(0, dtype=torch.float32)
    return (
        dq,
        dk,
        dv,
        empty if dmask is None else dmask,
        empty.clone() if dsinks is None else dsinks,
    )


@block_sparse_attention_bwd.register_fake
def _(do, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, sinks, block_tensors,
      block_sizes, window_left, window_right, bottom_right, scale, softcap, dropout_p, seed,
      mask_grad, dlse=None):  # fmt: skip
    shape = (*q.shape[:3], k.shape[2]) if mask_grad else (0,)
    dsinks = (0,) if sinks is None else sinks.shape
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(shape, dtype=torch.float32), q.new_empty(dsinks, dtype=torch.float32))  # fmt: skip


def _setup(ctx, inputs, output):
    (q, k, v, attn_mask, kpm, slopes, sinks, block_tensors, block_sizes, *scalars, seed) = inputs
    ctx.save_for_backward(q, k, v, *output, attn_mask, kpm, slopes, sinks, seed, *block_tensors)
    ctx.block_sizes, ctx.scalars = list(block_sizes), tuple(scalars)
    ctx.sinks_dtype = None if sinks is None else sinks.dtype


def _backward(ctx, dout, dlse):
    """The lse is differentiable, as the dense call's (custom_ops._grads)."""
    q, k, v, out, lse, attn_mask, kpm, slopes, sinks, seed, *block_tensors = ctx.saved_tensors
    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
    dq, dk, dv, dscores, dsinks = torch.ops.fusedattn.block_sparse_attention_bwd(
        dout, q, k, v, out, lse, attn_mask, kpm, slopes, sinks, block_tensors, ctx.block_sizes,
        *ctx.scalars, seed, mask_grad, dlse,
    )  # fmt: skip
    dmask = dscores.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if mask_grad else None
    dsinks = dsinks.to(ctx.sinks_dtype) if ctx.needs_input_grad[6] else None
    # the inputs' structure: the block mask's tensors are a list (no gradient each)
    return (dq, dk, dv, dmask, None, None, dsinks, [None] * len(block_tensors)) + (None,) * 8


block_sparse_attention_fwd.register_autograd(_backward, setup_context=_setup)


def run(q, k, v, attn_mask, dropout_p, scale, key_padding_mask, window, softcap, alibi_slopes,
        sinks, return_lse, block_mask, q_descale=None, k_descale=None, v_descale=None,
        out_dtype=None):  # fmt: skip
    """The Triton backend of attention(..., block_mask=bm), bm a BlockMask on q's device."""
    q, k, v = custom_ops._kernel_layout("triton", q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if attn_mask is not None:
        attn_mask = merge_dense(attn_mask, block_mask)
    if out_dtype is not None:  # fp8: inference only, eager
        if tracing():
            raise ValueError("block_mask with an fp8 attention runs eagerly only (not under "
                             "torch.compile yet)")  # fmt: skip
        if not q.is_cuda:
            check_descale_values(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        out, lse, _ = custom_ops._attention_forward(
            q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, None, None, 0, 0,
            window.left, window.right, window.bottom_right, scale, softcap, 0.0, None, "triton",
            out_dtype=out_dtype, descales=(q_descale, k_descale, v_descale), block=block_mask,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    seed = None
    if dropout_p > 0.0:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
    tensors, sizes = _parts(block_mask)
    out, lse = torch.ops.fusedattn.block_sparse_attention_fwd(
        q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, list(tensors), sizes,
        window.left, window.right, window.bottom_right, scale, softcap, float(dropout_p), seed,
    )  # fmt: skip
    return (out, lse) if return_lse else out
