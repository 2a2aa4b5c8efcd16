"""The softmax of the kernel backends as torch.library custom ops with fake implementations and
autograd, so torch.compile(fullgraph=True) sees one opaque op per launch (eager calls take the
same steps as a plain autograd.Function: `softmax` picks). One op per step serves both
backends (`backend` is "triton" or "cuda"), so the autograd and layout glue exist once.
(Signatures say Optional[...]: torch.library infers the op schema from them, and
typing.Optional is the spelling every supported torch version reads.)
"""

import torch
from torch.autograd.function import once_differentiable

from ..core import triton_launch
from ..core.kernels import extension, kernels
from ..core.outputs import new_output
from ..core.plans import tracing


def as_4d(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t with `dim` moved last, seen as (A, B, C, N): leading 1s added, or the first dims
    merged (a copy only where they cannot merge) when t has more than 4 dims."""
    t = t.movedim(dim, -1)
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t.flatten(0, t.dim() - 4) if t.dim() > 4 else t


def empty_softmax_like(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The output: x's shape, contiguous, as torch.softmax returns it along any dim (it was
    a dim-last buffer seen in x's order, a non-contiguous view along another dim)."""
    return new_output(x.shape, x.dtype, x.device)


def _output_4d(y: torch.Tensor, dim: int, backend: str) -> tuple[torch.Tensor, bool]:
    """(y4, direct): what the kernel writes, y seen as (A, B, C, N) through its strides
    (direct), or where that view would be a copy (more than 4 dims that do not merge) or the
    backend is CUDA along another dim (its kernels write rows of unit stride) a dim-last
    buffer that _finish copies into y."""
    if dim == y.dim() - 1 or backend != "cuda":
        y4 = as_4d(y, dim)
        if _is_view_of(y4, y):
            return y4, True
    return as_4d(new_output(y.movedim(dim, -1).shape, y.dtype, y.device), -1), False


def _finish(y: torch.Tensor, y4: torch.Tensor, direct: bool, dim: int) -> torch.Tensor:
    if not direct:
        y.copy_(y4.reshape(y.movedim(dim, -1).shape).movedim(-1, dim))
    return y


def _strides(t4: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t4.stride())


def _is_view_of(view: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether as_4d(t) gave a view of t's own elements (not a copy) at t's offset."""
    return view.data_ptr() == t.data_ptr() and (
        view.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    )


@torch.library.custom_op("fusedattn::softmax_fwd", mutates_args=())
def softmax_fwd(
    x: torch.Tensor,
    dim: int,
    mask: torch.Tensor | None,
    scale: float,
    is_causal: bool,
    backend: str,
) -> torch.Tensor:
    return _softmax_forward(x, dim, mask, scale, is_causal, backend)


def _softmax_forward(x, dim, mask, scale, is_causal, backend):
    y = empty_softmax_like(x, dim)
    x4, (y4, direct) = as_4d(x, dim), _output_4d(y, dim, backend)
    A, B, C, N = x4.shape
    if backend == "cuda":  # reads bool masks as bytes, additive ones as fp32
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.float()  # before the broadcast: never a full-size copy
        m4 = as_4d(mask.expand(x.shape), dim) if mask is not None else None
        is_bool = m4 is not None and m4.dtype == torch.bool
        extension().softmax_fwd(
            x4, y4, m4 if is_bool else None, None if is_bool else m4, scale, is_causal
        )
        return _finish(y, y4, direct, dim)
    m4 = as_4d(mask.expand(x.shape), dim) if mask is not None else None
    K = kernels("softmax")
    if x.numel():
        cfg = K.softmax_config(N, max_one_pass_n=K.MAX_ONE_PASS_N)
        kernel = K.softmax_fwd_one_pass if cfg.one_pass else K.softmax_fwd_looped
        triton_launch.launch(
            kernel,
            (A * B * C,),
            (
                x4, y4, m4, *_strides(x4), *_strides(y4),
                *(_strides(m4) if m4 is not None else (0,) * 4), B, C, N, scale,
            ),
            dict(
                HAS_MASK=mask is not None,
                MASK_IS_BOOL=mask is not None and mask.dtype == torch.bool, IS_CAUSAL=is_causal,
                BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            ),
        )  # fmt: skip
    return _finish(y, y4, direct, dim)


@softmax_fwd.register_fake
def _(x, dim, mask, scale, is_causal, backend):
    return empty_softmax_like(x, dim)


@torch.library.custom_op("fusedattn::softmax_bwd", mutates_args=())
def softmax_bwd(
    y: torch.Tensor, dy: torch.Tensor, dim: int, scale: float, backend: str
) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)) along dim; dy is read, never written."""
    return _softmax_backward_kernel(y, dy, dim, scale, backend)


def _softmax_backward_kernel(y, dy, dim, scale, backend):
    dx = empty_softmax_like(y, dim)
    y4, dy4, (dx4, direct) = as_4d(y, dim), as_4d(dy, dim), _output_4d(dx, dim, backend)
    A, B, C, N = y4.shape
    if backend == "cuda":
        extension().softmax_bwd(y4, dy4, dx4, scale)
        return _finish(dx, dx4, direct, dim)
    K = kernels("softmax")
    if y.numel():
        cfg = K.softmax_config(N, max_one_pass_n=K.MAX_ONE_PASS_N)
        kernel = K.softmax_bwd_one_pass if cfg.one_pass else K.softmax_bwd_looped
        triton_launch.launch(
            kernel,
            (A * B * C,),
            (y4, dy4, dx4, *_strides(y4), *_strides(dy4), *_strides(dx4), B, C, N, scale),
            dict(BLOCK_N=cfg.block_n, num_warps=cfg.num_warps),
        )  # fmt: skip
    return _finish(dx, dx4, direct, dim)


@softmax_bwd.register_fake
def _(y, dy, dim, scale, backend):
    return empty_softmax_like(y, dim)


def _softmax_setup(ctx, inputs, output):
    _x, dim, _mask, scale, _causal, backend = inputs
    ctx.save_for_backward(output)
    ctx.dim, ctx.scale, ctx.backend = dim, scale, backend


def _softmax_backward(ctx, dy):
    (y,) = ctx.saved_tensors
    dx = torch.ops.fusedattn.softmax_bwd(y, dy, ctx.dim, ctx.scale, ctx.backend)
    return dx, None, None, None, None, None


softmax_fwd.register_autograd(_softmax_backward, setup_context=_softmax_setup)


class TritonSoftmaxForward:
    """The Triton softmax forward of one call's metadata, no gradient wanted: the config and
    launch arguments worked out once, the launcher bound at the first call (a plan's,
    plans.RowwisePlan). Takes the same tensors as _softmax_forward."""

    def __init__(self, x, dim, mask, scale, is_causal):
        self.dim, self.scale, self.is_causal = dim, scale, is_causal
        x4 = as_4d(x, dim)
        y = empty_softmax_like(x, dim)
        y4, direct = _output_4d(y, dim, "triton")
        self.y_shape = tuple(y.shape)  # contiguous, as torch.softmax's
        # the output's 4-D view by its strides (None: a buffer copied back, _output_4d)
        self.y_stride4 = _strides(y4) if direct else None
        self.shape4 = tuple(x4.shape)
        # x and the mask as 4-D views by their strides, one call each (as_4d's chain of
        # movedim / unsqueeze / flatten only where it had to copy)
        self.x_stride4 = _strides(x4) if _is_view_of(x4, x) else None
        m4 = None if mask is None else as_4d(mask.expand(x.shape), dim)
        self.m_stride4 = _strides(m4) if m4 is not None and _is_view_of(m4, mask) else None
        N = x4.shape[-1]
        K = kernels("softmax")
        cfg = K.softmax_config(N, max_one_pass_n=K.MAX_ONE_PASS_N)
        self.kernel = K.softmax_fwd_one_pass if cfg.one_pass else K.softmax_fwd_looped
        self.grid = (x4.shape[0] * x4.shape[1] * x4.shape[2],)
        self.constexprs = dict(
            HAS_MASK=mask is not None, MASK_IS_BOOL=mask is not None and mask.dtype == torch.bool,
            IS_CAUSAL=is_causal, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )  # fmt: skip
        self._launch = None

    def __call__(self, x, mask=None):
        dim, shape4 = self.dim, self.shape4
        if self.y_stride4 is None:  # more than 4 dims that do not merge: the full path
            return _softmax_forward(x, dim, mask, self.scale, self.is_causal, "triton")
        y = new_output(self.y_shape, x.dtype, x.device)
        y4 = y.as_strided(shape4, self.y_stride4)
        x4 = as_4d(x, dim) if self.x_stride4 is None else x.as_strided(shape4, self.x_stride4)
        m4 = None
        if mask is not None:
            m4 = (
                as_4d(mask.expand(x.shape), dim) if self.m_stride4 is None
                else mask.as_strided(shape4, self.m_stride4)
            )  # fmt: skip
        if self._launch is not None:
            self._launch(x4, y4, m4)
            return y
        _, B, C, N = x4.shape
        self._launch = triton_launch.prepare(
            self.kernel, self.grid,
            (x4, y4, m4, *_strides(x4), *_strides(y4),
             *(_strides(m4) if m4 is not None else (0,) * 4), B, C, N, self.scale),
            self.constexprs,
        )  # fmt: skip
        return y


class EagerSoftmax(torch.autograd.Function):
    """softmax_fwd / softmax_bwd for eager calls without torch.library's autograd layer (host
    time: benchmarks/bench_host.py), as attention/custom_ops.EagerAttention. Once differentiable,
    as the custom op."""

    @staticmethod
    def forward(ctx, x, dim, mask, scale, is_causal, backend):
        y = _softmax_forward(x, dim, mask, scale, is_causal, backend)
        ctx.save_for_backward(y)
        ctx.dim, ctx.scale, ctx.backend = dim, scale, backend
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        (y,) = ctx.saved_tensors
        dx = _softmax_backward_kernel(y, dy, ctx.dim, ctx.scale, ctx.backend)
        return dx, None, None, None, None, None


def softmax(x, dim, mask, scale, is_causal, backend):
    """Softmax along dim: the custom op when torch.compile or jit.trace records (a trace of the
    eager path would replay no kernel), else the eager autograd.Function, or no autograd node
    at all when no gradient is wanted. (The kernel backends refuse a mask that wants a
    gradient.)"""
    if tracing():
        return softmax_fwd(x, dim, mask, scale, is_causal, backend)
    if torch.is_grad_enabled() and x.requires_grad:
        return EagerSoftmax.apply(x, dim, mask, scale, is_causal, backend)
    return _softmax_forward(x, dim, mask, scale, is_causal, backend)
