"""FlexAttention's two halves on the Triton kernels: `attention(..., block_mask=)` (the
block-sparse loops of triton_kernels/attention_blocks.py) and `score_mod=` (a generated
function the kernels call per tile, fusedattn/score_mod/), alone or together, dense or packed.

The forward and backward are custom_ops.py's (_attention_forward, _attention_backward) with
the block mask and the score_mod handed to the Triton launch. Eager calls run them through
an autograd.Function, with a plan per metadata after the first (plans.FlexPlan: the checks,
the launch arguments and the bound launchers kept; each call hands over its lists and
captures); while torch.compile records, as two torch.library custom ops carrying the mask as
its tensors and sizes and the mod as its structure's name (registered when it was traced)
and its captured tensors, so a compiled graph is one op each way.

Captured tensors that require grad get their gradient from the dQ kernel (float32 atomics,
returned in the tensor's dtype). Atomics add in no fixed order: under
torch.use_deterministic_algorithms(True) a capture is allowed only where each of its entries
gets one term (`mod_gradient_refusal`), and refused by name otherwise.

A user's attn_mask in the same call as a block mask is merged with it (dense, as the user's
mask already is); the lists still skip the blocks the mask hides.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ...block_mask import KernelBlocks
from ...checks import check_descale_values
from ...score_mod import ScoreMod, ScoreModError, registered
from ..core.plans import tracing
from . import custom_ops


def merge_dense(attn_mask: torch.Tensor | None, bm: KernelBlocks) -> torch.Tensor:
    """attn_mask AND the block mask, as one dense mask (bool stays bool; a float mask gets
    -inf where the block mask hides a key). O(Tq x Tk): the reference and torch backends run
    it, and the Triton kernels where the call has an attn_mask of its own."""
    dense = bm.dense_mask()
    if attn_mask is None:
        return dense
    if attn_mask.dtype == torch.bool:
        return attn_mask & dense
    return attn_mask.masked_fill(~dense, float("-inf"))


def _mask(tensors, sizes) -> KernelBlocks | None:
    if not tensors:
        return None
    kv_lists, kv_kinds, q_lists, q_kinds, bits = tensors
    q_len, kv_len, bs_q, bs_k = sizes
    return KernelBlocks((q_len, kv_len), (bs_q, bs_k), kv_lists, kv_kinds, q_lists, q_kinds, bits)


def _parts(bm: KernelBlocks | None):
    if bm is None:
        return [], []
    return [bm.kv_lists, bm.kv_kinds, bm.q_lists, bm.q_kinds, bm.bits], [
        *bm.seq_lengths,
        *bm.block_size,
    ]


def _mod(name: str, tensors) -> ScoreMod | None:
    if not name:
        return None
    compiled = registered(name)
    return ScoreMod(None, compiled, list(tensors), compiled.names)


def mod_gradient_refusal(mod: ScoreMod, wanted, B: int, H: int, Tq: int, Tk: int) -> str | None:
    """Why the captures' gradients cannot be summed in a fixed order (None: they can, or
    determinism is not asked for). Under torch.use_deterministic_algorithms(True) a capture
    that wants a gradient must be read once, each dimension indexed by a constant or by one
    of b, h, q_idx, kv_idx itself (each at most once), and every index of those the call has
    more than one of present: then each entry gets one term, and its atomic add is exact."""
    if not torch.are_deterministic_algorithms_enabled():
        return None
    extents = {"b": B, "h": H, "q_idx": Tq, "kv_idx": Tk}
    for c, want in enumerate(wanted):
        if not want:
            continue
        loads = mod.loads(c)
        inputs = [d for d in loads[0] if d not in (None, "const")] if loads else []
        one_term = (
            len(loads) == 1
            and None not in loads[0]
            and len(set(inputs)) == len(inputs)
            and all(extents[name] == 1 for name in extents if name not in inputs)
        )
        if not one_term:
            return (
                f"torch.use_deterministic_algorithms(True): the gradient of `{mod.names[c]}`, "
                f"captured by score_mod {mod.description}, is summed with float32 atomics in "
                "no fixed order, since its entries get more than one term (an index other "
                "than b, h, q_idx, kv_idx themselves, or one of them missing); detach it, or "
                "run backend='torch' (dense)"
            )
    return None


def gradient_buffers(mod: ScoreMod | None, wanted) -> list[torch.Tensor | None] | None:
    """float32 zeros shaped like each capture that wants a gradient (None for the others)."""
    if mod is None or not any(wanted):
        return None
    return [
        torch.zeros(t.shape, dtype=torch.float32, device=t.device) if w else None
        for t, w in zip(mod.tensors, wanted, strict=True)
    ]


def _backward(do, q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, max_q, max_k,
              block, mod, wanted, scalars, seed, mask_grad, dlse, launch=None):  # fmt: skip
    """(dq, dk, dv, dS, dsinks, the captures' gradients in their dtypes (None where not
    wanted))."""
    buffers = gradient_buffers(mod, wanted)
    dq, dk, dv, dmask, dsinks = custom_ops._attention_backward(
        do, q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, max_q, max_k,
        *scalars, seed, mask_grad, "triton", launch=launch, block=block, dlse=dlse, mod=mod,
        mod_grads=buffers,
    )  # fmt: skip
    grads = [None] * (0 if mod is None else len(mod.tensors))
    if buffers is not None:
        grads = [None if g is None else g.to(t.dtype)
                 for g, t in zip(buffers, mod.tensors, strict=True)]  # fmt: skip
    return dq, dk, dv, dmask, dsinks, grads


# ---- the custom ops (what torch.compile records) -------------------------------------------


@torch.library.custom_op("fusedattn::flex_attention_fwd", mutates_args=())
def flex_attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_tensors: list[torch.Tensor],
    block_sizes: list[int],
    mod_name: str,
    mod_tensors: list[torch.Tensor],
    window_left: int,
    window_right: int,
    bottom_right: bool,
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out, lse fp32) as custom_ops.attention_fwd, over the blocks the mask lists (none:
    every block) and through the score_mod named (none: "")."""
    out, lse, _ = custom_ops._attention_forward(
        q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right, scale, softcap,
        dropout_p, seed, "triton", block=_mask(block_tensors, block_sizes),
        mod=_mod(mod_name, mod_tensors),
    )  # fmt: skip
    return out, lse


