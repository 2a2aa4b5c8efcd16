"""The flash attention of both kernel backends (Triton, CUDA C++) as torch.library custom ops
with fake implementations and autograd, so torch.compile(fullgraph=True) sees one opaque op
each way. One op per direction serves both backends (`backend` is "triton" or "cuda"): the
output layout, the autograd glue and the float-mask gradient exist once. Signatures say
Optional[...]: torch.library reads typing.Optional on every torch we support.
"""

import functools
import math
from typing import Optional

import torch

from .rowwise import (
    KERNEL_DTYPES,
    extension,
    extension_op_refusals,
    kernels,
    new_output,
    new_output_like,
)

MAX_HEAD_DIM = 256
CUDA_DTYPES = (torch.float16, torch.bfloat16)


def triton_refusals(*, q, k, v, **_inputs) -> list[str]:
    """Why the Triton attention cannot take these inputs ([] = it can)."""
    reasons = []
    if q.dtype not in KERNEL_DTYPES:
        reasons.append(f"the Triton attention takes float16, bfloat16 and float32, got {q.dtype}")
    if max(q.shape[-1], v.shape[-1]) > MAX_HEAD_DIM:
        reasons.append(f"head dims up to {MAX_HEAD_DIM}, got D={q.shape[-1]}, Dv={v.shape[-1]}")
    return reasons


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def cuda_refusals(*, q, k, v, **_inputs) -> list[str]:
    """Why the CUDA C++ attention cannot take these inputs ([] = it can). fp32 is refused
    (tensor cores take fp16/bf16; auto then routes fp32 to torch or Triton)."""
    reasons = extension_op_refusals("attention")
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


def _empty_out(q: torch.Tensor, Dv: int) -> torch.Tensor:
    """(B, Hq, Tq, Dv) view of a (B, Tq, Hq, Dv) buffer: the merge of heads that follows in a
    module (out.transpose(1, 2).flatten(2)) is then free."""
    B, H, T, _ = q.shape
    return new_output((B, T, H, Dv), q.dtype, q.device).transpose(1, 2)


def _dot_flags(q: torch.Tensor) -> dict:
    """fp32 inputs to fp32 accuracy unless the user allowed TF32 (torch.backends); bf16 dots in
    fp32 in the CPU interpreter (see _dot in the kernels)."""
    tf32 = q.dtype != torch.float32 or torch.backends.cuda.matmul.allow_tf32
    return dict(
        PRECISION="tf32" if tf32 else "ieee",
        DOT_IN_FP32=not q.is_cuda and q.dtype == torch.bfloat16,
    )


def _mask_args(q, k, attn_mask, key_padding_mask):
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    mask = None if attn_mask is None else attn_mask.expand(B, H, Tq, Tk)  # a view: strides 0
    kpm = None if key_padding_mask is None else key_padding_mask.contiguous()
    strides = tuple(mask.stride()) if mask is not None else (0, 0, 0, 0)
    flags = dict(
        HAS_MASK=mask is not None,
        MASK_IS_BOOL=mask is not None and mask.dtype == torch.bool,
        HAS_KPM=kpm is not None,
    )
    return mask, kpm, (*strides, kpm.stride(0) if kpm is not None else 0), flags


def _config(q, v):
    K = kernels("attention")
    return K, K.attention_config(q.shape[-1], v.shape[-1], q.is_cuda)


