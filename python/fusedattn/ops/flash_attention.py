"""The flash attention of both kernel backends (Triton, CUDA C++) as torch.library custom ops
with fake implementations and autograd, so torch.compile(fullgraph=True) sees one opaque op
each way. One op per direction serves both backends (`backend` is "triton" or "cuda"): the
output layout, the autograd glue and the float-mask gradient exist once. Signatures say
Optional[...]: torch.library reads typing.Optional on every torch we support.
"""

import functools
import math
import os
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..masks import NO_WINDOW
from .attention_launch import TritonAttentionLaunch
from .rowwise import (
    KERNEL_DTYPES,
    extension,
    extension_op_refusals,
    new_output,
    new_output_like,
    tracing,
)

MAX_HEAD_DIM = 256
CUDA_DTYPES = (torch.float16, torch.bfloat16)

# Which backward the CUDA attention runs (the extension's BackwardKernel): "split" is dQ by query
# block and dK/dV by key block; "fused" one pass per key block with per-split fp32 dQ partials,
# where it applies (no attn_mask or dropout, padded head dim 64 or 128, the shared memory, and
# enough (batch, kv head) pairs to fill the GPU with at most 4 splits), else "split". Both are
# deterministic. "auto" is the launch policy's choice (attention_launch.cuh:
# fused_backward_by_default, from the H100 timings). Read at every backward, so benchmarks and
# tests can switch it.
CUDA_BACKWARD_ENV = "FUSEDATTN_CUDA_BACKWARD"
CUDA_BACKWARD_KERNELS = {"auto": 0, "split": 1, "fused": 2}


def cuda_backward_kernel() -> int:
    """The extension's BackwardKernel for FUSEDATTN_CUDA_BACKWARD (unset: auto)."""
    name = os.environ.get(CUDA_BACKWARD_ENV, "").strip() or "auto"
    if name not in CUDA_BACKWARD_KERNELS:
        raise ValueError(
            f"{CUDA_BACKWARD_ENV}={name!r}: expected one of {', '.join(CUDA_BACKWARD_KERNELS)}"
        )
    return CUDA_BACKWARD_KERNELS[name]


def triton_refusals(*, q, v, alibi_slopes=None, **_inputs) -> list[str]:
    """Why the Triton attention cannot take these inputs ([] = it can)."""
    reasons = []
    if q.dtype not in KERNEL_DTYPES:
        reasons.append(f"the Triton attention takes float16, bfloat16 and float32, got {q.dtype}")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        reasons.append(f"head dims up to {MAX_HEAD_DIM}, got D={q.shape[-1]}, Dv={v.shape[-1]}")
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        reasons.append("the Triton attention has no gradient for alibi_slopes (detach them)")
    return reasons


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_refusals(
    *, q, k, v, window=NO_WINDOW, softcap=0.0, alibi_slopes=None, sinks=None, **_inputs
) -> list[str]:
    """Why the CUDA C++ attention cannot take these inputs ([] = it can). fp32 is refused
    (tensor cores take fp16/bf16; auto then routes fp32 to torch or Triton), and so are the
    variants its kernels do not have yet (auto routes them to Triton)."""
    reasons = extension_op_refusals("attention")
    if window.bounded and not window.is_top_left_causal:
        reasons.append(
            f"the CUDA attention has top-left causal only, not the window (left={window.left}, "
            f"right={window.right}{', bottom-right' if window.bottom_right else ''})"
        )
    for name, unused in (("softcap", softcap == 0.0), ("alibi_slopes", alibi_slopes is None),
                         ("sinks", sinks is None)):  # fmt: skip
        if not unused:
            reasons.append(f"the CUDA attention does not take {name} yet")
    if q.dtype not in CUDA_DTYPES:
        reasons.append(f"the CUDA attention takes float16 and bfloat16, got {q.dtype}")
    D, Dv = q.shape[-1], v.shape[-1]
    if max(D, Dv) > MAX_HEAD_DIM:
        reasons.append(f"head dims up to {MAX_HEAD_DIM}, got D={D}, Dv={Dv}")
    if D % 8 or Dv % 8:
        reasons.append(f"the CUDA attention needs head dims that are multiples of 8 (16-byte "
                       f"loads), got D={D}, Dv={Dv}")  # fmt: skip
    if q.is_cuda and _capability(q.device.index or 0) < (8, 0):
        reasons.append("the CUDA attention needs compute capability 8.0 or newer")
    return reasons


