"""The flash attention of both kernel backends (Triton, CUDA C++) as torch.library custom ops
with fake implementations and autograd, so torch.compile(fullgraph=True) sees one opaque op
each way, and the same steps as a plain autograd.Function for eager calls. One op per
direction serves both backends (`backend` is "triton" or "cuda"): the output layout, the
autograd glue and the float-mask gradient exist once; what each backend is handed is
triton_args.py's and cuda_args.py's. Signatures say Optional[...]: torch.library reads
typing.Optional on every torch we support.
"""

import math
import os

import torch
from torch.autograd.function import once_differentiable

from ...checks import check_descale_values
from ...masks import Window
from ..core import backends
from ..core.kernels import extension
from ..core.outputs import new_output, new_output_like
from ..core.plans import tracing
from . import cuda_args
from .triton_args import TritonAttentionLaunch


def _unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _kernel_layout(backend: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Views the kernels read as they are; a copy only where they cannot (a non-unit last
    stride; for CUDA, strides or a base that break 16-byte alignment)."""
    if backend == "cuda":
        return [t if cuda_args.aligned(t) else t.contiguous() for t in tensors]
    return [_unit_last_stride(t) for t in tensors]


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
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: torch.Tensor | None,
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
                       out_dtype=None, template=None, descales=None, block=None,
                       mod=None):  # fmt: skip
    """attention_fwd_impl, also returning the Triton launch (None for CUDA) for the backward
    to reuse. out_dtype: the output's dtype if not q's (Triton: context parallelism keeps a
    block's output in fp32 for the merge). template: a plan's TritonAttentionLaunch for this
    call's metadata (plans.py), bound to this call's tensors instead of building
    one. descales: (q_descale, k_descale, v_descale) of an fp8 call (Triton only). block: a
    fusedattn.masks.BlockMask on q's device, mod: a fusedattn.score_mod.ScoreMod (Triton
    only; flex.py)."""
    q, k, v = _kernel_layout(backend, q, k, v)
    varlen = cu_seqlens_q is not None
    out = _empty_out_like(q, v.shape[-1], varlen, out_dtype)
    if backend == "cuda":
        lse = new_output(q.shape[:3], torch.float32, q.device)
        if out.numel() == 0 or k.shape[2] == 0:
            return out.zero_(), lse.fill_(float("-inf")), None
        is_causal = window_right == 0 and window_left < 0 and not bottom_right
        extension().attention_fwd(
            q, k, v, out, lse, *cuda_args.masks(q, k, attn_mask, key_padding_mask), is_causal,
            scale, dropout_p, seed,
        )  # fmt: skip
        return out, lse, None
    if template is not None:
        L = template.bind(attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
                          cu_seqlens_k, seed, block, mod)  # fmt: skip
    else:
        L = TritonAttentionLaunch(
            q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right,
            scale, softcap, dropout_p, seed, descales=descales, block=block, mod=mod,
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
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    scale: float,
    softcap: float,
    dropout_p: float,
    seed: torch.Tensor | None,
    mask_grad: bool,
    backend: str,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv, dS, dsinks): dS is the dense fp32 (B, Hq, Tq, Tk) gradient of the
    scores (the float mask's gradient before its broadcast is summed), empty unless
    mask_grad; dsinks fp32 (Hq,), empty without sinks. dlse: the gradient of the returned
    lse (None: the loss does not read it)."""
    *grads, dmask, dsinks = _attention_backward(
        do, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right,
        scale, softcap, dropout_p, seed, mask_grad, backend, dlse=dlse,
    )  # fmt: skip
    empty = q.new_empty(0, dtype=torch.float32)  # a custom op returns tensors, never None
    return (*grads, empty if dmask is None else dmask, empty.clone() if dsinks is None else dsinks)


def _attention_backward(do, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, sinks,
                        cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left,
                        window_right, bottom_right, scale, softcap, dropout_p, seed, mask_grad,
                        backend, launch=None, delta_from_out=False, grads_dtype=None,
                        block=None, dlse=None, mod=None, mod_grads=None):  # fmt: skip
    """attention_bwd_impl, reusing the forward's Triton launch when it is given (eager); dS
    and dsinks are None when not asked for. dlse (the returned lse's gradient, None where
    the loss does not read it) enters the row term: delta - dlse (attention_bwd_dq). delta_from_out: delta = rowsum(dO * O) from the
    `out` given, never the exact pass over these keys (context parallelism: out and lse are a
    whole row's, these keys one block of it). grads_dtype: dq, dk, dv in this dtype (fp32:
    context parallelism sums the blocks' gradients unrounded). mod_grads: with a score_mod
    (mod), the float32 buffers (zeros) its captures' gradients are added into, None for a
    capture that wants none."""
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
        # the CUDA kernels have no dlse term: the cuda backend refuses a call that returns an
        # lse and records a backward (cuda_backend.refusals), so a dlse here is a zero one
        # (the custom op's, for an lse it never returned)
        backward_kernel = cuda_args.cuda_backward_kernel()
        delta = new_output((B, H, Tq), torch.float32, q.device)
        is_causal = window_right == 0 and window_left < 0 and not bottom_right
        extension().attention_bwd(
            do, q, k, v, out, lse, dq, dk, dv, delta, dmask if mask_grad else None,
            *cuda_args.masks(q, k, attn_mask, key_padding_mask), is_causal, scale, dropout_p, seed,
            backward_kernel,
        )  # fmt: skip
        return dq, dk, dv, dmask, dsinks
    L = launch or TritonAttentionLaunch(
        q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right, scale, softcap,
        dropout_p, seed, block=block, mod=mod,
    )  # fmt: skip
    L.mod_grads = mod_grads
    delta = new_output(L.lse_shape, torch.float32, q.device)  # written by the dq kernel
    exact_delta = False if delta_from_out else None
    # the output gradient is the one tensor a plan's key did not see: its layout names the
    # bound launchers (a planned template's), so another layout gets its own
    do_layout = (do.stride(), do.data_ptr() % 16 == 0)
    if dlse is not None:  # laid out as lse (an lse.sum()'s gradient comes expanded)
        dlse = dlse.to(torch.float32).expand(L.lse_shape).contiguous()
    # a score_mod's dq kernel differs by which captures get a gradient (fixed within a plan
    # today, requires_grad being in its key; named so that a bound launcher never serves
    # another set)
    wanted = None if mod_grads is None else tuple(g is not None for g in mod_grads)
    L.run(("dq", mask_grad, exact_delta, do_layout, dlse is None, wanted), L.K.attention_bwd_dq,
          L.dq_args, L.dq_tensors, q, k, v, out, do, lse, delta, dq, dmask, mask_grad,
          exact_delta, dlse)  # fmt: skip
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
      softcap, dropout_p, seed, mask_grad, backend, dlse=None):  # fmt: skip
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


