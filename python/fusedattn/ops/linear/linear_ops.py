"""fusedattn.linear's Triton launches as torch.library custom ops with fake implementations
and autograd (torch.compile(fullgraph=True) records one op per step).

Every step is triton_kernels/matmul.py's kernel with other operands and strides:
    forward  y  = x @ W^T (+ bias)    A = x (M, K),    B = W^T (strides (1, K))
    dx          = dy @ W              A = dy (M, N),   B = W (N, K)
    dW          = dy^T @ x            A = dy^T (N, M), B = x (M, K): a sum over the batch, so
                                      deterministic but by nature not batch invariant
    dbias       = dy summed over rows (torch's sum)
so a row of y, and of dx, is the same bits whatever the other rows.
"""

from __future__ import annotations

import torch

from ..core import triton_launch
from ..core.kernels import dense_params, dot_flags, kernels
from ..core.plans import tracing


def _launch_parts(a, b, bias, c):
    """(kernel, grid, args, constexprs) of a (M, K) @ b (K, N) (+ bias) into c (M, N)."""
    (M, K), N = a.shape, b.shape[1]
    mm = kernels("matmul")
    cfg = mm.matmul_config(a.element_size())
    tiles = -(-M // cfg.block_m) * -(-N // cfg.block_n)
    flags = dot_flags(a)
    args = (
        a, b, a if bias is None else bias, c, M, N, K, a.stride(0), a.stride(1), b.stride(0),
        b.stride(1), c.stride(0), c.stride(1),
    )  # fmt: skip
    constexprs = dict(
        HAS_BIAS=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, PRECISION=flags["PRECISION"],
        DOT_IN_FP32=flags["DOT_IN_FP32"], num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    return mm.matmul_kernel, (tiles,), args, constexprs


def _matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out_dtype) -> torch.Tensor:
    """a (M, K) @ b (K, N) (+ bias (N,)) through their strides, written as (M, N) out_dtype."""
    c = torch.empty((a.shape[0], b.shape[1]), dtype=out_dtype, device=a.device)
    if c.numel():
        triton_launch.launch(*_launch_parts(a, b, bias, c))
    return c


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as (M, K) rows (reshape(-1, K) is ambiguous when K is 0)."""
    return x.reshape(x.shape[:-1].numel(), x.shape[-1])


def forward(x, weight, bias):
    """y = x @ weight^T (+ bias), shaped (..., out_features)."""
    y = _matmul(_rows(x), weight.t(), dense_params(bias), x.dtype)
    return y.view(*x.shape[:-1], weight.shape[0])


@torch.library.custom_op("fusedattn::linear_fwd", mutates_args=())
def linear_fwd(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return forward(x, weight, bias)


@linear_fwd.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("fusedattn::linear_bwd", mutates_args=())
def linear_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, has_bias: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dx like x, dweight like weight, dbias (out_features,), empty without a bias)."""
    rows, drows = _rows(x), _rows(dy)
    dx = _matmul(drows, weight, None, x.dtype).view(x.shape)
    dweight = _matmul(drows.t(), rows, None, weight.dtype)
    dbias = drows.sum(0) if has_bias else dy.new_empty(0)
    return dx, dweight, dbias


@linear_bwd.register_fake
def _(dy, x, weight, has_bias):
    dbias = dy.new_empty(weight.shape[0] if has_bias else 0)
    return torch.empty_like(x), torch.empty_like(weight), dbias


def _setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.save_for_backward(x, weight)
    ctx.has_bias = bias is not None


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dweight, dbias = linear_bwd(dy.contiguous(), x, weight, ctx.has_bias)
    return dx, dweight, dbias if ctx.has_bias else None


linear_fwd.register_autograd(_backward, setup_context=_setup_context)


class TritonLinearForward:
    """The forward of one call's metadata, no gradient wanted (a plan's, api.py): the launch
    arguments worked out and the compiled kernel bound at the first call; later calls hand
    their tensors straight to its launcher (bench_host.py's linear row)."""

    def __init__(self):
        self._launch = None

    def __call__(self, x, weight, bias):
        rows, b, bias = _rows(x), weight.t(), dense_params(bias)
        y = torch.empty((rows.shape[0], weight.shape[0]), dtype=x.dtype, device=x.device)
        if y.numel():
            operands = (rows, b, rows if bias is None else bias, y)
            if self._launch is None:
                self._launch = triton_launch.prepare(*_launch_parts(rows, b, bias, y))
            else:
                self._launch(*operands)
        return y.view(*x.shape[:-1], weight.shape[0])


def wants_autograd(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def linear(x, weight, bias):
    """The custom op where autograd or a trace needs it; the launch itself otherwise (an
    eager inference call skips the custom op's dispatch on the host path)."""
    if wants_autograd(x, weight, bias) or tracing():
        return linear_fwd(x, weight, bias)
    return forward(x, weight, bias)