def cuda_varlen_refusals(**inputs) -> list[str]:
    return ["the CUDA attention has no packed variable-length kernel yet (backend='triton' has)"]


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _cuda_aligned(t: torch.Tensor) -> bool:
    """The CUDA kernels copy 16 bytes at a time: unit last stride, 16-byte aligned base and
    row/head/batch strides (dims of size 1 are never stepped over)."""
    if t.numel() == 0:
        return True
    strides_ok = all(
        s % 8 == 0 for n, s in zip(t.shape[:-1], t.stride()[:-1], strict=True) if n > 1
    )
    return t.stride(-1) == 1 and strides_ok and t.data_ptr() % 16 == 0


def _kernel_layout(backend: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Views the kernels read as they are; a copy only where they cannot (a non-unit last
    stride; for CUDA, strides or a base that break 16-byte alignment)."""
    if backend == "cuda":
        return [t if _cuda_aligned(t) else t.contiguous() for t in tensors]
    return [_unit_last_stride(t) for t in tensors]


def _cuda_masks(q, k, attn_mask, key_padding_mask):
    """(attn_mask, key_padding_mask) as the CUDA kernels read them: the mask as a bool or fp32
    (B, H, Tq, Tk) broadcast view (a float mask is converted at its own, unexpanded size), the
    padding mask contiguous."""
    B, H, Tq, _ = q.shape
    mask = attn_mask
    if mask is not None:
        if mask.dtype != torch.bool:
            mask = mask.float()
        mask = mask.expand(B, H, Tq, k.shape[2])
    kpm = None if key_padding_mask is None else key_padding_mask.contiguous()
    return mask, kpm


def _empty_out(q: torch.Tensor, Dv: int, dtype=None) -> torch.Tensor:
    """(B, Hq, Tq, Dv) view of a (B, Tq, Hq, Dv) buffer: the merge of heads that follows in a
    module (out.transpose(1, 2).flatten(2)) is then free."""
    B, H, T, _ = q.shape
    return new_output((B, T, H, Dv), dtype or q.dtype, q.device).transpose(1, 2)


def _empty_out_like(q: torch.Tensor, Dv: int, varlen: bool, dtype=None) -> torch.Tensor:
    """The output: (B, Hq, Tq, Dv) as a view of a (B, Tq, Hq, Dv) buffer (the merge of heads
    that follows in a module is then free), or packed (total_q, Hq, Dv); in q's dtype unless
    another is asked for."""
    if varlen:
        return new_output((q.shape[0], q.shape[1], Dv), dtype or q.dtype, q.device)
    return _empty_out(q, Dv, dtype)


def _no_keys(out, lse, sinks):
    """The result when no query sees any key: 0 output; lse -inf, or each head's sink."""
    out.zero_()
    if sinks is None:
        return out, lse.fill_(float("-inf"))
    shape = [1] * lse.dim()
    shape[-2 if lse.dim() == 3 else 0] = -1
    return out, lse.copy_(sinks.float().view(shape).expand_as(lse))


def attention_fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: Optional[torch.Tensor],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out, lse fp32): (B, Hq, Tq, Dv) and (B, Hq, Tq), or packed (total_q, Hq, Dv) and
    (Hq, total_q) when cu_seqlens are given. With dropout_p > 0, `seed` (an int64 tensor on
    q's device) seeds the Philox stream the backward regenerates."""
    out, lse, _launch = _attention_forward(
        q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right, scale, softcap,
        dropout_p, seed, backend,
    )  # fmt: skip
    return out, lse


def _attention_forward(q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
                       cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right,
                       bottom_right, scale, softcap, dropout_p, seed, backend,
                       out_dtype=None, template=None):  # fmt: skip
    """attention_fwd_impl, also returning the Triton launch (None for CUDA) for the backward
    to reuse. out_dtype: the output's dtype if not q's (Triton: context parallelism keeps a
    block's output in fp32 for the merge). template: a plan's TritonAttentionLaunch for this
    call's metadata (attention_plan.py), bound to this call's tensors instead of building
    one."""
    q, k, v = _kernel_layout(backend, q, k, v)
    varlen = cu_seqlens_q is not None
    out = _empty_out_like(q, v.shape[-1], varlen, out_dtype)
    if backend == "cuda":
        lse = new_output(q.shape[:3], torch.float32, q.device)
        if out.numel() == 0 or k.shape[2] == 0:
            return out.zero_(), lse.fill_(float("-inf")), None
        is_causal = window_right == 0 and window_left < 0 and not bottom_right
        extension().attention_fwd(
            q, k, v, out, lse, *_cuda_masks(q, k, attn_mask, key_padding_mask), is_causal,
            scale, dropout_p, seed,
        )  # fmt: skip
        return out, lse, None
    if template is not None:
        L = template.bind(attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
                          cu_seqlens_k, seed)  # fmt: skip
    else:
        L = TritonAttentionLaunch(
            q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right,
            scale, softcap, dropout_p, seed,
        )  # fmt: skip
    lse = new_output(L.lse_shape, torch.float32, q.device)
    if out.numel() == 0 or L.B * L.query_blocks("fwd") == 0:
        return out.zero_(), lse.fill_(float("-inf")), L
    if L.Tk == 0:
        return (*_no_keys(out, lse, L.sinks), L)
    L.run("fwd", L.K.attention_fwd, L.fwd_args, L.fwd_tensors, q, k, v, out, lse)
    return out, lse, L


attention_fwd = torch.library.custom_op("fusedattn::attention_fwd", attention_fwd_impl,
                                       mutates_args=())  # fmt: skip


@attention_fwd.register_fake
def _(q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
      max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right, scale, softcap,
      dropout_p, seed, backend):  # fmt: skip
    if cu_seqlens_q is not None:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        return out, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    B, H, Tq, _ = q.shape
    return _empty_out(q, v.shape[-1]), q.new_empty(B, H, Tq, dtype=torch.float32)


def attention_bwd_impl(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor],
    alibi_slopes: Optional[torch.Tensor],
    sinks: Optional[torch.Tensor],
    cu_seqlens_q: Optional[torch.Tensor],
    cu_seqlens_k: Optional[torch.Tensor],
    max_seqlen_q: int,
    max_seqlen_k: int,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: Optional[torch.Tensor],
    mask_grad: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv, dS, dsinks): dS is the dense fp32 (B, Hq, Tq, Tk) gradient of the
    scores (the float mask's gradient before its broadcast is summed), empty unless
    mask_grad; dsinks fp32 (Hq,), empty without sinks."""
    *grads, dmask, dsinks = _attention_backward(
        do, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right,
        scale, softcap, dropout_p, seed, mask_grad, backend,
    )  # fmt: skip
    empty = q.new_empty(0, dtype=torch.float32)  # a custom op returns tensors, never None
    return (*grads, empty if dmask is None else dmask, empty.clone() if dsinks is None else dsinks)


def _attention_backward(do, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, sinks,
                        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left,
                        window_right, bottom_right, scale, softcap, dropout_p, seed, mask_grad,
                        backend, launch=None, delta_from_out=False, grads_dtype=None):  # fmt: skip
    """attention_bwd_impl, reusing the forward's Triton launch when it is given (eager); dS
    and dsinks are None when not asked for. delta_from_out: delta = rowsum(dO * O) from the
    `out` given, never the exact pass over these keys (context parallelism: out and lse are a
    whole row's, these keys one block of it). grads_dtype: dq, dk, dv in this dtype (fp32:
    context parallelism sums the blocks' gradients unrounded)."""
    q, k, v, out, do = _kernel_layout(backend, q, k, v, out, do)
    if grads_dtype is None:
        dq, dk, dv = new_output_like(q), new_output_like(k), new_output_like(v)
    else:
        dq, dk, dv = (torch.empty_like(t, dtype=grads_dtype) for t in (q, k, v))
    varlen = cu_seqlens_q is not None
    B, H, Tq = (0, 0, 0) if varlen else q.shape[:3]
    Tk = 0 if varlen else k.shape[2]
    # zeros: the tiles the dq kernel skips (outside the window) must read 0
    dmask = torch.zeros((B, H, Tq, Tk), dtype=torch.float32, device=q.device) if mask_grad else None
    dsinks = (
        None if sinks is None else torch.zeros(sinks.shape, dtype=torch.float32, device=q.device)
    )
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dmask, dsinks
    if backend == "cuda":
        backward_kernel = cuda_backward_kernel()
        delta = new_output((B, H, Tq), torch.float32, q.device)
        is_causal = window_right == 0 and window_left < 0 and not bottom_right
        extension().attention_bwd(
            do, q, k, v, out, lse, dq, dk, dv, delta, dmask if mask_grad else None,
            *_cuda_masks(q, k, attn_mask, key_padding_mask), is_causal, scale, dropout_p, seed,
            backward_kernel,
        )  # fmt: skip
        return dq, dk, dv, dmask, dsinks
    L = launch or TritonAttentionLaunch(
        q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right, scale, softcap,
        dropout_p, seed,
    )  # fmt: skip
    delta = new_output(L.lse_shape, torch.float32, q.device)  # written by the dq kernel
    exact_delta = False if delta_from_out else None
    # the output gradient is the one tensor a plan's key did not see: its layout names the
    # bound launchers (a planned template's), so another layout gets its own
    do_layout = (do.stride(), do.data_ptr() % 16 == 0)
    L.run(("dq", mask_grad, exact_delta, do_layout), L.K.attention_bwd_dq, L.dq_args,
          L.dq_tensors, q, k, v, out, do, lse, delta, dq, dmask, mask_grad, exact_delta)  # fmt: skip
    L.run(("dkdv", do_layout), L.K.attention_bwd_dkdv, L.dkdv_args, L.dkdv_tensors, q, k, v, do,
          lse, delta, dk, dv)  # fmt: skip
    if sinks is not None:  # d sink_h = -sum over rows of P(sink) * rowsum(dO * O)
        sink = sinks.float().view(-1, 1) if varlen else sinks.float().view(1, -1, 1)
        p_sink = torch.exp(sink - lse)
        dsinks = -(p_sink * delta).sum(dim=-1 if varlen else (0, 2))
    return dq, dk, dv, dmask, dsinks


attention_bwd = torch.library.custom_op("fusedattn::attention_bwd", attention_bwd_impl,
                                       mutates_args=())  # fmt: skip


@attention_bwd.register_fake
def _(do, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
      cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right, scale,
      softcap, dropout_p, seed, mask_grad, backend):  # fmt: skip
    shape = (0,)
    if mask_grad:
        shape = (*q.shape[:3], k.shape[2])
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        q.new_empty(shape, dtype=torch.float32),
        q.new_empty((0,) if sinks is None else sinks.shape, dtype=torch.float32),
    )


def _save(ctx, q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_q, cu_k, scalars,
          seed, backend, out, lse):  # fmt: skip
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, sinks,
                          cu_q, cu_k, seed)  # fmt: skip
    ctx.scalars, ctx.backend = tuple(scalars), backend
    ctx.sinks_dtype = None if sinks is None else sinks.dtype
    ctx.mark_non_differentiable(lse)


