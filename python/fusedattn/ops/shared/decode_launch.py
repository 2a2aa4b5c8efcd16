"""The Triton decode kernel's launches (triton_kernels/decode.py): attention over a KV cache,
the combine of its key splits, and the append of new keys and values. Both users of the kernel
launch it here: KV-cache decoding (decode/triton_backend.py) and the paged prefill
(attention/triton_backend.py: varlen_attention with a block table, queries packed).

`TritonDecode` / `TritonAppend` work out one call's launch arguments from its metadata once;
a plan keeps them for every later call with that metadata (decode/plans.py).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from ... import invariance
from ...cache_layout import append_to_cache, kvcache_capacity
from ..core import backends, triton_launch
from ..core.kernels import dense, dot_flags, kernels, sm_count
from ..core.outputs import new_output

NO_DESCALES = (None, None, None)  # (q_descale, k_descale, v_descale) of a call without fp8
FP8_CODES = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}  # the kernels' CACHE_FP8 / Q_FP8


def descale_strides(descale) -> tuple[int, int]:
    """(sequence, kv head) strides of a descale: 0, 0 for one value."""
    if descale is None or descale.numel() == 1:
        return 0, 0
    return descale.stride(0), descale.stride(1)


CHECK_VALUES_ENV = "FUSEDATTN_CHECK_VALUES"


def values_checked(on_gpu: bool, backend: str, environ=os.environ) -> bool:
    """Whether attention_with_kvcache (and the MLA decode) reads its lengths and block table to
    the host to check them: always on the CPU and in the reference and torch backends (they index with them);
    for the Triton kernels on a GPU only with FUSEDATTN_CHECK_VALUES=1, since the sync would
    stall every decode step and break CUDA-graph capture (the kernels clamp what they read
    to the cache, the block table and the lengths, so bad values give a wrong answer for
    that sequence, never an access outside them)."""
    return not on_gpu or backend != "triton" or environ.get(CHECK_VALUES_ENV, "") == "1"


INTERPRETER_SMS = 4  # what the CPU interpreter pretends to have, so num_splits=0 splits there


def default_splits(cfg, programs: int, capacity: int, device: torch.device) -> int:
    """The key splits num_splits=0 picks for `programs` (sequence, kv head, query block)
    programs over a cache of `capacity` keys (choose_splits: two programs per SM)."""
    sms = sm_count(device.index or 0) if device.type == "cuda" else INTERPRETER_SMS
    return kernels("decode").choose_splits(programs, capacity, sms, cfg.block_n)


def launch_decode(q, k_cache, v_cache, out, lse, seqlens_k, block_table, cache_leftpad, key_mask,
                  cu_seqlens_q, B, Tq, scale, window, softcap, alibi_slopes, sinks, num_splits,
                  seqlen_add=0, descales=NO_DESCALES):  # fmt: skip
    """The Triton decode kernel (and the combine of its key splits) into out and lse: q, out
    (B, Tq, Hq, D[v]) and lse (B, Hq, Tq), or with cu_seqlens_q packed q, out (total_q, Hq,
    D[v]) and lse (Hq, total_q), Tq the longest sequence's query count (varlen_attention over a
    paged cache). seqlen_add: keys an append of the same step adds to seqlens_k. descales:
    (q_descale, k_descale, v_descale) of an fp8 cache (and q)."""
    seqlens_k, cache_leftpad, block_table, alibi_slopes, sinks = map(
        dense, (seqlens_k, cache_leftpad, block_table, alibi_slopes, sinks)
    )
    launch = TritonDecode(q, k_cache, v_cache, block_table, cache_leftpad, key_mask,
                          cu_seqlens_q, B, Tq, scale, window, softcap, alibi_slopes, sinks,
                          num_splits, seqlen_add, descales=descales)  # fmt: skip
    launch(q, k_cache, v_cache, out, lse, seqlens_k, cache_leftpad, block_table, alibi_slopes,
           sinks, key_mask, cu_seqlens_q, descales)  # fmt: skip


class TritonDecode:
    """The Triton decode of one call's metadata (shapes, strides, dtypes, flags): tiles, key
    splits, grid, the scalar launch arguments and constexprs, worked out once. Calling it
    launches the decode kernel, and the combine of its splits, for that call's tensors; the
    first call binds each launch to its compiled kernel (triton_launch.prepare), so a plan
    (decode/plans.py) that keeps it for every later call with the same metadata pays only the
    allocations and the launchers. The tensors' strides must be those it was built from (a
    plan's key holds them)."""

    def __init__(self, q, k_cache, v_cache, block_table, cache_leftpad, key_mask, cu_seqlens_q, B,
                 Tq, scale, window, softcap, alibi_slopes, sinks, num_splits,
                 seqlen_add=0, mask_bounds=False, descales=NO_DESCALES):  # fmt: skip
        K = kernels("decode")
        Hq, D = q.shape[-2:]
        Hkv, Dv = k_cache.shape[2], v_cache.shape[-1]
        group = Hq // Hkv
        scale = D**-0.5 if scale is None else float(scale)
        cfg = K.decode_config(group * Tq, D, Dv, q.is_cuda)
        paged = block_table is not None
        capacity = kvcache_capacity(k_cache, block_table)
        invariant_split = 0
        if invariance.enabled():  # fusedattn.batch_invariant: splits at fixed key positions,
            # one query-block height for every call, every split through the ordered combine
            cfg = dataclasses.replace(cfg, block_m=16)
            split_keys = invariance.split_keys(q.is_cuda)
            invariant_split = max(1, split_keys // cfg.block_n)
            num_splits = max(1, -(-capacity // (invariant_split * cfg.block_n)))
        m_blocks = -(-group * Tq // cfg.block_m)
        if num_splits == 0:
            num_splits = default_splits(cfg, B * Hkv * m_blocks, capacity, q.device)
        self.split = num_splits > 1 or invariant_split > 0
        self.varlen = cu_seqlens_q is not None
        self.device = q.device
        # the partials: one fp32 buffer, the outputs then the log-sum-exps
        self.part_o_numel = B * Hkv * num_splits * group * Tq * Dv
        self.work_numel = self.part_o_numel + B * Hkv * num_splits * group * Tq
        self.out_shape = (q.shape[0], Hq, Dv) if self.varlen else (B, Tq, Hq, Dv)
        self.lse_shape = (Hq, q.shape[0]) if self.varlen else (B, Hq, Tq)
        self.out_dtype = q.dtype
        if self.varlen:  # packed rows: no batch stride, the lse (Hq, total_q)
            q_strides, out_strides = (0, *q.stride()[:2]), (0, Hq * Dv, Dv)
            lse_strides = (0, q.shape[0])
        else:
            q_strides, out_strides = q.stride()[:3], (Tq * Hq * Dv, Hq * Dv, Dv)
            lse_strides = (Hq * Tq, Tq)
        flags = dot_flags(q)
        interpreted = not q.is_cuda
        if not interpreted:
            flags["DOT_IN_FP32"] = False
        self.decode_scalars = (
            *q_strides, *k_cache.stride()[:3], *v_cache.stride()[:3], *out_strides, *lse_strides,
            block_table.stride(0) if paged else 0,
            Hq if alibi_slopes is not None and alibi_slopes.dim() == 2 else 0,
            0 if key_mask is None else key_mask.stride(0),
            Tq, Hq, Hkv, D, Dv, group, m_blocks, num_splits, scale, float(softcap), window.left,
            window.right, capacity, k_cache.shape[0], seqlen_add,
            *(stride for d in descales for stride in descale_strides(d)),
        )  # fmt: skip
        self.decode_constexprs = dict(
            VARLEN_Q=self.varlen, HAS_LEFTPAD=cache_leftpad is not None, PAGED=paged,
            PAGE_SIZE=k_cache.shape[1] if paged else 1, HAS_LEFT=window.left >= 0,
            HAS_RIGHT=window.right >= 0, SOFTCAP=softcap > 0.0,
            HAS_ALIBI=alibi_slopes is not None, HAS_SINKS=sinks is not None, SPLIT=self.split,
            HAS_KEY_MASK=key_mask is not None, INTERPRETED=interpreted, **flags,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=cfg.block_d,
            BLOCK_DV=cfg.block_dv, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
        if k_cache.dtype in FP8_CODES:  # an fp8 cache, read as bytes and converted per tile
            self.decode_constexprs.update(CACHE_FP8=FP8_CODES[k_cache.dtype],
                                          Q_FP8=FP8_CODES.get(q.dtype, 0))  # fmt: skip
            if q.dtype != torch.float32:  # the products in fp16 (attention_decode's DOT_F16)
                self.decode_constexprs["DOT_F16"] = True
                if interpreted:  # the interpreter's fp16 dot: fp32 (exact products)
                    self.decode_constexprs["DOT_IN_FP32"] = True
            self.out_dtype = torch.bfloat16 if q.dtype in FP8_CODES else q.dtype
        if invariant_split:
            self.decode_constexprs["INVARIANT_SPLIT"] = invariant_split
        if mask_bounds:  # the keys' bounds from the key mask, found by each program
            scan = 16 if interpreted else min(1024, max(16, 1 << (capacity - 1).bit_length()))
            self.decode_constexprs.update(MASK_BOUNDS=True, MASK_SCAN=scan)
        self.decode_grid = (B * Hkv * m_blocks * num_splits,)
        self.combine_scalars = (*out_strides, *lse_strides, Tq, Hq, Hkv, Dv, group, num_splits)
        self.combine_constexprs = dict(
            VARLEN_Q=self.varlen, HAS_SINKS=sinks is not None,
            BLOCK_S=max(2, 1 << (num_splits - 1).bit_length()), BLOCK_DV=cfg.block_dv,
            num_warps=1 if interpreted else 4, ORDERED=invariant_split > 0,
        )  # fmt: skip
        self.combine_grid = (B * Tq * Hq,)
        self.kernels = K
        self._decode = self._combine = None  # Prepared launches, bound at the first call

    def outputs(self, q):
        """(out, lse): new buffers of the call's output shapes (contiguous, as the strides above)."""
        out = new_output(self.out_shape, self.out_dtype, self.device)
        return out, new_output(self.lse_shape, torch.float32, self.device)

    def __call__(self, q, k_cache, v_cache, out, lse, seqlens_k, cache_leftpad, block_table,
                 alibi_slopes, sinks, key_mask, cu_seqlens_q, descales=NO_DESCALES):  # fmt: skip
        """Launch for these tensors (1-D ones contiguous, q with a unit last stride)."""
        if out.numel() == 0:
            return
        part_o = part_lse = None
        if self.split:
            work = torch.empty(self.work_numel, dtype=torch.float32, device=self.device)
            part_o, part_lse = work, work[self.part_o_numel :]
        tensors = (q, k_cache, v_cache, out, lse, part_o, part_lse, seqlens_k, cache_leftpad,
                   block_table, alibi_slopes, sinks, key_mask, cu_seqlens_q, *descales)  # fmt: skip
        if self._decode is None:
            self._decode = triton_launch.prepare(
                self.kernels.attention_decode, self.decode_grid,
                (*tensors, *self.decode_scalars), self.decode_constexprs,
            )  # fmt: skip
        else:
            self._decode(*tensors)
        if not self.split:
            return
        tensors = (part_o, part_lse, out, lse, sinks, cu_seqlens_q)
        if self._combine is None:
            self._combine = triton_launch.prepare(
                self.kernels.decode_combine, self.combine_grid,
                (*tensors, *self.combine_scalars), self.combine_constexprs,
            )  # fmt: skip
        else:
            self._combine(*tensors)


class TritonAppend:
    """append_kv of one call's metadata (append's kernel path), bound to its
    compiled kernel at the first call, as TritonDecode."""

    def __init__(self, k_cache, v_cache, k, v, block_table, k_descale=None, v_descale=None):
        B, Tnew, Hkv = k.shape[:3]
        D, Dv = k.shape[-1], v.shape[-1]
        cfg = kernels("decode").decode_config(1, D, Dv, k_cache.is_cuda)  # its head-dim blocks
        paged = block_table is not None
        self.scalars = (
            *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_table.stride(0) if paged else 0, Tnew, Hkv, D, Dv,
            kvcache_capacity(k_cache, block_table), k_cache.shape[0],
            *descale_strides(k_descale), *descale_strides(v_descale),
        )  # fmt: skip
        self.constexprs = dict(PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
                               BLOCK_D=cfg.block_d, BLOCK_DV=cfg.block_dv, num_warps=1)  # fmt: skip
        self.fp8 = k_cache.dtype in FP8_CODES  # written as bytes (fp8.fp8_bits)
        if self.fp8:
            self.constexprs["CACHE_FP8"] = FP8_CODES[k_cache.dtype]
        self.grid = (B * Tnew * Hkv,)
        self.empty = B * Tnew * Hkv == 0
        self._launch = None

    def __call__(self, k_cache, v_cache, k, v, seqlens, block_table, k_descale=None,
                 v_descale=None):  # fmt: skip
        if self.empty:
            return
        if self.fp8:
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        tensors = (k, v, k_cache, v_cache, seqlens, block_table, k_descale, v_descale)
        if self._launch is None:
            self._launch = triton_launch.prepare(kernels("decode").append_kv, self.grid,
                                                 (*tensors, *self.scalars), self.constexprs)  # fmt: skip
        else:
            self._launch(*tensors)


def append_uses_kernel(k_cache) -> bool:
    """Whether the append runs append_kv (a GPU with Triton) or torch's indexed writes."""
    return k_cache.is_cuda and backends.TRITON_INSTALLED


def append(k_cache, v_cache, k, v, seqlens, block_table, k_descale=None, v_descale=None, *,
           kernel: bool | None = None):  # fmt: skip
    """attention_with_kvcache's in-place append, before any backend runs: on a GPU with Triton
    (kernel=None) one launch of append_kv, else torch's indexed writes (append_to_cache: about
    ten ops, 170 µs of the host's time per decode step on the CPU machine). The same bits, an
    fp8 cache's included (x / descale rounded to nearest-even, saturating)."""
    if kernel is None:
        kernel = append_uses_kernel(k_cache)
    if not kernel:
        append_to_cache(k_cache, v_cache, k, v, seqlens, block_table, k_descale, v_descale)
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    table = dense(block_table)
    TritonAppend(k_cache, v_cache, k, v, table, k_descale, v_descale)(
        k_cache, v_cache, k, v, dense(seqlens), table, k_descale, v_descale
    )


def key_mask_bounds(key_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(seqlens, leftpad) int32 (B,) of a (B, S) visibility row (or (B, 1, 1, S)): sequence
    b's keys run from its first visible position to one past its last (a row with none: 0
    keys, its left padding S past them, which every backend reads as no key). Seven torch
    ops on the device, no sync: valid by construction, no value check. (The Triton kernel
    finds the same bounds itself: TritonDecode's mask_bounds.)"""
    B, S = key_mask.shape[0], key_mask.shape[-1]
    key_mask = key_mask.view(B, S)
    index = torch.arange(S, device=key_mask.device, dtype=torch.int32)
    seqlens = torch.where(key_mask, index + 1, 0).amax(-1).to(torch.int32)
    leftpad = torch.where(key_mask, index, S).amin(-1).to(torch.int32)
    return seqlens, leftpad
