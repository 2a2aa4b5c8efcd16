"""The Triton attention kernels' tiles (triton_kernels/attention.py): `Tiles` per kernel,
`AttentionConfig` per call, and `attention_config`, which picks them from the head dims, the
dtype and the card (a tuning run's winners from attention_tiles.py where measured).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

import triton

from . import attention_tiles


@dataclass(frozen=True)
class Tiles:
    """One kernel's tiling: query rows and keys per tile, warps, pipeline stages; tma: read
    and write the (B, H, T, D) tensors through host-built tensor descriptors (the forward only;
    Hopper's TMA copies, no per-element address arithmetic) where their layout allows it;
    merge: run both boundary ranges of query tiles in one loop (dK/dV only): on sm_90, Triton
    3.6 waits on every wgmma when the kernel has three loops (causal, windows, ALiBi: 24
    warpgroup arrive/wait pairs per iteration against 4), but the merged loop spills in some
    variants (benchmarks/results/sm90-static/); attention_config turns it on where the H100
    timed it faster; pipeline: the forward's interior loop runs each tile's softmax while the
    tensor cores work on the neighbouring tiles' products (_fwd_tiles; forward only);
    warp_spec: the forward's interior loop warp-specialized by Triton's Hopper pass
    (`tl.range(warp_specialize=True)`: producer warps issue the K/V copies through tensor
    descriptors made in the kernel, consumer warpgroups compute), which Triton 3.6 applies
    with 4 warps only (attention_fwd's WARP_SPEC); persistent: the forward on about one
    program per multiprocessor, each looping over query blocks, the longest first under
    causal (attention_fwd's PERSISTENT; forward only).

    Written as BMxBNwWARPSsSTAGES plus a flag letter each for tma (t), merge (m), pipeline (p),
    warp_spec (w) and persistent (r, resident), as the tuning and screening scripts take them:
    `Tiles.parse("128x64w8s3pr")`, `.spec`."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: bool = False
    merge: bool = False
    pipeline: bool = False
    warp_spec: bool = False
    persistent: bool = False

    @property
    def spec(self) -> str:
        flags = "t" * self.tma + "m" * self.merge + "p" * self.pipeline + "w" * self.warp_spec
        flags += "r" * self.persistent
        return f"{self.block_m}x{self.block_n}w{self.num_warps}s{self.num_stages}{flags}"

    @classmethod
    def parse(cls, spec: str, kernel: str | None = None) -> Tiles:
        """The tiles a spec names; ValueError for a malformed one, or (given the kernel: fwd,
        dkdv or dq) a flag that kernel does not have."""
        m = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(t?)(m?)(p?)(w?)(r?)", spec)
        if not m:
            raise ValueError(f"tiles look like 128x64w8s3 plus flags t, m, p, w, r; got {spec!r}")
        tiles = cls(*(int(g) for g in m.groups()[:4]), *(bool(g) for g in m.groups()[4:]))
        allowed = {"fwd": "tpwr", "dkdv": "mp", "dq": "p"}.get(kernel, "tmpwr")
        if tiles.warp_spec and (tiles.tma or tiles.pipeline or tiles.num_warps != 4):
            raise ValueError(
                "warp-specialized tiles (w) take 4 warps, their own in-kernel "
                f"descriptors (no t) and Triton's schedule (no p): {spec!r}"
            )
        if set(spec[m.end(4) :]) - set(allowed):
            raise ValueError(f"{kernel} tiles take the flags {allowed or 'none'!r}: {spec!r}")
        return tiles


@dataclass(frozen=True)
class AttentionConfig:
    """Head-dim blocks (powers of two, masked past D/Dv) and each kernel's tiles: forward,
    dk/dv (a key block against query tiles), dq (a query block against key tiles)."""

    block_d: int
    block_dv: int
    fwd: Tiles
    dkdv: Tiles
    dq: Tiles


# Cards with the ~227 KB of shared memory per block the Hopper tiles need (sm_90 H100/H200,
# sm_100/103 B200/B300); sm_120's 99 KB, like sm_86/89's, does not hold them.
HOPPER_SMEM_ARCHS = frozenset({90, 100, 103})


@functools.lru_cache(maxsize=256)
def attention_config(
    D: int,
    Dv: int,
    on_gpu: bool,
    ieee_fp32: bool = False,
    elem_bytes: int = 2,
    arch: int = 0,
    alibi_or_varlen: bool = False,
) -> AttentionConfig:
    """Tiles for head dims D/Dv (pure; tested). On the CPU interpreter small tiles keep tests
    fast and cross several blocks. elem_bytes: q's element size; arch: the GPU's compute
    capability as 10 * major + minor (0: unknown).
    - Hopper-class cards (HOPPER_SMEM_ARCHS), 2-byte dtypes (and fp8, untimed: the same tiles
      with half the shared memory), padded head dims 64-128: the tiles
      scripts/tune_triton_attention.py measured fastest (H100, Triton 3.6, B=4 H=16 T=4096,
      benchmarks/results/h100/tune_triton_attention.csv): forward 128x64 / 8 warps / 3 stages
      (1.10-1.18x the 64x64 tiles at D=128 and 64, causal or not); dq the same at D<=64
      (1.06-1.11x; at D=128 64x64 stays: 128x64 ran 0.97x); dk/dv 64(q)x128(k) / 8 warps /
      3 stages at D=128 (1.04-1.08x; at D=64 it ran 0.94x). Their shared memory (up to 160 KB)
      needs Hopper's 227 KB, which sm_80's 164 KB holds only in part and sm_86/89's 99 KB not.
      dk/dv merges its boundary loops (Tiles.merge; second H100 run, same file): causal
      1.14x at D=128 and 1.20x at D=64, unmasked 0.996x and 1.007x. At D=128 the sm_90 screen
      showed ALiBi's and varlen's merged loops spilling 2-3x the causal one's bytes (276 and
      396 B against 140); untimed, they keep three loops (alibi_or_varlen).
    - A card with tuned tiles in attention_tiles.TABLE (scripts/build_tile_table.py from a
      tuning run) takes them for 2-byte inputs, per head-dim block and kernel, over the
      above (a merged dk/dv loop still not for ALiBi or varlen).
    - Otherwise 64x64, 4 warps, 2 stages (32-wide key tiles past D=128 to stay in registers).
    - ieee_fp32 (fp32 inputs with TF32 off: the dots run on FMA units, operands in registers):
      32x16 tiles; at 64x64 the D=128 kernels spilled 55-135 KB per thread on sm_90 (Triton
      3.6), at 32x16 the forward and dq none and dk/dv 1.3 KB."""
    # An 8-bit dot takes K >= 32 on the GPU (Triton 3.6 asserts it; the interpreter does not):
    # fp8 q·kᵀ pads its head dim to 32, masked like any other padding (H200: fp8 at D=16 failed
    # to compile). P·V's K is BLOCK_N, 32 or more in every tile below.
    bd = max(16 if elem_bytes > 1 else 32, triton.next_power_of_2(D))
    bdv = max(16, triton.next_power_of_2(Dv))
    if not on_gpu:
        cpu = Tiles(32, 32, 1, 1)
        return AttentionConfig(bd, bdv, cpu, cpu, cpu)
    if ieee_fp32:
        fp32 = Tiles(32, 16, 4, 2)
        return AttentionConfig(bd, bdv, fp32, fp32, fp32)
    widest = max(bd, bdv)
    block_n = 64 if widest <= 128 else 32
    gpu = Tiles(64, block_n, 4, 2)
    if min(bd, bdv) == 16:
        # ptxas (Triton 3.6, sm_90a) segfaulted compiling the varlen forward at head dim 16
        # with 2 stages (test_tma_forward_leaves_varlen_on_pointers on the H100; reproduced
        # by the sm_90 static screen, which compiles it at 1 stage, and the dense forward and
        # the backward kernels at 2). 16-wide tiles are 2 KB: the pipeline buys little there.
        return AttentionConfig(bd, bdv, fwd=Tiles(64, block_n, 4, 1), dkdv=gpu, dq=gpu)
    if arch not in HOPPER_SMEM_ARCHS or elem_bytes not in (1, 2) or not 64 <= widest <= 128:
        return AttentionConfig(bd, bdv, gpu, gpu, gpu)
    wide = Tiles(128, 64, 8, 3)
    if widest == 128:
        dkdv = Tiles(64, 128, 8, 3, merge=not alibi_or_varlen)
    else:
        dkdv = replace(gpu, merge=True)
    cfg = AttentionConfig(bd, bdv, fwd=wide, dkdv=dkdv, dq=wide if widest <= 64 else gpu)
    measured = attention_tiles.TABLE.get(arch, {}).get(widest) if elem_bytes == 2 else None
    for kernel, spec in (measured or {}).items():  # a tuning run's winners (attention_tiles.py)
        tiles = Tiles.parse(spec, kernel)
        if tiles.merge and alibi_or_varlen:  # spilled on the sm_90 screen (above)
            tiles = replace(tiles, merge=False)
        if tiles.persistent and alibi_or_varlen:  # varlen's spilled 8 B at D=128 (screen)
            tiles = replace(tiles, persistent=False)
        cfg = replace(cfg, **{kernel: tiles})
    return cfg