@flex_attention_fwd.register_fake
def _(q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, block_tensors, block_sizes, mod_name, mod_tensors,
      window_left, window_right, bottom_right, scale, softcap, dropout_p, seed):  # fmt: skip
    if cu_seqlens_q is not None:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        return out, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    B, H, Tq, _ = q.shape
    return custom_ops._empty_out(q, v.shape[-1]), q.new_empty(B, H, Tq, dtype=torch.float32)


@torch.library.custom_op("fusedattn::flex_attention_bwd", mutates_args=())
def flex_attention_bwd(
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
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    block_tensors: list[torch.Tensor],
    block_sizes: list[int],
    mod_name: str,
    mod_tensors: list[torch.Tensor],
    mod_wanted: list[bool],
    window_left: int,
    window_right: int,
    bottom_right: bool,
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    mask_grad: bool,
    dlse: torch.Tensor | None = None,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]
]:
    """-> (dq, dk, dv, dS, dsinks, the captures' gradients: empty where not wanted)."""
    dq, dk, dv, dmask, dsinks, grads = _backward(
        do, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, _mask(block_tensors, block_sizes),
        _mod(mod_name, mod_tensors), tuple(mod_wanted),
        (window_left, window_right, bottom_right, scale, softcap, dropout_p), seed, mask_grad,
        dlse,
    )  # fmt: skip
    empty = q.new_empty(0, dtype=torch.float32)
    return (
        dq,
        dk,
        dv,
        empty if dmask is None else dmask,
        empty.clone() if dsinks is None else dsinks,
        [empty.clone() if g is None else g for g in grads],
    )


@flex_attention_bwd.register_fake
def _(do, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
      cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_tensors, block_sizes, mod_name,
      mod_tensors, mod_wanted, window_left, window_right, bottom_right, scale, softcap,
      dropout_p, seed, mask_grad, dlse=None):  # fmt: skip
    shape = (*q.shape[:3], k.shape[2]) if mask_grad else (0,)
    dsinks = (0,) if sinks is None else sinks.shape
    grads = [torch.empty_like(t) if w else t.new_empty(0, dtype=torch.float32)
             for t, w in zip(mod_tensors, mod_wanted, strict=True)]  # fmt: skip
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty(shape, dtype=torch.float32), q.new_empty(dsinks, dtype=torch.float32),
            grads)  # fmt: skip


