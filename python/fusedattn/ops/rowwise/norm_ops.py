"""LayerNorm and RMSNorm of the kernel backends as torch.library custom ops with fake
implementations and autograd (torch.compile(fullgraph=True) sees one opaque op per step), and
the same steps as plain autograd.Functions for eager calls (`layer_norm` / `rms_norm` pick).

Both norms run the same kernels in each backend: RMSNorm is LayerNorm without the centring
and the bias (`rms=True`: mean 0, and the backward loses its mean term). One op per step
serves both backends (`backend` is "triton" or "cuda").
"""

import math

import torch
from torch.autograd.function import once_differentiable

from ..core import triton_launch
from ..core.kernels import dense_params, extension, fp32_params, kernels, program_budget
from ..core.outputs import new_output
from ..core.plans import tracing
from . import torch_backend


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as (M, n) rows with a unit column stride: a view when the layout allows."""
    rows = x.reshape(-1, n)
    return rows if rows.stride(-1) == 1 or rows.shape[0] == 0 else rows.contiguous()


def _forward(x, n, weight, bias, eps, rms, backend):
    """-> (y shaped like x, mean (M,) fp32 (0 for RMSNorm), rstd (M,) fp32)."""
    rows = _rows(x, n)
    if backend == "cuda":
        y, mean, rstd = extension().layer_norm_fwd(
            rows, fp32_params(weight), fp32_params(bias), eps, rms
        )
        return y.view(x.shape), mean, rstd
    K = kernels("layernorm")
    weight, bias = dense_params(weight), dense_params(bias)
    M = rows.shape[0]
    y = new_output((M, n), x.dtype, x.device)
    mean = new_output((M,), torch.float32, x.device)
    rstd = new_output((M,), torch.float32, x.device)
    if M:
        cfg = K.layer_norm_config(n, max_one_pass_n=K.MAX_ONE_PASS_N)
        kernel = K.layer_norm_fwd_one_pass if cfg.one_pass else K.layer_norm_fwd_looped
        triton_launch.launch(
            kernel,
            (M,),
            (rows, y, weight, bias, mean, rstd, rows.stride(0), y.stride(0), n, eps),
            dict(
                HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, RMS=rms,
                BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            ),
        )  # fmt: skip
    return y.view(x.shape), mean, rstd


def _backward(dy, x, weight, mean, rstd, n, param_grads, rms, backend):
    """-> (dx, dweight_sum, dbias_sum): fp32 (n,) parameter gradients (empty without
    param_grads), reduced from per-program partials in a fixed order (deterministic). For
    RMSNorm `mean` is a placeholder the kernels never read."""
    rows, drows = _rows(x, n), _rows(dy, n)
    M = rows.shape[0]
    if backend == "cuda":
        groups = 4 * program_budget(x.device)
        dx, dw, db = extension().layer_norm_bwd(
            drows, rows, fp32_params(weight), mean, rstd, param_grads, groups, rms
        )
        return dx.view(x.shape), dw, db
    K = kernels("layernorm")
    weight = dense_params(weight)
    dx = new_output((M, n), x.dtype, x.device)
    programs = K.backward_programs(M, program_budget(x.device))
    per_program = -(-M // programs) if M else 1
    # dweight and dbias partials in one buffer: one allocation and one reduction launch for both
    shape = (2, programs, n) if param_grads else (2, 0)
    alloc = torch.empty if M else torch.zeros  # no rows: the parameter gradients are 0
    partials = alloc(shape, dtype=torch.float32, device=x.device)
    dw_partial, db_partial = partials[0], partials[1]
    if M:
        limit = min(K.MAX_ONE_PASS_N, K.MAX_ONE_PASS_BWD_N)  # longer rows would spill
        cfg = K.layer_norm_config(n, max_one_pass_n=limit)
        if cfg.one_pass:
            triton_launch.launch(
                K.layer_norm_bwd_one_pass,
                (programs,),
                (
                    rows, drows, dx, weight, mean, rstd, dw_partial, db_partial, rows.stride(0),
                    drows.stride(0), dx.stride(0), M, n, per_program,
                ),
                dict(
                    HAS_WEIGHT=weight is not None, PARAM_GRADS=param_grads, RMS=rms,
                    BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                ),
            )  # fmt: skip
        else:
            triton_launch.launch(
                K.layer_norm_bwd_dx_looped,
                (M,),
                (
                    rows, drows, dx, weight, mean, rstd, rows.stride(0), drows.stride(0),
                    dx.stride(0), n,
                ),
                dict(
                    HAS_WEIGHT=weight is not None, RMS=rms, BLOCK_N=cfg.block_n,
                    num_warps=cfg.num_warps,
                ),
            )  # fmt: skip
            if param_grads:
                triton_launch.launch(
                    K.layer_norm_bwd_params_looped,
                    (programs, -(-n // cfg.block_n)),
                    (
                        rows, drows, mean, rstd, dw_partial, db_partial, rows.stride(0),
                        drows.stride(0), M, n, per_program,
                    ),
                    dict(RMS=rms, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps),
                )  # fmt: skip
    if param_grads:
        sums = partials.sum(1)
        return dx.view(x.shape), sums[0], sums[1]
    return dx.view(x.shape), dw_partial, db_partial


def _fake_forward(x, n):
    stats = x.new_empty(x.numel() // n, dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats


def _fake_grads(x, n, param_grads):
    return x.new_empty(n if param_grads else 0, dtype=torch.float32)


# ---- LayerNorm ------------------------------------------------------------------------------


@torch.library.custom_op("fusedattn::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: torch.Tensor,
    n: int,
    weight: torch.Tensor | None,
    bias: torch.Tensor | None,
    eps: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (y shaped like x, mean (M,) fp32, rstd (M,) fp32) over the trailing n elements."""
    return _forward(x, n, weight, bias, eps, False, backend)


