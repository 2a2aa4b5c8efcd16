"""The launch arguments of the Triton attention kernels, built once per call.

`TritonAttentionLaunch` reads sizes, layouts, variant flags and tiles from the custom op's
arguments; each `*_args` method returns (grid, positional args, constexpr keywords) for one
kernel. The custom ops launch with them, and `scripts/static_attention.py` compiles the same
argument lists for sm_90 without a GPU (`config=` there picks the tiles to screen).
"""

from __future__ import annotations

import dataclasses

import torch

from ..core import triton_launch
from ..core.kernels import (
    device_arch,
    dot_flags,
    ensure_scratch_allocator,
    kernels,
    program_budget,
)

# fp16/bf16 backward: query blocks that see at most this many keys take the exact delta
# (attention_bwd_dq's docstring; one or two key tiles on a GPU, not yet timed there)
EXACT_DELTA_KEYS = 128


def valid_key_range(key_padding_mask: torch.Tensor, *, kernel: bool | None = None) -> torch.Tensor:
    """(B, 3) int32 per batch row: [first, end) of the keys that are not padding (end <= first
    when all are), and 1 when every key in that range is real (padding only at the ends), else
    0. The kernels skip the tiles outside the range, and with the flag set read no padding
    mask for the whole tiles inside it. No sync. On a GPU (kernel=None) one Triton launch
    (key_padding_range); on the CPU ten small torch ops, the same values."""
    if kernel if kernel is not None else key_padding_mask.is_cuda:
        return _key_padding_range_kernel(key_padding_mask)
    T = key_padding_mask.shape[1]
    index = torch.arange(T, device=key_padding_mask.device, dtype=torch.int32)
    valid = ~key_padding_mask
    first = torch.where(valid, index, T).amin(-1)
    end = torch.where(valid, index + 1, 0).amax(-1)
    contiguous = valid.sum(-1, dtype=torch.int32) == (end - first).clamp(min=0)
    return torch.stack([first, end, contiguous.to(torch.int32)], dim=-1)  # int32: T fits


def _key_padding_range_kernel(key_padding_mask: torch.Tensor) -> torch.Tensor:
    B, T = key_padding_mask.shape
    kpm = key_padding_mask.contiguous().view(torch.uint8)
    out = torch.empty((B, 3), dtype=torch.int32, device=kpm.device)
    block = min(1024, max(16, 1 << (T - 1).bit_length()))  # 7 specialisations at most
    triton_launch.launch(
        kernels("attention").key_padding_range, (B,), (kpm, out, T, kpm.stride(0)),
        dict(BLOCK=block, num_warps=4),
    )  # fmt: skip
    return out


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


def tma_compatible(*tensors: torch.Tensor) -> bool:
    """Whether a tensor descriptor can describe each (B, H, T, D) tensor as it is: the TMA unit
    needs a 16-byte aligned base, a unit last stride and the other strides in multiples of 16
    bytes (a D of 20 bf16 elements, for one, does not qualify)."""
    for t in tensors:
        size = t.element_size()
        if t.dim() != 4 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any(st * size % 16 for st, n in zip(t.stride()[:3], t.shape[:3], strict=True) if n > 1):
            return False
    return True


def rows_describable(t: torch.Tensor, strides) -> bool:
    """Whether the kernel can make a tensor descriptor over any (head, sequence) of t's rows
    (attention_fwd's WARP_SPEC): a 16-byte aligned base, a unit last stride, and the batch,
    head and row strides it offsets by in multiples of 16 bytes."""
    size = t.element_size()
    return (
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and not any(st * size % 16 for st in strides)
    )