def _grads(ctx, dout, dlse, attention_bwd_fn, n_inputs):
    """The input gradients of the forward saved by _save: q, k, v, the float mask, the sinks,
    None for the other n_inputs. The lse is differentiable (issue #82): dlse, its gradient,
    is None where the loss does not read it (eager), and dout None where the loss reads the
    lse alone."""
    q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, seed = ctx.saved_tensors
    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv, dscores, dsinks = attention_bwd_fn(
        dout, q, k, v, out, lse, attn_mask, kpm, slopes, sinks, cu_q, cu_k, *ctx.scalars,
        seed, mask_grad, ctx.backend, dlse,
    )  # fmt: skip
    dmask = dscores.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if mask_grad else None
    dsinks = dsinks.to(ctx.sinks_dtype) if ctx.needs_input_grad[6] else None
    return (dq, dk, dv, dmask, None, None, dsinks) + (None,) * (n_inputs - 7)


def _setup(ctx, inputs, output):
    q, k, v, attn_mask, kpm, alibi_slopes, sinks, cu_q, cu_k, *scalars, seed, backend = inputs
    _save(ctx, q, k, v, attn_mask, kpm, alibi_slopes, sinks, cu_q, cu_k, scalars, seed, backend,
          *output)  # fmt: skip


def _backward(ctx, dout, dlse):
    # torch.library hands a zero dlse for an lse the loss does not read (an lse the call never
    # returned included): one load per row in the dq kernel
    return _grads(ctx, dout, dlse, torch.ops.fusedattn.attention_bwd, 19)


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
        ctx.set_materialize_grads(False)  # an unread lse's gradient stays None: no dlse term
        return out, lse

    @staticmethod
    @once_differentiable  # as the custom op: no double backward (not a silent zero)
    def backward(ctx, dout, dlse):
        def bwd(*args):
            *args, dlse = args
            return _attention_backward(*args, launch=ctx.launch, dlse=dlse)

        return _grads(ctx, dout, dlse, bwd, 11)