def _setup(ctx, inputs, output):
    (q, k, v, attn_mask, kpm, slopes, sinks, cu_q, cu_k, max_q, max_k, block_tensors,
     block_sizes, mod_name, mod_tensors, *scalars, seed) = inputs  # fmt: skip
    ctx.save_for_backward(q, k, v, *output, attn_mask, kpm, slopes, sinks, cu_q, cu_k, seed,
                          *block_tensors, *mod_tensors)  # fmt: skip
    ctx.sizes = (max_q, max_k, list(block_sizes), len(block_tensors))
    ctx.mod_name, ctx.scalars = mod_name, tuple(scalars)
    ctx.mod_wanted = [t.requires_grad for t in mod_tensors]
    ctx.sinks_dtype = None if sinks is None else sinks.dtype


def _op_backward(ctx, dout, dlse):
    """The lse is differentiable, as the dense call's (custom_ops._grads)."""
    q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, seed, *rest = ctx.saved_tensors
    max_q, max_k, block_sizes, n_block = ctx.sizes
    block_tensors, mod_tensors = rest[:n_block], rest[n_block:]
    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
    dq, dk, dv, dscores, dsinks, grads = torch.ops.fusedattn.flex_attention_bwd(
        dout, q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, max_q, max_k,
        block_tensors, block_sizes, ctx.mod_name, mod_tensors, ctx.mod_wanted, *ctx.scalars,
        seed, mask_grad, dlse,
    )  # fmt: skip
    dmask = dscores.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if mask_grad else None
    dsinks = dsinks.to(ctx.sinks_dtype) if ctx.needs_input_grad[6] else None
    grads = [g if w else None for g, w in zip(grads, ctx.mod_wanted, strict=True)]
    # the inputs' structure: the tensor lists get lists; torch.library flattens an int list
    # to one leaf, an empty one to an empty list
    sizes_grad = None if block_sizes else []
    return (dq, dk, dv, dmask, None, None, dsinks, None, None, None, None,
            [None] * n_block, sizes_grad, None, grads) + (None,) * 7  # fmt: skip


flex_attention_fwd.register_autograd(_op_backward, setup_context=_setup)


# ---- eager calls -----------------------------------------------------------------------------