@torch.library.custom_op("fusedattn::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: float,
    dropout_p: float,
    seed: Optional[torch.Tensor],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out (B, Hq, Tq, Dv), lse (B, Hq, Tq) fp32). With dropout_p > 0, `seed` (an int64
    tensor on q's device) seeds the Philox stream the backward regenerates."""
    q, k, v = _kernel_layout(backend, q, k, v)
    B, H, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    out = _empty_out(q, Dv)
    lse = new_output((B, H, Tq), torch.float32, q.device)
    if out.numel() == 0 or Tk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    if backend == "cuda":
        extension().attention_fwd(
            q, k, v, out, lse, *_cuda_masks(q, k, attn_mask, key_padding_mask), is_causal,
            scale, dropout_p, seed,
        )  # fmt: skip
        return out, lse
    K, cfg = _config(q, v)
    mask, kpm, mask_strides, flags = _mask_args(q, k, attn_mask, key_padding_mask)
    K.attention_fwd[(B * H, -(-Tq // cfg.block_m))](
        q, k, v, out, lse, mask, kpm, seed,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3], *mask_strides,
        H, Tq, Tk, D, Dv, H // Hkv, scale, dropout_p,
        IS_CAUSAL=is_causal, DROPOUT=dropout_p > 0.0, BLOCK_M=cfg.block_m, **_dot_flags(q),
        BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d, BLOCK_DV=cfg.block_dv,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags,
    )  # fmt: skip
    return out, lse


@attention_fwd.register_fake
def _(q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, backend):
    B, H, Tq, _ = q.shape
    return _empty_out(q, v.shape[-1]), q.new_empty(B, H, Tq, dtype=torch.float32)


@torch.library.custom_op("fusedattn::attention_bwd", mutates_args=())
def attention_bwd(
    do: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: Optional[torch.Tensor],
    key_padding_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: float,
    dropout_p: float,
    seed: Optional[torch.Tensor],
    mask_grad: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv, dS): dS is the dense fp32 (B, Hq, Tq, Tk) gradient of the scores (the
    float mask's gradient before its broadcast is summed), empty unless mask_grad."""
    q, k, v, out, do = _kernel_layout(backend, q, k, v, out, do)
    B, H, Tq, D = q.shape
    Hkv, Tk, Dv = k.shape[1], k.shape[2], v.shape[-1]
    dq, dk, dv = new_output_like(q), new_output_like(k), new_output_like(v)
    # zeros: causal tiles the dq kernel skips must read 0
    dmask = torch.zeros((B, H, Tq, Tk) if mask_grad else (0,), dtype=torch.float32, device=q.device)
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), dmask
    if backend == "cuda":
        delta = new_output((B, H, Tq), torch.float32, q.device)
        extension().attention_bwd(
            do, q, k, v, out, lse, dq, dk, dv, delta, dmask if mask_grad else None,
            *_cuda_masks(q, k, attn_mask, key_padding_mask), is_causal, scale, dropout_p, seed,
        )  # fmt: skip
        return dq, dk, dv, dmask
    K, cfg = _config(q, v)
    mask, kpm, mask_strides, flags = _mask_args(q, k, attn_mask, key_padding_mask)
    delta = new_output((B, H, Tq), torch.float32, q.device)
    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_DV=cfg.block_dv)
    K.attention_bwd_delta[(B * H, -(-Tq // cfg.block_m))](
        out, do, delta, *out.stride()[:3], *do.stride()[:3], H, Tq, Dv, **tiles
    )
    common = dict(
        IS_CAUSAL=is_causal, DROPOUT=dropout_p > 0.0, BLOCK_N=cfg.block_n, **_dot_flags(q),
        BLOCK_D=cfg.block_d, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **tiles, **flags,
    )  # fmt: skip
    K.attention_bwd_dkdv[(B * Hkv, -(-Tk // cfg.block_n))](
        q, k, v, do, lse, delta, dk, dv, mask, kpm, seed,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3],
        *dk.stride()[:3], *dv.stride()[:3], *mask_strides,
        H, Hkv, Tq, Tk, D, Dv, H // Hkv, scale, dropout_p, **common,
    )  # fmt: skip
    K.attention_bwd_dq[(B * H, -(-Tq // cfg.block_m))](
        q, k, v, do, lse, delta, dq, dmask, mask, kpm, seed,
        *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *do.stride()[:3], *dq.stride()[:3],
        *mask_strides, H, Tq, Tk, D, Dv, H // Hkv, scale, dropout_p, MASK_GRAD=mask_grad,
        **common,
    )  # fmt: skip
    return dq, dk, dv, dmask


@attention_bwd.register_fake
def _(do, q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed,
      mask_grad, backend):  # fmt: skip
    B, H, Tq, _ = q.shape
    shape = (B, H, Tq, k.shape[2]) if mask_grad else (0,)
    return (
        torch.empty_like(q),
        torch.empty_like(k),
        torch.empty_like(v),
        q.new_empty(shape, dtype=torch.float32),
    )


def _setup(ctx, inputs, output):
    q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, backend = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, key_padding_mask, seed)
    ctx.is_causal, ctx.scale, ctx.dropout_p, ctx.backend = is_causal, scale, dropout_p, backend
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, attn_mask, key_padding_mask, seed = ctx.saved_tensors
    mask_grad = attn_mask is not None and attn_mask.is_floating_point() and ctx.needs_input_grad[3]
    dq, dk, dv, dscores = torch.ops.fusedattn.attention_bwd(
        dout, q, k, v, out, lse, attn_mask, key_padding_mask, ctx.is_causal, ctx.scale,
        ctx.dropout_p, seed, mask_grad, ctx.backend,
    )  # fmt: skip
    dmask = dscores.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if mask_grad else None
    return dq, dk, dv, dmask, None, None, None, None, None, None


attention_fwd.register_autograd(_backward, setup_context=_setup)


def run(
    q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa, key_padding_mask, return_lse,
    *, backend,
):  # fmt: skip
    """The `triton` and `cuda` backends of fusedattn.attention."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    seed = None
    if dropout_p > 0.0:  # from torch's generator on q's device: reproducible under manual_seed
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
    out, lse = torch.ops.fusedattn.attention_fwd(
        q, k, v, attn_mask, key_padding_mask, is_causal, scale, dropout_p, seed, backend
    )
    return (out, lse) if return_lse else out


run_triton = functools.partial(run, backend="triton")
run_cuda = functools.partial(run, backend="cuda")
