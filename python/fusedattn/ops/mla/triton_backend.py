"""The triton backend of `fusedattn.mla_attention_with_kvcache`: the latent decode kernel of
triton_kernels/mla.py, its key splits merged by the decode kernels' ordered or tree combine
(triton_kernels/decode.py's decode_combine with one KV head)."""

from __future__ import annotations

import dataclasses

import torch

from ... import invariance
from ...cache_layout import kvcache_capacity
from ...fp8 import is_fp8, is_mla_ds
from ..core import triton_launch
from ..core.kernels import dense, dot_flags, kernels, sm_count
from ..core.outputs import new_output

MAX_LATENT = 512  # the kernel's latent block (V's columns): DeepSeek's kv_lora_rank
MAX_ROPE = 256
INTERPRETER_SMS = 4  # as the decode kernels' (shared/decode_launch.py)
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


def refusals(*, q, q_pe, kv_cache, Dv, Dr, **_inputs) -> list[str]:
    """Why the Triton MLA kernel cannot take these inputs ([] = it can)."""
    reasons = []
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        reasons.append(
            f"the Triton MLA kernel takes float16, bfloat16 and float32 q, got {q.dtype}"
        )
    if Dv > MAX_LATENT:
        reasons.append(f"the Triton MLA kernel holds up to {MAX_LATENT} latent (V) columns, got "
                       f"head_dim_v = {Dv}")  # fmt: skip
    if Dr > MAX_ROPE:
        reasons.append(f"the Triton MLA kernel holds up to {MAX_ROPE} rope columns (D - "
                       f"head_dim_v), got {Dr}")  # fmt: skip
    return reasons


