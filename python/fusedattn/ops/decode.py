"""`fusedattn.attention_with_kvcache`: validation, the in-place append, backend dispatch, and
the torch and Triton backends (the reference one is reference/decode.py).

Inference only. The layout is flash-attention's `flash_attn_with_kvcache` (sequence before
heads), so its callers port by renaming. The append happens here, once, before any backend
runs; the backends then see sequence b's keys at cache positions
[cache_leftpad[b], cache_seqlens[b] + Tnew).
"""

from __future__ import annotations

import functools
import os

import torch

from .. import reference
from ..checks import check_kvcache_args, kvcache_capacity
from ..masks import NO_WINDOW
from ..reference.decode import append_to_cache
from . import backends, decode_ops, decode_plan, triton_launch
from .attention import _torch_attention, _torch_refusals
from .attention_launch import dot_flags
from .flash_attention import MAX_HEAD_DIM
from .rowwise import KERNEL_DTYPES, kernels, new_output, tracing

# ---- reference ------------------------------------------------------------------------------


def _reference(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, scale,
               window, softcap, alibi_slopes, sinks, num_splits, return_lse):  # fmt: skip
    return reference.decode.cached_attention(
        q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, scale, window, softcap,
        alibi_slopes, sinks, return_lse, key_mask=key_mask,
    )  # fmt: skip


# ---- torch: one SDPA call over the cache gathered to (B, Hkv, S, D) ---------------------------


def _torch_decode_refusals(*, q, return_lse, softcap, alibi_slopes, sinks, **_inputs):
    return _torch_refusals(q=q, return_lse=return_lse, softcap=softcap,
                           alibi_slopes=alibi_slopes, sinks=sinks)  # fmt: skip


def dense_cache(cache: torch.Tensor, block_table, B: int) -> torch.Tensor:
    """(B, Hkv, capacity, D) view of the first B sequences of a contiguous cache, or the pages
    of a paged one gathered in block-table order (a copy; entries past a sequence's pages may
    hold anything, so they are clamped to a valid page and masked by the caller)."""
    if block_table is None:
        return cache[:B].transpose(1, 2)
    pages = block_table.long().clamp(0, cache.shape[0] - 1)
    gathered = cache[pages]  # (B, max_pages, page_size, Hkv, D)
    return gathered.flatten(1, 2).transpose(1, 2)


def visible_keys(seqlens_k, cache_leftpad, key_mask, Tq: int, capacity: int, window):
    """((B, 1, Tq, capacity) bool: query i of sequence b may see cache position j, (B, Tq, 1)
    its position L_b - Tq + i), on the device (no sync)."""
    j = torch.arange(capacity, device=seqlens_k.device)
    end = seqlens_k.long()[:, None, None]  # (B, 1, 1)
    start = 0 if cache_leftpad is None else cache_leftpad.long()[:, None, None]
    pos = end - Tq + torch.arange(Tq, device=seqlens_k.device)[None, :, None]  # (B, Tq, 1)
    keep = (j >= start) & (j < end)
    if key_mask is not None:
        keep = keep & key_mask[:, None, :capacity]
    if window.right >= 0:
        keep = keep & (j <= pos + window.right)
    if window.left >= 0:
        keep = keep & (j >= pos - window.left)
    return keep[:, None], pos


def _torch(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, scale, window,
           softcap, alibi_slopes, sinks, num_splits, return_lse):  # fmt: skip
    """SDPA over the whole cache capacity with one (B, 1 or Hq, Tq, capacity) mask: the positions
    of each sequence differ, so they go in the mask (ALiBi as a float bias)."""
    B, Tq = q.shape[:2]
    keys, values = dense_cache(k_cache, block_table, B), dense_cache(v_cache, block_table, B)
    keep, pos = visible_keys(seqlens_k, cache_leftpad, key_mask, Tq, keys.shape[2], window)
    padding = ~keep.any(dim=2)[:, 0]  # (B, capacity): keys no query sees, zero-filled by SDPA's
    mask = keep
    if alibi_slopes is not None:
        slopes = alibi_slopes.reshape(-1 if alibi_slopes.dim() == 2 else 1, q.shape[2], 1, 1)
        j = torch.arange(keys.shape[2], device=q.device)
        bias = -slopes * (pos[:, None] - j).abs().to(slopes.dtype)  # (B or 1, Hq, Tq, cap)
        mask = bias.masked_fill(~keep, float("-inf"))
    out = _torch_attention(
        q.transpose(1, 2), keys, values, mask, 0.0, scale, q.shape[2] != keys.shape[1], padding,
        NO_WINDOW, 0.0, None, sinks, False,
    )  # fmt: skip
    return out.transpose(1, 2)