def descriptor(t: torch.Tensor, rows: int, cols: int):
    """A host tensor descriptor over a (B, H, T, D) tensor whose copies move (1, 1, rows, cols)
    blocks, zero-filling past T and D on loads and clipping there on stores."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    # A dim of size 1 may carry any stride; the TMA unit wants each 16-byte aligned.
    strides = [
        st if n > 1 else 16 // t.element_size() for st, n in zip(t.stride(), t.shape, strict=True)
    ]
    strides[-1] = 1
    return TensorDescriptor(t, list(t.shape), strides, [1, 1, rows, cols])


def block_sparse_config(cfg, block_q: int, block_k: int):
    """A dense call's tiles for a block-sparse one: query tiles of at most block_q rows and key
    tiles of at most block_k keys (a tile lies in one block), each kernel's plain loop (the
    pipelined, persistent, warp-specialized and TMA loops have no block-sparse form)."""

    def fit(t):
        return dataclasses.replace(
            t, block_m=min(t.block_m, block_q), block_n=min(t.block_n, block_k), tma=False,
            merge=False, pipeline=False, warp_spec=False, persistent=False,
        )  # fmt: skip

    return dataclasses.replace(cfg, fwd=fit(cfg.fwd), dkdv=fit(cfg.dkdv), dq=fit(cfg.dq))


# the keyword arguments of a block-sparse or score_mod launch that hold this call's tensors
FLEX_KEYWORDS = ("LISTS", "KINDS", "BITS", "MOD_ARGS")


def flex_config(cfg, block_size, with_mod: bool):
    """A GPU call's tiles beside a block mask (block_size: its (BS_Q, BS_K)) or a score_mod:
    every kernel at 0 spills in the sm_90 screen at D = 128 (bf16; scripts/static_attention.py
    variants blocks*, *_bias, *softcap_mod; benchmarks/results/sm90-static/flex.csv), where
    the dense tiles spilled 8-260 B:

    - dK/dV: 32 query rows a tile, 2 stages, boundary loops apart (block-sparse 64x128w8s3:
      220 B of spills, 32x128w8s2: none, 0.94 instead of 1.02 instructions per score); with
      a mod on 128-key tiles 16 rows (32x128w8s2 spilled 8-20 B, 16x128w8s2 none);
    - dQ: a mod's 32 keys a tile (64x64w4s2: 48-284 B, 64x32w4s2: none); tiles of at most
      32 x 32 one stage (32x32w4s2 spilled 12 B, s1 none), 8 warps beside a mod (a learnable
      table's atomics: w4s1 8 B, w8s1 none);
    - forward: a block mask with a mod at 2 stages on 128-row tiles (128x64w8s3: 60-112 B,
      s2: none; the dense forward with a mod spills nothing at 3); tiles of at most 32 x 32
      on 4 warps (32x32w8s3 with a softcap mod: 28 B at ptxas' 128 registers; w4: none, and
      1.6 instead of 2.6 instructions per score without a mod; 16x16 stays at 8: w4 spilled
      8-24 B).

    The interpreter's tiles (on_gpu False in attention_config) are left as they are."""
    fwd, dkdv, dq = cfg.fwd, cfg.dkdv, cfg.dq
    sparse = block_size is not None
    if sparse or with_mod:
        rows = 16 if with_mod and dkdv.block_n >= 128 else 32
        if sparse:
            rows = min(rows, block_size[0])
        dkdv = dataclasses.replace(dkdv, block_m=min(dkdv.block_m, rows), num_stages=2,
                                   merge=False, pipeline=False)  # fmt: skip
    if with_mod:
        dq = dataclasses.replace(dq, block_n=min(dq.block_n, 32))
        if sparse and fwd.block_m >= 128:
            fwd = dataclasses.replace(fwd, num_stages=min(fwd.num_stages, 2))
    if fwd.block_m == 32 and fwd.block_n <= 32:
        fwd = dataclasses.replace(fwd, num_warps=4)
    if dq.block_m * dq.block_n <= 32 * 32:
        dq = dataclasses.replace(dq, num_stages=1, num_warps=8 if with_mod else dq.num_warps)
    return dataclasses.replace(cfg, fwd=fwd, dkdv=dkdv, dq=dq)


class TritonAttentionLaunch:
    """What every kernel of one attention call shares."""

    def __init__(
        self, q, k, v, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q,
        cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_left, window_right, bottom_right,
        scale, softcap, dropout_p, seed, *, config=None, interpreted=None, planned=False,
        descales=None, block=None, mod=None,
    ):  # fmt: skip
        # planned: a template a plan keeps for every call of its metadata (bind() gives each
        # call's launch); each kernel's launcher is bound at its first launch and shared
        self.prepared = {} if planned else None
        self.use_tma = {}
        self.varlen = cu_seqlens_q is not None
        if self.varlen:
            self.B = cu_seqlens_q.shape[0] - 1
            self.H, self.D = q.shape[1], q.shape[2]
            self.Hkv, self.Dv = k.shape[1], v.shape[-1]
            self.Tq, self.Tk = max_seqlen_q, max_seqlen_k
            self.lse_shape = (self.H, q.shape[0])
            self.lse_strides = (0, q.shape[0])
            self.mask, self.kpm, self.mask_strides = None, None, (0,) * 5
            mask_flags = dict(HAS_MASK=False, MASK_IS_BOOL=False, HAS_KPM=False)
        else:
            self.B, self.H, self.Tq, self.D = q.shape
            self.Hkv, self.Tk, self.Dv = k.shape[1], k.shape[2], v.shape[-1]
            self.lse_shape = (self.B, self.H, self.Tq)
            self.lse_strides = (self.H * self.Tq, self.Tq)
            self.mask, self.kpm, self.mask_strides, mask_flags = _mask_args(
                q, k, attn_mask, key_padding_mask
            )
        self.kv_range = (
            None if self.kpm is None or self.kpm.numel() == 0 else valid_key_range(self.kpm)
        )
        self.slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
        self.sinks = None if sinks is None else sinks.contiguous()
        self.cu_q, self.cu_k, self.seed = cu_seqlens_q, cu_seqlens_k, seed
        self.scalars = (scale, softcap, window_left, window_right, dropout_p)
        # fp8 (q, k, v in float8_e4m3fn): the descales, one value per (sequence, kv head) or
        # one for all (strides 0), folded into the scores' scale and the output by the kernel
        self.descales = (None, None, None) if descales is None else tuple(descales)
        self.descale_strides = tuple(
            stride for d in self.descales
            for stride in ((0, 0) if d is None or d.numel() == 1 else d.stride())
        )  # fmt: skip
        interpreted = not q.is_cuda if interpreted is None else interpreted
        flags = dot_flags(q)
        self.ieee_fp32 = q.dtype == torch.float32 and flags["PRECISION"] == "ieee"
        self.half = q.dtype in (torch.float16, torch.bfloat16)
        if not interpreted:
            flags["DOT_IN_FP32"] = False
        self.flags = dict(
            HAS_LEFT=window_left >= 0, HAS_RIGHT=window_right >= 0, BOTTOM_RIGHT=bottom_right,
            SOFTCAP=softcap > 0.0, HAS_ALIBI=alibi_slopes is not None, VARLEN=self.varlen,
            DROPOUT=dropout_p > 0.0, INTERPRETED=interpreted, **flags, **mask_flags,
        )  # fmt: skip
        self.alibi_stride = 0 if self.slopes is None or self.slopes.dim() == 1 else self.H
        self.K = kernels("attention")
        self.cfg = config or self.K.attention_config(
            self.D, self.Dv, q.is_cuda, ieee_fp32=flags["PRECISION"] == "ieee",
            elem_bytes=q.element_size(), arch=device_arch(q.device),
            alibi_or_varlen=alibi_slopes is not None or self.varlen,
        )  # fmt: skip
        self.block = block
        # a block mask or a score_mod: their tensors ride in keywords (FLEX_KEYWORDS), each
        # call's own; a plan's bound launches are given them per call (bind, run)
        self.flex = block is not None or mod is not None
        if block is not None:
            self.cfg = block_sparse_config(self.cfg, *block.block_size)
        # a score_mod (fusedattn.score_mod.ScoreMod): its functions for each kernel, and the
        # float32 gradient buffers of its captures that want one (the backward sets them)
        self.mod = mod
        self.mod_grads = None
        self.mod_values = None  # the captures' kernel argument without gradients, made once
        if mod is not None and self.cfg.fwd.warp_spec:  # its loads go through pointers
            self.cfg = dataclasses.replace(
                self.cfg, fwd=dataclasses.replace(self.cfg.fwd, warp_spec=False)
            )
        if (block is not None or mod is not None) and config is None and not interpreted:
            self.cfg = flex_config(self.cfg, None if block is None else block.block_size,
                                   mod is not None)  # fmt: skip

    def mod_args(self, kernel: str) -> dict:
        """The score_mod's kernel keywords ({} without one): its value function everywhere,
        its derivative in the backward (in dq the one that also adds the captures'
        gradients into mod_grads), its captures' tensors, sizes and strides."""
        mod = self.mod
        if mod is None:
            return {}
        interpreted = self.flags["INTERPRETED"]
        extents = (self.B, self.H, self.Tq, self.Tk)  # loads proven inside their tensor
        fast = self.flags["PRECISION"] != "ieee"  # tanh as the built-in softcap's
        plain = mod.functions(interpreted, (False,) * len(mod.tensors), extents, fast)
        args = dict(SCORE_MOD=plain.score_mod, MOD_ARGS=mod.arguments())
        if kernel == "dkdv":
            args["SCORE_MOD_GRAD"] = plain.score_mod_dscore
        elif kernel == "dq":
            grads = self.mod_grads or [None] * len(mod.tensors)
            wanted = tuple(g is not None for g in grads)
            if any(wanted):
                args["SCORE_MOD_GRAD"] = mod.functions(
                    interpreted, wanted, extents, fast
                ).score_mod_grad
                args["MOD_ARGS"] = mod.arguments(grads)
            else:
                args["SCORE_MOD_GRAD"] = plain.score_mod_dscore
        return args

    def block_args(self, orientation: str) -> dict:
        """The block mask's lists for one kernel ("kv": the forward and dq walk key blocks per
        query block; "q": dk/dv walk query blocks per key block), as kernel keywords; {} for a
        dense call."""
        bm = self.block
        if bm is None:
            return {}
        lists, kinds = (
            (bm.kv_lists, bm.kv_kinds) if orientation == "kv" else (bm.q_lists, bm.q_kinds)
        )
        s_b, s_h, s_r, _ = lists.stride()
        scale, softcap = self.scalars[0], self.scalars[1]
        return dict(
            BLOCK_SPARSE=True, LISTS=lists, KINDS=kinds, BITS=bm.bits,
            sl_b=s_b if lists.shape[0] > 1 else 0, sl_h=s_h if lists.shape[1] > 1 else 0,
            sl_r=s_r, BS_Q=bm.block_size[0], BS_K=bm.block_size[1],
            BITS_IN_DOT=softcap == 0.0 and scale != 0.0 and self.mod is None,
        )  # fmt: skip

    def tiles(self, kernel: str) -> dict:
        t = getattr(self.cfg, kernel)
        return dict(
            BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_D=self.cfg.block_d,
            BLOCK_DV=self.cfg.block_dv, num_warps=t.num_warps, num_stages=t.num_stages,
        )  # fmt: skip

    def query_blocks(self, kernel: str) -> int:
        return -(-self.Tq // getattr(self.cfg, kernel).block_m)

    def key_blocks(self, kernel: str) -> int:
        return -(-self.Tk // getattr(self.cfg, kernel).block_n)

    def strides(self, t) -> tuple[int, int, int]:
        """(batch, head, row) strides: (B, H, T, D) tensors as they are, packed (total, H, D)
        ones with batch stride 0 (each sequence's first row comes from cu_seqlens). 16 calls
        per forward+backward: one call deep on purpose (host time, bench_host.py)."""
        return (0, t.stride(1), t.stride(0)) if self.varlen else t.stride()[:3]

    @staticmethod
    def launch(kernel, grid, args, constexprs):
        if grid[0]:
            triton_launch.launch(kernel, grid, args, constexprs)

    def bind(self, attn_mask, key_padding_mask, alibi_slopes, sinks, cu_seqlens_q, cu_seqlens_k,
             seed, block=None, mod=None):  # fmt: skip
        """This template's launch for one call's tensors: the metadata's decisions kept, the
        tensor-derived arguments (mask view, key range, parameters, seed; a block mask's
        KernelBlocks and a score_mod, whose metadata the plan's key fixed) made anew, the
        bound launchers shared. With none of those the template itself serves the call (its
        own are None too: it was built from a call of this key)."""
        if (block is not None or mod is not None) != self.flex:
            raise AssertionError("a flex template is bound with a block mask or a score_mod, "
                                 "a dense one with neither")  # fmt: skip
        unmasked = (  # the template's own are None too (a None is in the plan's key)
            attn_mask is None and key_padding_mask is None and alibi_slopes is None
            and sinks is None and cu_seqlens_q is None and seed is None
        )  # fmt: skip
        if unmasked and not self.flex:
            return self
        launch = object.__new__(type(self))  # copy.copy's result, 3 µs sooner
        launch.__dict__ = self.__dict__.copy()  # (0.4 µs; an update of the new dict: 0.9)
        launch.block, launch.mod, launch.mod_grads, launch.mod_values = block, mod, None, None
        if unmasked:
            return launch
        if not self.varlen:
            q_shape = (self.B, self.H, self.Tq)
            launch.mask = None if attn_mask is None else attn_mask.expand(*q_shape, self.Tk)
            launch.kpm = None if key_padding_mask is None else key_padding_mask.contiguous()
            launch.kv_range = (
                None if launch.kpm is None or launch.kpm.numel() == 0
                else valid_key_range(launch.kpm)
            )  # fmt: skip
        launch.slopes = None if alibi_slopes is None else alibi_slopes.contiguous()
        launch.sinks = None if sinks is None else sinks.contiguous()
        launch.cu_q, launch.cu_k, launch.seed = cu_seqlens_q, cu_seqlens_k, seed
        return launch

    def run(self, name, kernel, make, tensors, *operands) -> None:
        """Launch `kernel` for these operands: make(*operands) gives (grid, args, constexprs);
        a planned launch after the first calls its bound launcher with tensors(*operands),
        the tensor arguments alone (the rest is the metadata's, the same every call), and a
        flex call's per-call keywords (flex_values)."""
        prepared = None if self.prepared is None else self.prepared.get(name)
        if prepared is not None:
            if self.flex:
                values = self.flex_values(name if type(name) is str else name[0])
                prepared.with_values(tensors(*operands), values)
            else:
                prepared(*tensors(*operands))
            return
        grid, args, constexprs = make(*operands)
        if not grid[0]:
            return
        per_call = None
        if self.flex:  # tensors among the keywords (a block mask's lists, a mod's captures):
            # each call's, keyed by what Triton specialises them on (triton_launch.launch)
            per_call = {k: constexprs.pop(k) for k in FLEX_KEYWORDS if k in constexprs}
        if self.prepared is None:
            triton_launch.launch(kernel, grid, args, constexprs, per_call)
        else:
            self.prepared[name] = triton_launch.prepare(kernel, grid, args, constexprs, per_call)

    def flex_values(self, kernel: str) -> tuple:
        """The per-call keywords of a block-sparse or score_mod launch for kernel "fwd", "dq"
        or "dkdv", in FLEX_KEYWORDS order (the order `run` prepared them in): the call's
        lists in the kernel's orientation, the mod's captures (in dq with the gradient
        buffers the backward set)."""
        bm, mod = self.block, self.mod
        if bm is None:
            values = ()
        elif kernel == "dkdv":
            values = (bm.q_lists, bm.q_kinds, bm.bits)
        else:
            values = (bm.kv_lists, bm.kv_kinds, bm.bits)
        if mod is not None:
            if kernel == "dq" and self.mod_grads is not None:
                values += (mod.arguments(self.mod_grads),)
            else:  # the same tuple for the forward, dK/dV and a dQ without gradients
                if self.mod_values is None:
                    self.mod_values = mod.arguments()
                values += (self.mod_values,)
        return values

    def fwd_tensors(self, q, k, v, out, lse):
        use_tma = self.use_tma.get("fwd")
        if use_tma is None:
            t = self.cfg.fwd
            # 2-byte dtypes only: fp32 tiles spilled 3-54 KB through descriptors on sm_90
            # (Triton 3.6), and fp32 is not where a speed user is
            use_tma = t.tma and not self.varlen and q.element_size() == 2
            use_tma = self.use_tma["fwd"] = use_tma and tma_compatible(q, k, v, out)
        if use_tma:
            t, bd, bdv = self.cfg.fwd, self.cfg.block_d, self.cfg.block_dv
            q, out = descriptor(q, t.block_m, bd), descriptor(out, t.block_m, bdv)
            k, v = descriptor(k, t.block_n, bd), descriptor(v, t.block_n, bdv)
        return (q, k, v, out, lse, self.mask, self.kpm, self.kv_range, self.seed, self.slopes,
                self.sinks, self.cu_q, self.cu_k, *self.descales)  # fmt: skip

    def warp_spec(self, q, k, v) -> bool:
        """Whether this call's forward runs warp-specialized (its tiles ask for it): inputs
        whose rows the kernel can describe, 2-byte ones on a GPU (fp32 tiles spilled through
        descriptors on sm_90; the interpreter takes any, so fp32 tests run the descriptor
        path exactly); on a GPU the scratch allocator set. Not with an attn_mask, key padding
        or dropout: Triton 3.6's pass fails on a key loop that loads through pointers (the
        mask at both screened tiles, the padding at 128x128; dropout unscreened), so those
        keep the plain loop (benchmarks/results/sm90-static/README.md)."""
        use = self.use_tma.get("warp_spec")
        if use is None:
            use = (
                (q.element_size() == 2 or not q.is_cuda)
                and self.mask is None and self.kpm is None and self.scalars[4] == 0.0
                and all(rows_describable(t, self.strides(t)) for t in (q, k, v))
            )  # fmt: skip
            self.use_tma["warp_spec"] = use
        if use and q.is_cuda:
            ensure_scratch_allocator()
        return use

    def fwd_args(self, q, k, v, out, lse):
        strides = (*self.strides(q), *self.strides(k), *self.strides(v), *self.strides(out))
        tensors = self.fwd_tensors(q, k, v, out, lse)
        tiles = self.B * self.H * self.query_blocks("fwd")
        use_tma = self.use_tma["fwd"]
        args = (
            *tensors, *strides, *self.lse_strides, *self.mask_strides,
            self.alibi_stride, self.H, self.Tq, self.Tk, self.D, self.Dv, self.H // self.Hkv,
            self.query_blocks("fwd"), tiles, *self.scalars, *self.descale_strides,
        )  # fmt: skip
        constexprs = dict(
            HAS_SINKS=self.sinks is not None, USE_TMA=use_tma, **self.flags, **self.tiles("fwd")
        )
        if self.descales[0] is not None:
            constexprs["FP8"] = True
        if self.cfg.fwd.pipeline:
            constexprs["PIPELINE"] = True
        if self.cfg.fwd.warp_spec and self.warp_spec(q, k, v):
            constexprs["WARP_SPEC"] = True
        scale, softcap = self.scalars[0], self.scalars[1]
        if self.mask is not None and softcap == 0.0 and scale != 0.0 and self.mod is None:
            constexprs["MASK_IN_DOT"] = True  # the mask as the dot's accumulator (_fwd_scores)
        constexprs.update(self.block_args("kv"))
        constexprs.update(self.mod_args("fwd"))
        if self.cfg.fwd.persistent:  # one program per multiprocessor (4 in the interpreter)
            constexprs["PERSISTENT"] = True
            return (min(tiles, program_budget(q.device)),), args, constexprs
        return (tiles,), args, constexprs

    def dkdv_tensors(self, q, k, v, do, lse, delta, dk, dv):
        return (q, k, v, do, lse, delta, dk, dv, self.mask, self.kpm, self.kv_range, self.seed,
                self.slopes, self.cu_q, self.cu_k)  # fmt: skip

    def dkdv_args(self, q, k, v, do, lse, delta, dk, dv):
        args = (
            *self.dkdv_tensors(q, k, v, do, lse, delta, dk, dv),
            *self.strides(q), *self.strides(k), *self.strides(v),
            *self.strides(do), *self.strides(dk), *self.strides(dv), *self.lse_strides,
            *self.mask_strides, self.alibi_stride, self.H, self.Hkv, self.Tq, self.Tk, self.D,
            self.Dv, self.H // self.Hkv, self.key_blocks("dkdv"), *self.scalars,
        )  # fmt: skip
        grid = (self.B * self.Hkv * self.key_blocks("dkdv"),)
        merge = dict(MERGE_BOUNDARIES=True) if self.cfg.dkdv.merge else {}
        if self.cfg.dkdv.pipeline:
            merge["PIPELINE"] = True
        return grid, args, dict(**self.flags, **self.tiles("dkdv"), **merge,
                                **self.block_args("q"), **self.mod_args("dkdv"))  # fmt: skip

    def dq_tensors(self, q, k, v, out, do, lse, delta, dq, dmask, mask_grad=None,
                   exact_delta=None, dlse=None):  # fmt: skip
        """dlse: the lse's gradient (laid out as lse), None where the loss does not read it."""
        return (q, k, v, out, do, lse, delta, dq, dmask, self.mask, self.kpm, self.kv_range,
                self.seed, self.slopes, self.sinks, self.cu_q, self.cu_k, dlse)  # fmt: skip

    def dq_args(self, q, k, v, out, do, lse, delta, dq, dmask, mask_grad, exact_delta=None,
                dlse=None):  # fmt: skip
        args = (
            *self.dq_tensors(q, k, v, out, do, lse, delta, dq, dmask, dlse=dlse),
            *self.strides(q), *self.strides(k), *self.strides(v),
            *self.strides(out), *self.strides(do), *self.strides(dq), *self.lse_strides,
            *self.mask_strides,
            self.alibi_stride, self.H, self.Tq, self.Tk, self.D, self.Dv, self.H // self.Hkv,
            self.query_blocks("dq"), *self.scalars,
        )  # fmt: skip
        # the exact delta (attention_bwd_dq) where the output's rounding would show: a float
        # mask's gradient, and fp32 without TF32 (not a speed path: its dots run on FMA units);
        # exact_delta=False: the caller's out is a whole row's and these keys a block of it
        given = exact_delta
        if exact_delta is None:
            exact_delta = mask_grad or self.ieee_fp32
        constexprs = dict(
            MASK_GRAD=mask_grad, HAS_SINKS=self.sinks is not None, EXACT_DELTA=exact_delta,
            **self.flags, **self.tiles("dq"),
        )  # fmt: skip
        if dlse is not None:
            constexprs["HAS_DLSE"] = True
        if given is None and not exact_delta and self.half:  # not for CP's blocks (given)
            constexprs["EXACT_DELTA_KEYS"] = EXACT_DELTA_KEYS
        if self.cfg.dq.pipeline:
            constexprs["PIPELINE"] = True
        constexprs.update(self.block_args("kv"))
        constexprs.update(self.mod_args("dq"))
        return (self.B * self.H * self.query_blocks("dq"),), args, constexprs