class EagerFlexAttention(torch.autograd.Function):
    """The same forward and backward for eager calls, without torch.library's dispatch layer,
    the forward's launch reused by the backward, the captured tensors as inputs so that
    autograd routes their gradients."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, kpm, slopes, sinks, cu_q, cu_k, rest, block, mod,
                template, *mod_tensors):  # fmt: skip
        max_q, max_k, *scalars, seed = rest
        out, lse, ctx.launch = custom_ops._attention_forward(
            q, k, v, attn_mask, kpm, slopes, sinks, cu_q, cu_k, max_q, max_k, *scalars, seed,
            "triton", template=template, block=block, mod=mod,
        )  # fmt: skip
        ctx.save_for_backward(q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, seed)
        ctx.rest, ctx.block, ctx.mod = (max_q, max_k, tuple(scalars)), block, mod
        ctx.mod_wanted = tuple(t.requires_grad for t in mod_tensors) if mod_tensors else ()
        ctx.sinks_dtype = None if sinks is None else sinks.dtype
        ctx.set_materialize_grads(False)  # an unread lse's gradient stays None: no dlse term
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, seed = ctx.saved_tensors
        max_q, max_k, scalars = ctx.rest
        mask_grad = (
            attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
        )
        if dout is None:
            dout = torch.zeros_like(out)
        wanted = ctx.mod_wanted and tuple(
            w and n for w, n in zip(ctx.mod_wanted, ctx.needs_input_grad[13:], strict=True)
        )  # fmt: skip
        dq, dk, dv, dscores, dsinks, grads = _backward(
            dout, q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, max_q, max_k,
            ctx.block, ctx.mod, wanted, scalars, seed, mask_grad, dlse, launch=ctx.launch,
        )  # fmt: skip
        dmask = dscores.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if mask_grad else None
        dsinks = dsinks.to(ctx.sinks_dtype) if ctx.needs_input_grad[6] else None
        return (dq, dk, dv, dmask, None, None, dsinks, None, None, None, None, None, None,
                *grads)  # fmt: skip


def run(q, k, v, attn_mask, dropout_p, scale, key_padding_mask, window, softcap, alibi_slopes,
        sinks, return_lse, block_mask=None, score_mod=None, cu_seqlens_q=None,
        cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0, q_descale=None, k_descale=None,
        v_descale=None, out_dtype=None, template=None):  # fmt: skip
    """The Triton backend of attention(..., block_mask=bm, score_mod=mod) and of
    varlen_attention(..., score_mod=mod): bm the mask's KernelBlocks on q's device or None,
    mod a ScoreMod or None. template: a plan's TritonAttentionLaunch for this call's
    metadata (plans.FlexPlan: an eager dense-layout call, no fp8), bound to bm and mod."""
    q, k, v = custom_ops._kernel_layout("triton", q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if attn_mask is not None and block_mask is not None:
        attn_mask = merge_dense(attn_mask, block_mask)
    mod_tensors = [] if score_mod is None else score_mod.tensors
    grad = torch.is_grad_enabled()
    wanted = tuple(grad and t.requires_grad for t in mod_tensors)
    if any(wanted):
        varlen = cu_seqlens_q is not None
        B = cu_seqlens_q.shape[0] - 1 if varlen else q.shape[0]
        H = q.shape[1]
        Tq, Tk = (max_seqlen_q, max_seqlen_k) if varlen else (q.shape[2], k.shape[2])
        refusal = mod_gradient_refusal(score_mod, wanted, B, H, Tq, Tk)
        if refusal:
            raise ScoreModError(refusal)
    window_args = (window.left, window.right, window.bottom_right)
    if out_dtype is not None:  # fp8: inference only, eager
        if tracing():
            raise ValueError("block_mask or score_mod with an fp8 attention runs eagerly only "
                             "(not under torch.compile yet)")  # fmt: skip
        if not q.is_cuda:
            check_descale_values(q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
        out, lse, _ = custom_ops._attention_forward(
            q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k, *window_args, scale, softcap, 0.0, None,
            "triton", out_dtype=out_dtype, descales=(q_descale, k_descale, v_descale),
            block=block_mask, mod=score_mod,
        )  # fmt: skip
        return (out, lse) if return_lse else out
    seed = custom_ops.dropout_seed(dropout_p, q.device)
    tensors = (q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
               cu_seqlens_k)  # fmt: skip
    scalars = (*window_args, scale, softcap, float(dropout_p))
    if tracing():
        block_tensors, sizes = _parts(block_mask)
        out, lse = torch.ops.fusedattn.flex_attention_fwd(
            *tensors, max_seqlen_q, max_seqlen_k, block_tensors, sizes,
            "" if score_mod is None else score_mod.name, list(mod_tensors), *scalars, seed,
        )  # fmt: skip
    else:
        autograd = grad and (any(t is not None and t.requires_grad for t in tensors)
                             or any(wanted))  # fmt: skip
        out, lse = eager(tensors, (max_seqlen_q, max_seqlen_k, *scalars, seed), block_mask,
                         score_mod, autograd, template)  # fmt: skip
    return (out, lse) if return_lse else out


def eager(tensors, rest, block, mod, autograd: bool, template=None):
    """An eager call's (out, lse) on the Triton kernels: tensors (q, k, v, attn_mask,
    key_padding_mask, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k; custom_ops lays
    them out for the kernels), rest (max_seqlen_q, max_seqlen_k, window left, right, bottom_right, scale,
    softcap, dropout_p, seed); autograd: whether a backward is recorded (the captures'
    gradients included); template: a plan's launch template (plans.FlexPlan)."""
    if autograd:
        return EagerFlexAttention.apply(*tensors, rest, block, mod, template,
                                        *(() if mod is None else mod.tensors))  # fmt: skip
    out, lse, _ = custom_ops._attention_forward(*tensors, *rest, "triton", template=template,
                                                block=block, mod=mod)  # fmt: skip
    return out, lse