# ---- triton ---------------------------------------------------------------------------------


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


INTERPRETER_SMS = 4  # what the CPU interpreter pretends to have, so num_splits=0 splits there


def default_splits(cfg, programs: int, capacity: int, device: torch.device) -> int:
    """The key splits num_splits=0 picks for `programs` (sequence, kv head, query block)
    programs over a cache of `capacity` keys (choose_splits: two programs per SM)."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else INTERPRETER_SMS
    return kernels("decode").choose_splits(programs, capacity, sms, cfg.block_n)


def _triton_refusals(*, q, k_cache, v_cache, alibi_slopes=None, **_inputs) -> list[str]:
    reasons = []
    if q.dtype not in KERNEL_DTYPES:
        reasons.append(
            f"the Triton decode kernel takes float16, bfloat16 and float32, got {q.dtype}"
        )
    D, Dv = q.shape[-1], v_cache.shape[-1]
    if max(D, Dv) > MAX_HEAD_DIM:
        reasons.append(f"head dims up to {MAX_HEAD_DIM}, got D={D}, Dv={Dv}")
    return reasons


def _triton(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, scale, window,
            softcap, alibi_slopes, sinks, num_splits, return_lse):  # fmt: skip
    if q.stride(-1) != 1:
        q = q.contiguous()
    # one-dimensional per-sequence values and the parameters are read at b / h: dense
    seqlens_k, cache_leftpad, block_table, alibi_slopes, sinks = map(
        dense, (seqlens_k, cache_leftpad, block_table, alibi_slopes, sinks)
    )
    launch = TritonDecode(q, k_cache, v_cache, block_table, cache_leftpad, key_mask, None,
                          q.shape[0], q.shape[1], scale, window, softcap, alibi_slopes, sinks,
                          num_splits)  # fmt: skip
    out, lse = launch.outputs(q)
    launch(q, k_cache, v_cache, out, lse, seqlens_k, cache_leftpad, block_table, alibi_slopes,
           sinks, key_mask, None)  # fmt: skip
    return (out, lse) if return_lse else out


def launch_decode(q, k_cache, v_cache, out, lse, seqlens_k, block_table, cache_leftpad, key_mask,
                  cu_seqlens_q, B, Tq, scale, window, softcap, alibi_slopes, sinks, num_splits,
                  seqlen_add=0):  # fmt: skip
    """The Triton decode kernel (and the combine of its key splits) into out and lse: q, out
    (B, Tq, Hq, D[v]) and lse (B, Hq, Tq), or with cu_seqlens_q packed q, out (total_q, Hq,
    D[v]) and lse (Hq, total_q), Tq the longest sequence's query count (varlen_attention over a
    paged cache). seqlen_add: keys an append of the same step adds to seqlens_k."""
    seqlens_k, cache_leftpad, block_table, alibi_slopes, sinks = map(
        dense, (seqlens_k, cache_leftpad, block_table, alibi_slopes, sinks)
    )
    launch = TritonDecode(q, k_cache, v_cache, block_table, cache_leftpad, key_mask,
                          cu_seqlens_q, B, Tq, scale, window, softcap, alibi_slopes, sinks,
                          num_splits, seqlen_add)  # fmt: skip
    launch(q, k_cache, v_cache, out, lse, seqlens_k, cache_leftpad, block_table, alibi_slopes,
           sinks, key_mask, cu_seqlens_q)  # fmt: skip


def dense(t: torch.Tensor | None) -> torch.Tensor | None:
    """t contiguous (the kernels read lengths, tables and per-head parameters with their
    last stride 1 and rows of their own length); a copy only where it is not."""
    return t if t is None or t.is_contiguous() else t.contiguous()


class TritonDecode:
    """The Triton decode of one call's metadata (shapes, strides, dtypes, flags): tiles, key
    splits, grid, the scalar launch arguments and constexprs, worked out once. Calling it
    launches the decode kernel, and the combine of its splits, for that call's tensors; the
    first call binds each launch to its compiled kernel (triton_launch.prepare), so a plan
    (decode_plan.py) that keeps it for every later call with the same metadata pays only the
    allocations and the launchers. The tensors' strides must be those it was built from (a
    plan's key holds them)."""

    def __init__(self, q, k_cache, v_cache, block_table, cache_leftpad, key_mask, cu_seqlens_q, B,
                 Tq, scale, window, softcap, alibi_slopes, sinks, num_splits,
                 seqlen_add=0):  # fmt: skip
        K = kernels("decode")
        Hq, D = q.shape[-2:]
        Hkv, Dv = k_cache.shape[2], v_cache.shape[-1]
        group = Hq // Hkv
        scale = D**-0.5 if scale is None else float(scale)
        cfg = K.decode_config(group * Tq, D, Dv, q.is_cuda)
        m_blocks = -(-group * Tq // cfg.block_m)
        paged = block_table is not None
        capacity = kvcache_capacity(k_cache, block_table)
        if num_splits == 0:
            num_splits = default_splits(cfg, B * Hkv * m_blocks, capacity, q.device)
        self.split = num_splits > 1
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
        self.decode_grid = (B * Hkv * m_blocks * num_splits,)
        self.combine_scalars = (*out_strides, *lse_strides, Tq, Hq, Hkv, Dv, group, num_splits)
        self.combine_constexprs = dict(
            VARLEN_Q=self.varlen, HAS_SINKS=sinks is not None,
            BLOCK_S=max(2, 1 << (num_splits - 1).bit_length()), BLOCK_DV=cfg.block_dv,
            num_warps=1 if interpreted else 4,
        )  # fmt: skip
        self.combine_grid = (B * Tq * Hq,)
        self.kernels = K
        self._decode = self._combine = None  # Prepared launches, bound at the first call

    def outputs(self, q):
        """(out, lse): new buffers of the call's output shapes (contiguous, as the strides above)."""
        out = new_output(self.out_shape, self.out_dtype, self.device)
        return out, new_output(self.lse_shape, torch.float32, self.device)

    def __call__(self, q, k_cache, v_cache, out, lse, seqlens_k, cache_leftpad, block_table,
                 alibi_slopes, sinks, key_mask, cu_seqlens_q):  # fmt: skip
        """Launch for these tensors (1-D ones contiguous, q with a unit last stride)."""
        if out.numel() == 0:
            return
        part_o = part_lse = None
        if self.split:
            work = torch.empty(self.work_numel, dtype=torch.float32, device=self.device)
            part_o, part_lse = work, work[self.part_o_numel :]
        tensors = (q, k_cache, v_cache, out, lse, part_o, part_lse, seqlens_k, cache_leftpad,
                   block_table, alibi_slopes, sinks, key_mask, cu_seqlens_q)  # fmt: skip
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
    """append_kv of one call's metadata (ops/decode.append's kernel path), bound to its
    compiled kernel at the first call, as TritonDecode."""

    def __init__(self, k_cache, v_cache, k, v, block_table):
        B, Tnew, Hkv = k.shape[:3]
        D, Dv = k.shape[-1], v.shape[-1]
        cfg = kernels("decode").decode_config(1, D, Dv, k_cache.is_cuda)  # its head-dim blocks
        paged = block_table is not None
        self.scalars = (
            *k.stride()[:3], *v.stride()[:3], *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_table.stride(0) if paged else 0, Tnew, Hkv, D, Dv,
            kvcache_capacity(k_cache, block_table), k_cache.shape[0],
        )  # fmt: skip
        self.constexprs = dict(PAGED=paged, PAGE_SIZE=k_cache.shape[1] if paged else 1,
                               BLOCK_D=cfg.block_d, BLOCK_DV=cfg.block_dv, num_warps=1)  # fmt: skip
        self.grid = (B * Tnew * Hkv,)
        self.empty = B * Tnew * Hkv == 0
        self._launch = None

    def __call__(self, k_cache, v_cache, k, v, seqlens, block_table):
        if self.empty:
            return
        tensors = (k, v, k_cache, v_cache, seqlens, block_table)
        if self._launch is None:
            self._launch = triton_launch.prepare(kernels("decode").append_kv, self.grid,
                                                 (*tensors, *self.scalars), self.constexprs)  # fmt: skip
        else:
            self._launch(*tensors)


def append_uses_kernel(k_cache) -> bool:
    """Whether the append runs append_kv (a GPU with Triton) or torch's indexed writes."""
    return k_cache.is_cuda and backends.TRITON_INSTALLED


def append(k_cache, v_cache, k, v, seqlens, block_table, *, kernel: bool | None = None):
    """attention_with_kvcache's in-place append, before any backend runs: on a GPU with Triton
    (kernel=None) one launch of append_kv, else torch's indexed writes (append_to_cache: about
    ten ops, 170 µs of the host's time per decode step on the CPU machine). The same bits."""
    if kernel is None:
        kernel = append_uses_kernel(k_cache)
    if not kernel:
        append_to_cache(k_cache, v_cache, k, v, seqlens, block_table)
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    table = dense(block_table)
    TritonAppend(k_cache, v_cache, k, v, table)(k_cache, v_cache, k, v, dense(seqlens), table)


backends.register("attention_with_kvcache", "reference", _reference, backends.no_refusals)
backends.register("attention_with_kvcache", "torch", _torch, _torch_decode_refusals)
backends.register("attention_with_kvcache", "triton", _triton, _triton_refusals)


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    *,
    cache_seqlens,
    block_table: torch.Tensor | None = None,
    cache_leftpad: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    window_size: tuple[int, int] | None = None,
    softcap: float = 0.0,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int = 0,
    return_lse: bool = False,
    backend: str = "auto",
):
    """Attention of a few new queries per sequence over a KV cache (decoding, speculative
    decoding, chunked prefill); flash-attention's `flash_attn_with_kvcache` layout.

    q (B, Tq, Hq, D). A contiguous cache k_cache (B', S, Hkv, D), v_cache (B', S, Hkv, Dv)
    with B' >= B (sequence b is row b), or a paged one (num_pages, page_size, Hkv, D) with
    block_table (B, max_pages) int32: page p of sequence b is k_cache[block_table[b, p]]; any
    page size from 1. Any strides with a unit last stride (Hugging Face's (B, Hkv, S, D) cache
    passed as .transpose(1, 2) is read in place).

    cache_seqlens: int32 (B,) or an int; cache_leftpad: int32 (B,) or None (0). With k, v
    (B, Tnew, Hkv, D[v]) they are first written into the cache in place at positions
    cache_seqlens[b] .. + Tnew - 1 (nothing else in the cache is written; the caller advances
    cache_seqlens). Sequence b's keys are then positions
    cache_leftpad[b] .. L_b - 1, L_b = cache_seqlens[b] + Tnew, and query i sits at position
    L_b - Tq + i for is_causal, window_size and alibi_slopes (bottom-right). softcap, sinks,
    GQA/MQA, scale and a row that sees no key (0 output, lse -inf or the sink) as in
    `attention`. num_splits: key splits per (sequence, kv head); 0 picks them per call so
    that batch 1 fills the GPU; fp32 partials combined in a fixed order (the same inputs give
    the same bits). Returns out (B, Tq, Hq, Dv) [, lse (B, Hq, Tq) fp32].

    Inference only: refused (ValueError) where autograd would record, i.e. with grad mode on
    and an input that requires grad; under torch.no_grad() or inference_mode() parameters
    that require grad (GPT-OSS's sinks) are fine.

    Bad input raises before anything is written: the metadata and every refusal of the
    backend first, then the values (cache_seqlens in [0, capacity - Tnew], cache_leftpad in
    [0, cache_seqlens + Tnew], the block-table entries of the pages a sequence uses in
    [0, num_pages)). Values are checked on the CPU and by the reference and torch backends; the
    Triton kernels on a GPU skip the check (a host sync) unless FUSEDATTN_CHECK_VALUES=1, and
    never read or write outside the caches, the block table or the lengths whatever the
    values.
    """
    plan_key = None
    if not tracing():  # an eager call of known metadata: its plan (decode_plan.py)
        plan_key = decode_plan.key(
            q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, scale,
            is_causal, window_size, softcap, alibi_slopes, sinks, num_splits, return_lse, backend,
        )  # fmt: skip
        plan = decode_plan.PLANS.get(plan_key)
        if plan is not None:
            return plan(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad,
                        alibi_slopes, sinks)  # fmt: skip
    window, seqlens = check_kvcache_args(
        q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, scale,
        is_causal, window_size, softcap, alibi_slopes, sinks, num_splits,
    )  # fmt: skip
    Tnew = 0 if k is None else k.shape[1]
    inputs = _inputs(
        q, k_cache, v_cache, seqlens + Tnew if Tnew else seqlens, block_table, cache_leftpad,
        None, scale, window, softcap, alibi_slopes, sinks, num_splits, return_lse,
    )  # fmt: skip
    # Every refusal, then the values, before anything is written into the caches.
    impl = backends.select("attention_with_kvcache", backend, q.device, inputs)
    check_values = values_checked(q.is_cuda, impl.backend)
    if tracing():  # torch.compile / jit.trace: the custom ops (decode_ops.py)
        return decode_ops.record(q, k_cache, v_cache, k, v, seqlens, inputs, check_values,
                                 impl.backend)  # fmt: skip
    int_seqlens = None if isinstance(cache_seqlens, torch.Tensor) else seqlens
    if impl.run is _triton:  # the module's own Triton backend (not a wrapper of it)
        plan = decode_plan.TritonPlan(
            impl, q, k_cache, v_cache, k, v, seqlens, block_table, cache_leftpad, scale, window,
            softcap, alibi_slopes, sinks, num_splits, return_lse, check_values, int_seqlens,
        )  # fmt: skip
    else:
        plan = decode_plan.Plan(impl, window, scale, softcap, num_splits, return_lse,
                                check_values, int_seqlens, Tnew)  # fmt: skip
    decode_plan.PLANS.remember(plan_key, plan)
    return plan(q, k_cache, v_cache, k, v, seqlens, block_table, cache_leftpad, alibi_slopes,
                sinks)  # fmt: skip