def dropout_seed(dropout_p: float, device) -> torch.Tensor | None:
    """The Philox seed of a call with dropout (None without): an int64 tensor drawn from
    torch's generator on the call's device, so runs repeat under torch.manual_seed."""
    if dropout_p > 0.0:
        return torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
    return None


def _forward(q, k, v, attn_mask, key_padding_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
             max_seqlen_k, dropout_p, scale, window, softcap, alibi_slopes, sinks, return_lse,
             backend, template=None, autograd=None):  # fmt: skip
    """The kernel backends' forward (and backward through autograd); template: a plan's
    TritonAttentionLaunch for this call's metadata (eager calls only), autograd: whether a
    gradient is wanted, where the caller knows (a plan: grad mode and requires_grad are in
    its key)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    seed = dropout_seed(dropout_p, q.device)
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
    alibi_slopes, sinks, return_lse, *, backend, template=None, q_descale=None, k_descale=None,
    v_descale=None, out_dtype=None,
):  # fmt: skip
    """The `triton` and `cuda` backends of fusedattn.attention (fp8: the Triton kernels)."""
    if out_dtype is not None:
        return forward_fp8(q, k, v, attn_mask, key_padding_mask, None, None, 0, 0, scale, window,
                           softcap, alibi_slopes, sinks, return_lse,
                           (q_descale, k_descale, v_descale), out_dtype)  # fmt: skip
    return _forward(q, k, v, attn_mask, key_padding_mask, None, None, 0, 0, dropout_p, scale,
                    window, softcap, alibi_slopes, sinks, return_lse, backend, template)  # fmt: skip


def forward_fp8(q, k, v, attn_mask, key_padding_mask, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, scale, window, softcap, alibi_slopes, sinks, return_lse, descales,
                out_dtype):  # fmt: skip
    """The fp8 forward on the Triton kernels (inference only: no autograd node; checked by
    fusedattn.checks): the custom op while torch.compile records, the launch otherwise. The
    descales' values are checked where the values of a call are (the CPU; a GPU with
    FUSEDATTN_CHECK_VALUES=1)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if tracing():
        out, lse = torch.ops.fusedattn.attention_fp8_fwd(
            q, k, v, *descales, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k, window.left, window.right,
            window.bottom_right, scale, softcap, out_dtype,
        )  # fmt: skip
    else:
        if not q.is_cuda or os.environ.get("FUSEDATTN_CHECK_VALUES") == "1":
            check_descale_values(q_descale=descales[0], k_descale=descales[1],
                                 v_descale=descales[2])  # fmt: skip
        out, lse, _ = _attention_forward(
            q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
            cu_seqlens_k, max_seqlen_q, max_seqlen_k, window.left, window.right,
            window.bottom_right, scale, softcap, 0.0, None, "triton", out_dtype=out_dtype,
            descales=descales,
        )  # fmt: skip
    return (out, lse) if return_lse else out