def _grads(ctx, dout, attention_bwd_fn, n_inputs):
    """The input gradients of the forward saved by _save: q, k, v, the float mask, the sinks,
    None for the other n_inputs."""
    q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, seed = ctx.saved_tensors
    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
    dq, dk, dv, dscores, dsinks = attention_bwd_fn(
        dout, q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, *ctx.scalars,
        seed, mask_grad, ctx.backend,
    )  # fmt: skip
    dmask = dscores.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if mask_grad else None
    dsinks = dsinks.to(ctx.sinks_dtype) if ctx.needs_input_grad[6] else None
    return (dq, dk, dv, dmask, None, None, dsinks) + (None,) * (n_inputs - 7)


def _setup(ctx, inputs, output):
    q, k, v, attn_mask, kpm, alibi_slopes, sinks, cu_q, cu_k, *scalars, seed, backend = inputs
    _save(ctx, q, k, v, attn_mask, kpm, alibi_slopes, sinks, cu_q, cu_k, scalars, seed, backend,
          *output)  # fmt: skip


def _backward(ctx, dout, _dlse):
    return _grads(ctx, dout, torch.ops.fusedattn.attention_bwd, 19)


attention_fwd.register_autograd(_backward, setup_context=_setup)


class EagerAttention(torch.autograd.Function):
    """The same forward and backward for eager calls, without torch.library's autograd layer
    (which fills defaults and re-dispatches every argument: most of the host time of a
    fwd+bwd, benchmarks/bench_host.py), with the scalars in one argument and the forward's
    launch arguments reused by the backward. torch.compile traces the custom ops instead
    (_forward picks)."""

    @staticmethod
    def forward(ctx, q, k, v, attn_mask, kpm, alibi_slopes, sinks, cu_q, cu_k, rest, template):
        *scalars, seed, backend = rest
        out, lse, ctx.launch = _attention_forward(
            q, k, v, attn_mask, kpm, alibi_slopes, sinks, cu_q, cu_k, *rest, template=template
        )
        _save(ctx, q, k, v, attn_mask, kpm, alibi_slopes, sinks, cu_q, cu_k, scalars, seed,
              backend, out, lse)  # fmt: skip
        return out, lse

    @staticmethod
    @once_differentiable  # as the custom op: no double backward (not a silent zero)
    def backward(ctx, dout, _dlse):
        bwd = functools.partial(_attention_backward, launch=ctx.launch)
        return _grads(ctx, dout, bwd, 11)