CHECK_VALUES_ENV = "FUSEDATTN_CHECK_VALUES"


def values_checked(on_gpu: bool, backend: str, environ=os.environ) -> bool:
    """Whether attention_with_kvcache reads its lengths and block table to the host to check
    them: always on the CPU and in the reference and torch backends (they index with them);
    for the Triton kernels on a GPU only with FUSEDATTN_CHECK_VALUES=1, since the sync would
    stall every decode step and break CUDA-graph capture (the kernels clamp what they read
    to the cache, the block table and the lengths, so bad values give a wrong answer for
    that sequence, never an access outside them)."""
    return not on_gpu or backend != "triton" or environ.get(CHECK_VALUES_ENV, "") == "1"


def _inputs(q, k_cache, v_cache, seqlens_k, block_table, cache_leftpad, key_mask, scale, window,
            softcap, alibi_slopes, sinks, num_splits, return_lse) -> dict:  # fmt: skip
    return dict(
        q=q, k_cache=k_cache, v_cache=v_cache, seqlens_k=seqlens_k, block_table=block_table,
        cache_leftpad=cache_leftpad, key_mask=key_mask, scale=scale, window=window,
        softcap=float(softcap), alibi_slopes=alibi_slopes, sinks=sinks,
        num_splits=int(num_splits), return_lse=return_lse,
    )  # fmt: skip