@torch.library.custom_op("fusedattn::attention_fp8_fwd", mutates_args=())
def attention_fp8_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_descale: torch.Tensor,
    k_descale: torch.Tensor,
    v_descale: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    scale: float,
    softcap: float,
    out_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 forward (out in out_dtype, lse fp32); no autograd (inference only)."""
    out, lse, _ = _attention_forward(
        q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
        max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right, scale, softcap,
        0.0, None, "triton", out_dtype=out_dtype, descales=(q_descale, k_descale, v_descale),
    )  # fmt: skip
    return out, lse


@attention_fp8_fwd.register_fake
def _(q, k, v, q_descale, k_descale, v_descale, attn_mask, key_padding_mask, alibi_slopes, sinks,
      cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right,
      bottom_right, scale, softcap, out_dtype):  # fmt: skip
    if cu_seqlens_q is not None:
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1], dtype=out_dtype)
        return out, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    B, H, Tq, _ = q.shape
    return _empty_out(q, v.shape[-1], out_dtype), q.new_empty(B, H, Tq, dtype=torch.float32)


def attention_template(q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, window, scale,
                       softcap, dropout_p, block=None, mod=None) -> TritonAttentionLaunch:  # fmt: skip
    """A plan's TritonAttentionLaunch for a call of this metadata (the tensors given are one
    call's, after the float-mask shift); block, mod: a block-mask or score_mod call's (each
    call binds its own)."""
    q, k, v = _kernel_layout("triton", q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    return TritonAttentionLaunch(
        q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, None, None, 0, 0, window.left,
        window.right, window.bottom_right, scale, softcap, dropout_p, None, planned=True,
        block=block, mod=mod,
    )  # fmt: skip


def run_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, scale, window,
    softcap, alibi_slopes, sinks, return_lse, *, backend, descales=None, out_dtype=None,
):  # fmt: skip
    """The `triton` backend of fusedattn.varlen_attention (fp8: out_dtype and the descales)."""
    if out_dtype is not None:
        return forward_fp8(q, k, v, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                           max_seqlen_k, scale, window, softcap, alibi_slopes, sinks, return_lse,
                           descales, out_dtype)  # fmt: skip
    return _forward(q, k, v, None, None, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                    max_seqlen_k, dropout_p, scale, window, softcap, alibi_slopes, sinks,
                    return_lse, backend)  # fmt: skip


# ---- the paged prefill (inference only): one op, whichever backend -----------------------


@torch.library.custom_op("fusedattn::paged_varlen_attention", mutates_args=())
def paged_varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    block_table: torch.Tensor,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    max_seqlen_q: int,
    max_seqlen_k: int,
    scale: float | None,
    window_left: int,
    window_right: int,
    bottom_right: bool,
    softcap: float,
    return_lse: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """varlen_attention over a paged cache (inference only): (out (total_q, Hq, Dv), lse
    (Hq, total_q) fp32 or empty) of the named backend; the reference and torch backends check
    the values inside, as in eager calls. bottom_right is the window's own (masks.make_window
    also keeps it for ALiBi without a window, so it is not derived from the bounds here)."""
    window = Window(window_left, window_right, bottom_right)
    result = backends._REGISTRY["varlen_attention"][backend].run(
        q=q, k=k_cache, v=v_cache, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
        max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, dropout_p=0.0, scale=scale,
        window=window, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
        return_lse=return_lse, block_table=block_table,
    )  # fmt: skip
    out, lse = result if return_lse else (result, q.new_empty(0, dtype=torch.float32))
    return out.contiguous(), lse


@paged_varlen_attention.register_fake
def _(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, block_table, alibi_slopes, sinks,
      max_seqlen_q, max_seqlen_k, scale, window_left, window_right, bottom_right, softcap,
      return_lse, backend):  # fmt: skip
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    lse = q.new_empty((q.shape[1], q.shape[0]) if return_lse else (0,), dtype=torch.float32)
    return out, lse


def record_paged_varlen(inputs: dict, backend: str):
    """What varlen_attention with a block table runs while torch.compile records."""
    window = inputs["window"]
    out, lse = torch.ops.fusedattn.paged_varlen_attention(
        inputs["q"], inputs["k"], inputs["v"], inputs["cu_seqlens_q"], inputs["cu_seqlens_k"],
        inputs["block_table"], inputs["alibi_slopes"], inputs["sinks"], inputs["max_seqlen_q"],
        inputs["max_seqlen_k"], inputs["scale"], window.left, window.right, window.bottom_right,
        inputs["softcap"], inputs["return_lse"], backend,
    )  # fmt: skip
    return (out, lse) if inputs["return_lse"] else out