class TritonMLA:
    """The Triton MLA decode of one call's metadata: tiles, splits, grid and the launch
    arguments worked out once; calling it launches the kernel (and the combine of its
    splits) for that call's tensors."""

    def __init__(self, q, q_pe, kv_cache, block_table, Dv, Dr, scale, is_causal, sinks,
                 num_splits, indices=None):  # fmt: skip
        K = kernels("mla")
        B, Tq, Hq = q.shape[:3]
        sparse = indices is not None  # a program per query: its heads are the rows
        rows = Hq * Tq
        per_program = Hq if sparse else rows
        cfg = K.mla_config(per_program, Dv, Dr, q.is_cuda, is_fp8(kv_cache), is_mla_ds(kv_cache))
        capacity = kvcache_capacity(kv_cache, block_table)
        keys = indices.shape[2] if sparse else capacity  # what the splits cut
        invariant_split = 0
        if invariance.enabled():  # splits at fixed key positions, the ordered combine, one
            # query-block height for every call (a row's products never follow Hq x Tq)
            cfg = dataclasses.replace(cfg, block_m=16 if not q.is_cuda else 32)
            invariant_split = max(1, invariance.split_keys(q.is_cuda) // cfg.block_n)
            num_splits = max(1, -(-keys // (invariant_split * cfg.block_n)))
        m_blocks = -(-per_program // cfg.block_m)
        programs = B * Tq * m_blocks if sparse else B * m_blocks
        if num_splits == 0:
            sms = sm_count(q.device.index or 0) if q.is_cuda else INTERPRETER_SMS
            num_splits = kernels("decode").choose_splits(programs, keys, sms, cfg.block_n)
        self.split = num_splits > 1 or invariant_split > 0
        self.device = q.device
        self.part_o_numel = B * num_splits * rows * Dv
        self.work_numel = self.part_o_numel + B * num_splits * rows
        self.out_shape, self.lse_shape = (B, Tq, Hq, Dv), (B, Hq, Tq)
        self.out_dtype = q.dtype
        scale = (Dv + Dr) ** -0.5 if scale is None else float(scale)
        paged = block_table is not None
        out_strides, lse_strides = (Tq * Hq * Dv, Hq * Dv, Dv), (Hq * Tq, Tq)
        q_pe_strides = q_pe.stride()[:3] if q_pe is not None else (0, 0, 0)
        flags = dot_flags(q)
        if q.is_cuda:
            flags["DOT_IN_FP32"] = False
        self.scalars = (
            *q.stride()[:3], *q_pe_strides, kv_cache.stride(0), kv_cache.stride(1), *out_strides,
            *lse_strides, block_table.stride(0) if paged else 0, Tq, Hq, Dv, Dr, m_blocks,
            num_splits, scale, capacity, kv_cache.shape[0],
            *(indices.stride()[:2] if sparse else (0, 0)), keys if sparse else 0,
        )  # fmt: skip
        self.constexprs = dict(
            PAGED=paged, PAGE_SIZE=kv_cache.shape[1] if paged else 1, IS_CAUSAL=bool(is_causal),
            HAS_SINKS=sinks is not None, SPLIT=self.split, HAS_ROPE=Dr > 0,
            INTERPRETED=not q.is_cuda, **flags, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_V=cfg.block_v, BLOCK_R=cfg.block_r, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
        if is_fp8(kv_cache):
            self.constexprs["CACHE_FP8"] = FP8_CODES[kv_cache.dtype]
        elif is_mla_ds(kv_cache):  # DeepSeek's 656-byte rows
            self.constexprs["CACHE_FP8"] = 3
        if invariant_split:
            self.constexprs["INVARIANT_SPLIT"] = invariant_split
        if sparse:
            self.constexprs["SPARSE"] = True
        self.grid = (programs * num_splits,)
        # decode_combine with Hkv = 1 and group = Hq: the partials' layout is mla_decode's
        self.combine_scalars = (*out_strides, *lse_strides, Tq, Hq, 1, Dv, Hq, num_splits)
        self.combine_constexprs = dict(
            VARLEN_Q=False, HAS_SINKS=sinks is not None,
            BLOCK_S=max(2, 1 << (num_splits - 1).bit_length()), BLOCK_DV=cfg.block_v,
            num_warps=1 if not q.is_cuda else 4, ORDERED=invariant_split > 0,
        )  # fmt: skip
        self.combine_grid = (B * Tq * Hq,)
        self._decode = self._combine = None

    def outputs(self):
        out = new_output(self.out_shape, self.out_dtype, self.device)
        return out, new_output(self.lse_shape, torch.float32, self.device)

    def __call__(self, q, q_pe, kv_cache, seqlens, block_table, sinks, kv_descale,
                 indices=None):  # fmt: skip
        out, lse = self.outputs()
        if out.numel() == 0:
            return out, lse
        part_o = part_lse = None
        if self.split:
            work = torch.empty(self.work_numel, dtype=torch.float32, device=self.device)
            part_o, part_lse = work, work[self.part_o_numel :]
        tensors = (q, q_pe, kv_cache, out, lse, part_o, part_lse, seqlens, block_table, sinks,
                   kv_descale, indices)  # fmt: skip
        if self._decode is None:
            self._decode = triton_launch.prepare(kernels("mla").mla_decode, self.grid,
                                                 (*tensors, *self.scalars), self.constexprs)  # fmt: skip
        else:
            self._decode(*tensors)
        if self.split:
            combine = (part_o, part_lse, out, lse, sinks, None)
            if self._combine is None:
                self._combine = triton_launch.prepare(
                    kernels("decode").decode_combine, self.combine_grid,
                    (*combine, *self.combine_scalars), self.combine_constexprs,
                )  # fmt: skip
            else:
                self._combine(*combine)
        return out, lse


def attention(*, q, q_pe, kv_cache, seqlens_k, block_table, Dv, Dr, scale, is_causal, sinks,
              num_splits, return_lse, kv_descale, indices=None):  # fmt: skip
    """One call's launch (the appended keys already in seqlens_k; indices: the sparse call's
    slots, reference.mla.sparse_slots's)."""
    seqlens_k, block_table, sinks, indices = map(dense, (seqlens_k, block_table, sinks, indices))
    launch = TritonMLA(q, q_pe, kv_cache, block_table, Dv, Dr, scale, is_causal, sinks, num_splits,
                       indices)  # fmt: skip
    out, lse = launch(q, q_pe, kv_cache, seqlens_k, block_table, sinks, kv_descale, indices)
    return (out, lse) if return_lse else out