def decode_with_key_mask(q, k_cache, v_cache, key_mask, *, scale=None, is_causal=False,
                         window_size=None, softcap=0.0, sinks=None, backend="auto"):  # fmt: skip
    """One new query per sequence over a cache whose visible positions a (B, S) bool row
    gives, holes allowed (the last row of Hugging Face's decode-step mask): the keys run from
    the first visible position to the last, the query sits at the last, and the invisible
    positions in between are neither read nor weighed. None: every slot is visible. Internal
    (the Hugging Face integration's); lengths stay on the device (no sync)."""
    B, S = q.shape[0], k_cache.shape[1]
    # lengths derived on the device, valid by construction (an all-hidden row: 0 keys, its
    # leftpad S past them, which every backend reads as no key): no value check, no sync
    if key_mask is None:
        seqlens, leftpad = S, None
    else:
        index = torch.arange(S, device=q.device, dtype=torch.int32)
        seqlens = torch.where(key_mask, index + 1, 0).amax(-1).to(torch.int32)
        leftpad = torch.where(key_mask, index, S).amin(-1).to(torch.int32)
    window, seqlens = check_kvcache_args(
        q, k_cache, v_cache, None, None, seqlens, None, leftpad, scale, is_causal,
        window_size, softcap, None, sinks, 0,
    )  # fmt: skip
    if key_mask is not None and tuple(key_mask.shape) != (B, S):
        raise ValueError(f"key_mask must be (B, S) = ({B}, {S}), got {tuple(key_mask.shape)}")
    inputs = _inputs(q, k_cache, v_cache, seqlens, None, leftpad, key_mask, scale, window,
                     softcap, None, sinks, 0, False)  # fmt: skip
    impl = backends.select("attention_with_kvcache", backend, q.device, inputs)
    if tracing():
        return decode_ops.record(q, k_cache, v_cache, None, None, seqlens, inputs, False,
                                 impl.backend)  # fmt: skip
    return impl.run(**inputs)
