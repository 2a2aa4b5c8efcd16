"""The row-wise ops (LayerNorm, softmax) of the kernel backends, as torch.library custom ops
with fake implementations and autograd, so torch.compile(fullgraph=True) sees one opaque op per
launch. One op per step serves both backends (`backend` is "triton" or "cuda"), so the
autograd and layout glue exist once. (Signatures say Optional[...]: torch.library infers the
op schema from them, and typing.Optional is the spelling every supported torch version reads.)

The Triton kernel modules import triton, so they are imported on the first launch: `import
fusedattn` never imports triton.
"""

import functools
import importlib
import os
from typing import Optional

import torch

from . import backends

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


POISON_ENV = "FUSEDATTN_POISON_OUTPUTS"


def new_output(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """torch.empty, or NaN-filled when FUSEDATTN_POISON_OUTPUTS=1 (the test suite sets it): an
    element a kernel forgets to write then fails every comparison instead of passing as stale
    memory that happens to hold the right value."""
    if os.environ.get(POISON_ENV) == "1":
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def new_output_like(t: torch.Tensor) -> torch.Tensor:
    """torch.empty_like (same strides), poisoned like new_output."""
    out = torch.empty_like(t)
    return out.fill_(float("nan")) if os.environ.get(POISON_ENV) == "1" else out


def kernels(name: str):
    """fusedattn.triton_kernels.<name>, imported on first use."""
    return importlib.import_module(f"fusedattn.triton_kernels.{name}")


def extension():
    """The CUDA extension: fusedattn._C, or its first-use build (compiled now if needed)."""
    return backends.extension()


def _fp32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The CUDA kernels read parameters as contiguous fp32 (n elements: a negligible copy)."""
    return None if t is None else t.float().contiguous().view(-1)


def _dense(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The Triton kernels read parameters with a unit stride: a strided or expanded (stride 0)
    weight is copied to its n elements first (a negligible copy next to x)."""
    return None if t is None else t.contiguous()


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def program_budget(device: torch.device) -> int:
    """Streaming multiprocessors to size grids by (the interpreter on CPU: a few)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else 4


def dtype_refusals(*tensors: Optional[torch.Tensor], backend: str = "triton") -> list[str]:
    bad = sorted({str(t.dtype) for t in tensors if t is not None and t.dtype not in KERNEL_DTYPES})
    if bad:
        name = "Triton" if backend == "triton" else "CUDA"
        return [f"the {name} kernels take float16, bfloat16 and float32, got {', '.join(bad)}"]
    return []


def extension_op_refusals(op: str) -> list[str]:
    """Why fusedattn._C cannot run `op`: built before the op existed. (That it does not load at
    all is the device-level reason.)"""
    if backends.EXTENSION_ERROR or op in backends.EXTENSION_OPS:
        return []
    return [f"fusedattn._C was built without {op}: rebuild it"]


# ---- LayerNorm ------------------------------------------------------------------------------


def _rows(x: torch.Tensor, n: int) -> torch.Tensor:
    """x as (M, n) rows with a unit column stride: a view when the layout allows."""
    rows = x.reshape(-1, n)
    return rows if rows.stride(-1) == 1 or rows.shape[0] == 0 else rows.contiguous()


@torch.library.custom_op("fusedattn::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: torch.Tensor,
    n: int,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (y shaped like x, mean (M,) fp32, rstd (M,) fp32) over the trailing n elements."""
    rows = _rows(x, n)
    if backend == "cuda":
        y, mean, rstd = extension().layer_norm_fwd(rows, _fp32(weight), _fp32(bias), eps)
        return y.view(x.shape), mean, rstd
    K = kernels("layernorm")
    weight, bias = _dense(weight), _dense(bias)
    M = rows.shape[0]
    y = new_output((M, n), x.dtype, x.device)
    mean = new_output((M,), torch.float32, x.device)
    rstd = new_output((M,), torch.float32, x.device)
    if M:
        cfg = K.layer_norm_config(n, max_one_pass_n=K.MAX_ONE_PASS_N)
        kernel = K.layer_norm_fwd_one_pass if cfg.one_pass else K.layer_norm_fwd_looped
        kernel[(M,)](
            rows, y, weight, bias, mean, rstd, rows.stride(0), y.stride(0), n, eps,
            HAS_WEIGHT=weight is not None, HAS_BIAS=bias is not None, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps,
        )  # fmt: skip
    return y.view(x.shape), mean, rstd


@layer_norm_fwd.register_fake
def _(x, n, weight, bias, eps, backend):
    M = x.numel() // n
    stats = x.new_empty(M, dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, stats.clone()


@torch.library.custom_op("fusedattn::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: Optional[torch.Tensor],
    mean: torch.Tensor,
    rstd: torch.Tensor,
    n: int,
    param_grads: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dx, dweight_sum, dbias_sum): fp32 (n,) parameter gradients (empty without
    param_grads), reduced from per-program partials in a fixed order (deterministic)."""
    rows, drows = _rows(x, n), _rows(dy, n)
    M = rows.shape[0]
    if backend == "cuda":
        groups = 4 * program_budget(x.device)
        dx, dw, db = extension().layer_norm_bwd(
            drows, rows, _fp32(weight), mean, rstd, param_grads, groups
        )
        return dx.view(x.shape), dw, db
    K = kernels("layernorm")
    weight = _dense(weight)
    dx = new_output((M, n), x.dtype, x.device)
    programs = K.backward_programs(M, program_budget(x.device))
    per_program = -(-M // programs) if M else 1
    shape = (programs, n) if param_grads else (0,)
    alloc = torch.empty if M else torch.zeros  # no rows: the parameter gradients are 0
    dw_partial = alloc(shape, dtype=torch.float32, device=x.device)
    db_partial = alloc(shape, dtype=torch.float32, device=x.device)
    if M:
        cfg = K.layer_norm_config(n, max_one_pass_n=K.MAX_ONE_PASS_N)
        if cfg.one_pass:
            K.layer_norm_bwd_one_pass[(programs,)](
                rows, drows, dx, weight, mean, rstd, dw_partial, db_partial,
                rows.stride(0), drows.stride(0), dx.stride(0), M, n, per_program,
                HAS_WEIGHT=weight is not None, PARAM_GRADS=param_grads, BLOCK_N=cfg.block_n,
                num_warps=cfg.num_warps,
            )  # fmt: skip
        else:
            K.layer_norm_bwd_dx_looped[(M,)](
                rows, drows, dx, weight, mean, rstd,
                rows.stride(0), drows.stride(0), dx.stride(0), n,
                HAS_WEIGHT=weight is not None, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            )  # fmt: skip
            if param_grads:
                K.layer_norm_bwd_params_looped[(programs, -(-n // cfg.block_n))](
                    rows, drows, mean, rstd, dw_partial, db_partial,
                    rows.stride(0), drows.stride(0), M, n, per_program,
                    BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
                )  # fmt: skip
    if param_grads:
        return dx.view(x.shape), dw_partial.sum(0), db_partial.sum(0)
    return dx.view(x.shape), dw_partial, db_partial


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, n, param_grads, backend):
    grads = x.new_empty(n if param_grads else 0, dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), grads, grads.clone()


def _layer_norm_setup(ctx, inputs, output):
    x, n, weight, bias, _eps, backend = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.n, ctx.backend = n, backend
    ctx.bias_dtype = None if bias is None else bias.dtype
    ctx.param_shape = next((p.shape for p in (weight, bias) if p is not None), None)
    ctx.mark_non_differentiable(mean, rstd)


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    need_w = weight is not None and ctx.needs_input_grad[2]
    need_b = ctx.bias_dtype is not None and ctx.needs_input_grad[3]
    dx, dw, db = torch.ops.fusedattn.layer_norm_bwd(
        dy, x, weight, mean, rstd, ctx.n, need_w or need_b, ctx.backend
    )
    shape = ctx.param_shape
    return (
        dx,
        None,
        dw.view(shape).to(weight.dtype) if need_w else None,
        db.view(shape).to(ctx.bias_dtype) if need_b else None,
        None,
        None,
    )


layer_norm_fwd.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)


# ---- softmax --------------------------------------------------------------------------------


def as_4d(t: torch.Tensor, dim: int) -> torch.Tensor:
    """t with `dim` moved last, seen as (A, B, C, N): leading 1s added, or the first dims
    merged (a copy only where they cannot merge) when t has more than 4 dims."""
    t = t.movedim(dim, -1)
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t.flatten(0, t.dim() - 4) if t.dim() > 4 else t


def empty_softmax_like(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Output buffer: contiguous with `dim` last, returned in x's dim order (a view)."""
    return new_output(x.movedim(dim, -1).shape, x.dtype, x.device).movedim(-1, dim)


def _strides(t4: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t4.stride())


@torch.library.custom_op("fusedattn::softmax_fwd", mutates_args=())
def softmax_fwd(
    x: torch.Tensor,
    dim: int,
    mask: Optional[torch.Tensor],
    scale: float,
    is_causal: bool,
    backend: str,
) -> torch.Tensor:
    y = empty_softmax_like(x, dim)
    x4, y4 = as_4d(x, dim), as_4d(y, dim)
    A, B, C, N = x4.shape
    if backend == "cuda":  # reads bool masks as bytes, additive ones as fp32
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.float()  # before the broadcast: never a full-size copy
        m4 = as_4d(mask.expand(x.shape), dim) if mask is not None else None
        is_bool = m4 is not None and m4.dtype == torch.bool
        extension().softmax_fwd(
            x4, y4, m4 if is_bool else None, None if is_bool else m4, scale, is_causal
        )
        return y
    m4 = as_4d(mask.expand(x.shape), dim) if mask is not None else None
    K = kernels("softmax")
    if x.numel():
        cfg = K.softmax_config(N, max_one_pass_n=K.MAX_ONE_PASS_N)
        kernel = K.softmax_fwd_one_pass if cfg.one_pass else K.softmax_fwd_looped
        kernel[(A * B * C,)](
            x4, y4, m4, *_strides(x4), *_strides(y4), *(_strides(m4) if m4 is not None else (0,) * 4),
            B, C, N, scale,
            HAS_MASK=mask is not None, MASK_IS_BOOL=mask is not None and mask.dtype == torch.bool,
            IS_CAUSAL=is_causal, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )  # fmt: skip
    return y


@softmax_fwd.register_fake
def _(x, dim, mask, scale, is_causal, backend):
    return empty_softmax_like(x, dim)


@torch.library.custom_op("fusedattn::softmax_bwd", mutates_args=())
def softmax_bwd(
    y: torch.Tensor, dy: torch.Tensor, dim: int, scale: float, backend: str
) -> torch.Tensor:
    """dx = scale * y * (dy - sum(dy * y)) along dim; dy is read, never written."""
    dx = empty_softmax_like(y, dim)
    y4, dy4, dx4 = as_4d(y, dim), as_4d(dy, dim), as_4d(dx, dim)
    A, B, C, N = y4.shape
    if backend == "cuda":
        extension().softmax_bwd(y4, dy4, dx4, scale)
        return dx
    K = kernels("softmax")
    if y.numel():
        cfg = K.softmax_config(N, max_one_pass_n=K.MAX_ONE_PASS_N)
        kernel = K.softmax_bwd_one_pass if cfg.one_pass else K.softmax_bwd_looped
        kernel[(A * B * C,)](
            y4, dy4, dx4, *_strides(y4), *_strides(dy4), *_strides(dx4), B, C, N, scale,
            BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
        )  # fmt: skip
    return dx


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