@layer_norm_fwd.register_fake
def _(x, n, weight, bias, eps, backend):
    y, stats = _fake_forward(x, n)
    return y, stats, stats.clone()


@torch.library.custom_op("fusedattn::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    n: int,
    param_grads: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dx, dweight_sum, dbias_sum), the parameter sums fp32 (n,) or empty."""
    dx, dw, db = _backward(dy, x, weight, mean, rstd, n, param_grads, False, backend)
    return dx, dw, db.clone()  # dw and db are views of one buffer; op outputs may not alias


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, n, param_grads, backend):
    grads = _fake_grads(x, n, param_grads)
    return torch.empty_like(x, memory_format=torch.contiguous_format), grads, grads.clone()


def _save_layer_norm(ctx, x, weight, bias, mean, rstd, n, backend):
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.n, ctx.backend = n, backend
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.param_shape = next((p.shape for p in (weight, bias) if p is not None), None)


def _layer_norm_setup(ctx, inputs, output):
    x, n, weight, bias, _eps, backend = inputs
    _, mean, rstd = output
    _save_layer_norm(ctx, x, weight, bias, mean, rstd, n, backend)
    ctx.mark_non_differentiable(mean, rstd)


def _layer_norm_grads(ctx, dy, need_w, need_b, layer_norm_bwd_fn):
    """(dx, dweight, dbias) of the forward _layer_norm_setup saved; None where not needed."""
    x, weight, mean, rstd = ctx.saved_tensors
    need_w = weight is not None and need_w
    need_b = ctx.bias_dtype is not None and need_b
    dx, dw, db = layer_norm_bwd_fn(dy, x, weight, mean, rstd, ctx.n, need_w or need_b, ctx.backend)
    shape = ctx.param_shape
    return (
        dx,
        dw.view(shape).to(weight.dtype) if need_w else None,
        db.view(shape).to(ctx.bias_dtype) if need_b else None,
    )


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    need = ctx.needs_input_grad
    dx, dw, db = _layer_norm_grads(ctx, dy, need[2], need[3], torch.ops.fusedattn.layer_norm_bwd)
    return dx, None, dw, db, None, None


layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


def _layer_norm_bwd_eager(dy, x, weight, mean, rstd, n, param_grads, backend):
    return _backward(dy, x, weight, mean, rstd, n, param_grads, False, backend)


class EagerLayerNorm(torch.autograd.Function):
    """layer_norm_fwd / layer_norm_bwd for eager calls without torch.library's autograd layer
    (it fills defaults and re-dispatches every argument: host time, benchmarks/bench_host.py),
    as attention/custom_ops.EagerAttention. Once differentiable, as the custom op."""

    @staticmethod
    def forward(ctx, x, weight, bias, n, eps, backend):
        y, mean, rstd = _forward(x, n, weight, bias, eps, False, backend)
        _save_layer_norm(ctx, x, weight, bias, mean, rstd, n, backend)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        need = ctx.needs_input_grad
        dx, dw, db = _layer_norm_grads(ctx, dy, need[1], need[2], _layer_norm_bwd_eager)
        return dx, dw, db, None, None, None


def wants_autograd(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


_wants_autograd = wants_autograd


class TritonNormForward:
    """The Triton LayerNorm / RMSNorm forward of one call's metadata, no gradient wanted: the
    config, constexprs and scalar arguments worked out once, the launcher bound at the first
    call (a plan's, rowwise/plans.RowwisePlan). Takes the same tensors as _forward."""

    def __init__(self, x, n, weight, bias, eps, rms):
        K = kernels("layernorm")
        cfg = K.layer_norm_config(n, max_one_pass_n=K.MAX_ONE_PASS_N)
        self.kernel = K.layer_norm_fwd_one_pass if cfg.one_pass else K.layer_norm_fwd_looped
        self.n, self.eps, self.rms = n, eps, rms
        # the statistics are the backward's: an inference call neither allocates nor writes them
        self.constexprs = dict(
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, RMS=rms,
            BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, STORE_STATS=False,
        )  # fmt: skip
        # the parameters' layout is the key's: a copy only where the first call needed one
        self.dense_weight = weight is not None and not weight.is_contiguous()
        self.dense_bias = bias is not None and not bias.is_contiguous()
        self._launch = None

    def __call__(self, x, weight, bias=None):
        n = self.n
        rows = _rows(x, n)
        if self.dense_weight:
            weight = weight.contiguous()
        if self.dense_bias:
            bias = bias.contiguous()
        M = rows.shape[0]
        y = new_output((M, n), x.dtype, x.device)
        if M:
            tensors = (rows, y, weight, bias, None, None)
            if self._launch is None:
                self._launch = triton_launch.prepare(
                    self.kernel, (M,),
                    (*tensors, rows.stride(0), y.stride(0), n, self.eps), self.constexprs,
                )  # fmt: skip
            else:
                self._launch(*tensors)
        return y.view(x.shape)


def layer_norm(x, n, weight, bias, eps, backend):
    """LayerNorm over the trailing n elements: the custom op when torch.compile or jit.trace
    records, else the eager autograd.Function, or no autograd node at all when no gradient is
    wanted."""
    if tracing():
        return layer_norm_fwd(x, n, weight, bias, eps, backend)[0]
    if _wants_autograd(x, weight, bias):
        return EagerLayerNorm.apply(x, weight, bias, n, eps, backend)
    return _forward(x, n, weight, bias, eps, False, backend)[0]


# ---- RMSNorm --------------------------------------------------------------------------------


@torch.library.custom_op("fusedattn::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: torch.Tensor, n: int, weight: torch.Tensor | None, eps: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (y shaped like x, rstd (M,) fp32) over the trailing n elements."""
    y, _mean, rstd = _forward(x, n, weight, None, eps, True, backend)
    return y, rstd


@rms_norm_fwd.register_fake
def _(x, n, weight, eps, backend):
    return _fake_forward(x, n)


@torch.library.custom_op("fusedattn::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    n: int,
    param_grads: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dx, dweight_sum): the weight's sum fp32 (n,), or empty without param_grads."""
    dx, dw, _db = _backward(dy, x, weight, rstd, rstd, n, param_grads, True, backend)
    return dx, dw


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd, n, param_grads, backend):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    return dx, _fake_grads(x, n, param_grads)


def _save_rms_norm(ctx, x, weight, rstd, n, backend):
    ctx.save_for_backward(x, weight, rstd)
    ctx.n, ctx.backend = n, backend


def _rms_norm_setup(ctx, inputs, output):
    x, n, weight, _eps, backend = inputs
    _, rstd = output
    _save_rms_norm(ctx, x, weight, rstd, n, backend)
    ctx.mark_non_differentiable(rstd)


def _rms_norm_grads(ctx, dy, need_w, rms_norm_bwd_fn):
    """(dx, dweight) of the forward _rms_norm_setup saved; dweight None where not needed."""
    x, weight, rstd = ctx.saved_tensors
    need_w = weight is not None and need_w
    dx, dw = rms_norm_bwd_fn(dy, x, weight, rstd, ctx.n, need_w, ctx.backend)
    return dx, dw.view(weight.shape).to(weight.dtype) if need_w else None


def _rms_norm_backward(ctx, dy, _drstd):
    need_w = ctx.needs_input_grad[2]
    dx, dw = _rms_norm_grads(ctx, dy, need_w, torch.ops.fusedattn.rms_norm_bwd)
    return dx, None, dw, None, None


rms_norm_fwd.register_autograd(_rms_norm_backward, setup_context=_rms_norm_setup)


def _rms_norm_bwd_eager(dy, x, weight, rstd, n, param_grads, backend):
    dx, dw, _db = _backward(dy, x, weight, rstd, rstd, n, param_grads, True, backend)
    return dx, dw


class EagerRMSNorm(torch.autograd.Function):
    """rms_norm_fwd / rms_norm_bwd for eager calls (see EagerLayerNorm)."""

    @staticmethod
    def forward(ctx, x, weight, n, eps, backend):
        y, _mean, rstd = _forward(x, n, weight, None, eps, True, backend)
        _save_rms_norm(ctx, x, weight, rstd, n, backend)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, dy):
        dx, dw = _rms_norm_grads(ctx, dy, ctx.needs_input_grad[1], _rms_norm_bwd_eager)
        return dx, dw, None, None, None


def rms_norm(x, n, weight, eps, backend):
    """RMSNorm over the trailing n elements, as layer_norm picks its path."""
    if tracing():
        return rms_norm_fwd(x, n, weight, eps, backend)[0]
    if _wants_autograd(x, weight):
        return EagerRMSNorm.apply(x, weight, n, eps, backend)
    return _forward(x, n, weight, None, eps, True, backend)[0]


# ---- the kernel backends' runs --------------------------------------------------------------


def run_layer_norm(x, normalized_shape, weight, bias, eps, backend):
    """fusedattn.layer_norm on a kernel backend ("triton" or "cuda")."""
    n = math.prod(normalized_shape)
    if n == 0:  # a zero-sized normalized dim: the output is empty; torch's op keeps autograd
        return torch_backend.layer_norm(x, normalized_shape, weight, bias, eps)
    return layer_norm(x, n, weight, bias, eps, backend)


def run_rms_norm(x, normalized_shape, weight, eps, backend):
    """fusedattn.rms_norm on a kernel backend, as run_layer_norm."""
    n = math.prod(normalized_shape)
    if n == 0:
        return torch_backend.rms_norm(x, normalized_shape, weight, eps)
    return rms_norm(x, n, weight, eps, backend)