def _forward(q, k, v, attn_mask, key_padding_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
             max_seqlen_k, dropout_p, scale, window, softcap, alibi_slopes, sinks, return_lse,
             backend, template=None, autograd=None):  # fmt: skip
    """The kernel backends' forward (and backward through autograd); template: a plan's
    TritonAttentionLaunch for this call's metadata (eager calls only), autograd: whether a
    gradient is wanted, where the caller knows (a plan: grad mode and requires_grad are in
    its key)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    seed = None
    if dropout_p > 0.0:  # from torch's generator on q's device: reproducible under manual_seed
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
    rest = (max_seqlen_q, max_seqlen_k, window.left, window.right, window.bottom_right, scale,
            softcap, dropout_p, seed, backend)  # fmt: skip
    tensors = (q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
               cu_seqlens_k)  # fmt: skip
    if autograd is None and tracing():  # torch.compile or jit.trace: record the custom op
        out, lse = torch.ops.fusedattn.attention_fwd(*tensors, *rest)
    elif autograd if autograd is not None else (
        torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    ):  # fmt: skip
        out, lse = EagerAttention.apply(*tensors, rest, template)
    else:  # inference: no autograd node to build
        out, lse, _launch = _attention_forward(*tensors, *rest, template=template)
    return (out, lse) if return_lse else out


def run(
    q, k, v, attn_mask, dropout_p, scale, enable_gqa, key_padding_mask, window, softcap,
    alibi_slopes, sinks, return_lse, *, backend, template=None,
):  # fmt: skip
    """The `triton` and `cuda` backends of fusedattn.attention."""
    return _forward(q, k, v, attn_mask, key_padding_mask, None, None, 0, 0, dropout_p, scale,
                    window, softcap, alibi_slopes, sinks, return_lse, backend, template)  # fmt: skip


def attention_template(q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, window, scale,
                       softcap, dropout_p) -> TritonAttentionLaunch:  # fmt: skip
    """A plan's TritonAttentionLaunch for a dense call of this metadata (the tensors given are
    one call's, after the float-mask shift)."""
    q, k, v = _kernel_layout("triton", q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return TritonAttentionLaunch(
        q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, None, None, 0, 0, window.left,
        window.right, window.bottom_right, scale, softcap, dropout_p, None, planned=True,
    )  # fmt: skip


def run_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale, window,
    softcap, alibi_slopes, sinks, return_lse, *, backend,
):  # fmt: skip
    """The `triton` backend of fusedattn.varlen_attention."""
    return _forward(q, k, v, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, dropout_p, scale, window, softcap, alibi_slopes, sinks,
                    return_lse, backend)  # fmt: skip


run_triton = functools.partial(run, backend="triton")
run_cuda = functools.partial(run, backend="cuda")
run_triton_varlen = functools.partial(run_varlen, backend="triton")
