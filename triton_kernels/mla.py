"""Multi-head latent attention (MLA, DeepSeek-V2/V3) decoding over a latent KV cache in Triton:
split-key decoding with one KV head whose row is the latent (the first Dv columns) and the
rope part (the Dr columns after it).

One program per (sequence, query block, key split). Its M dimension packs every (query, head)
row of the sequence, row r being query r // Hq of head r % Hq, as the GQA decode packs a group
(one KV head for all Hq heads: each latent tile is read from memory once per query block).
Each key tile is loaded once and serves both products: its first Dv columns (the latent, BLOCK_V
wide) are K's first part and all of V, its rope columns (BLOCK_R) K's second part:

    s = q[:, :Dv] · c[:, :Dv]ᵀ + q[:, Dv:] · c[:, Dv:]ᵀ,   acc += p · c[:, :Dv]

Sequence b's keys are cache positions [0, L_b), L_b = SEQLENS[b]; query i of Tq sits at L_b -
Tq + i (bottom-right, MTP and speculative verification) for is_causal. A paged cache is read
through BLOCK_TABLE one key row at a time (any page size from 1; an entry outside the cache
clamped into it), keys at or past L_b never loaded (a NaN in an unused slot never reaches the
output). With one split the program writes OUT and LSE; with several, fp32 partials that the
decode kernels' `decode_combine` (decode.py, Hkv = 1, group = Hq) merges in a fixed order.

CACHE_FP8 (1 e4m3, 2 e5m2; the cache passed as its bytes): one per-tensor descale folded into
the scale and the output, as vLLM's fp8 MLA cache; 3: DeepSeek's 656-byte rows (uint8: 512
e4m3 latent bytes, 4 float32 scales, one per 128 values, 64 bfloat16 rope values; the
kernel's row strides in bytes), each tile dequantized in registers with its groups' scales. INVARIANT_SPLIT (fusedattn.batch_invariant):
tiles and splits at fixed key positions from key 0, as attention_decode's.

SPARSE (DeepSeek sparse attention): query i of sequence b attends to the keys INDICES[b, i]
lists (topk entries, -1 and anything outside the cache skipped; duplicates already removed by
the caller): a program per (sequence, query, head block, split) walks tiles of those entries,
each key row gathered once for K and V. An entry is a paged cache's slot (page x PAGE_SIZE +
offset, the page as the cache numbers it: no block table) or a contiguous cache's position in
row b (also what is_causal compares with the query's position).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl

from .attention_loops import _dot
from .fp8 import fp8_to_float


@dataclass(frozen=True)
class MLAConfig:
    block_m: int  # (query, head) rows per program
    block_n: int  # keys per tile
    block_v: int  # the latent columns (Dv), a power of two
    block_r: int  # the rope columns (Dr), a power of two (16 at least)
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=64)
def mla_config(rows: int, Dv: int, Dr: int, on_gpu: bool, fp8: bool = False,
               ds656: bool = False) -> MLAConfig:  # fmt: skip
    """Tiles for Hq * Tq rows and Dv + Dr columns (pure; tested). From the sm_90 screen at
    DeepSeek's 512 + 64 (scripts/static_mla.py, benchmarks/results/sm90-static/mla.csv): the
    accumulator is BLOCK_M x BLOCK_V fp32, so 64 rows take 8 warps (128 registers a thread
    for it); 64 x 32 with 8 warps compiles to wgmma with no spills (234 registers, 896 SASS
    instructions per key tile: 0.44 per row x key) and serves 64 rows and more (Hq = 128, or
    MTP); below 64 rows, and over an fp8 cache (64 x 32 spilled 256 B there), 32 x 32 with 8
    warps (mma.sync, 186 registers bf16 / 232 fp8, no spills, 775 instructions a tile: fewer
    than 16 x 32 with 4 warps' 962 even with half its rows idle at Hq = 16); 16 x 64 spilled.
    Two stages. Untimed (the `mla` preset of scripts/gpu_check.sh decides). The interpreter
    takes 16 x 16 tiles so tests cross tiles, pages and splits at small sizes."""
    block_v = max(16, triton.next_power_of_2(Dv))
    block_r = max(16, triton.next_power_of_2(max(Dr, 1)))
    if not on_gpu:
        return MLAConfig(16, 16, block_v, block_r, 1, 1)
    if ds656:  # DeepSeek's 656-byte rows: the group scales' reshape spilled 452-744 B at 32 rows
        return MLAConfig(16, 32, block_v, block_r, 4, 2)  # 0 spills, 1399 instructions a tile
    if rows >= 64 and not fp8:
        return MLAConfig(64, 32, block_v, block_r, 8, 2)
    return MLAConfig(32, 32, block_v, block_r, 8, 2)


@triton.jit
def mla_decode(
    Q, Q_PE, KV, OUT, LSE, PART_O, PART_LSE, SEQLENS, BLOCK_TABLE, SINKS, KV_DESCALE, INDICES,
    sq_b, sq_t, sq_h, sqp_b, sqp_t, sqp_h, skv_b, skv_t, so_b, so_t, so_h, sl_b, sl_h, sbt_b,
    Tq, Hq, Dv, Dr, num_m_blocks, num_splits, scale, capacity, num_rows, si_b, si_t, topk,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_SINKS: tl.constexpr, SPLIT: tl.constexpr, HAS_ROPE: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr,
    CACHE_FP8: tl.constexpr = 0, INVARIANT_SPLIT: tl.constexpr = 0, SPARSE: tl.constexpr = False,
):  # fmt: skip
    """One (sequence b, query block, key split) program. Q (B, Tq, Hq, Dv) and Q_PE (B, Tq, Hq,
    Dr) by their strides (the two parts of one q tensor, or q_nope and q_pe); KV (sequence or
    page, position or slot, Dv + Dr) with a unit last stride; OUT (B, Tq, Hq, Dv), LSE (B, Hq,
    Tq) (strides sl_b, sl_h, 1); PART_O (B, num_splits, Hq * Tq, Dv) and PART_LSE (B,
    num_splits, Hq * Tq) fp32 when SPLIT (decode_combine's layout with Hkv = 1). Whatever the
    lengths and the block table hold, nothing outside the cache, the table or the lengths is
    read: L_b is clamped to [0, capacity], an entry to [0, num_rows)."""
    pid = tl.program_id(0)
    split = pid % num_splits
    rest = pid // num_splits
    m_blk = rest % num_m_blocks
    n_rows = Hq * Tq
    if SPARSE:  # one query's heads: each query has keys of its own (INDICES[b, query])
        bq = rest // num_m_blocks
        b = (bq // Tq).to(tl.int64)
        query = bq % Tq
        h = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = h < Hq
        qi = query + 0 * h
        rows = qi * Hq + h  # the packed row numbering of the partials
    else:
        b = (rest // num_m_blocks).to(tl.int64)
        rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        qi = rows // Hq
        h = rows % Hq
    v = tl.arange(0, BLOCK_V)
    r = tl.arange(0, BLOCK_R)
    q_row = qi.to(tl.int64)
    q = tl.load(Q + b * sq_b + q_row[:, None] * sq_t + h[:, None] * sq_h + v[None, :],
                mask=row_ok[:, None] & (v < Dv)[None, :], other=0.0)  # fmt: skip
    if HAS_ROPE:
        q_pe = tl.load(Q_PE + b * sqp_b + q_row[:, None] * sqp_t + h[:, None] * sqp_h + r[None, :],
                       mask=row_ok[:, None] & (r < Dr)[None, :], other=0.0)  # fmt: skip
    v_scale = 1.0
    if CACHE_FP8 == 1 or CACHE_FP8 == 2:  # stored x descale: into the scores' scale and output
        descale = tl.load(KV_DESCALE)
        scale = scale * descale
        v_scale = descale
    seq_end = tl.minimum(tl.maximum(tl.load(SEQLENS + b), 0), capacity)
    pos = seq_end - Tq + qi  # each row's key position (bottom-right)
    hi = seq_end
    if SPARSE:  # tiles over the query's index entries
        hi = topk
    if INVARIANT_SPLIT:  # tiles from key 0, splits at fixed tiles
        n_all = tl.cdiv(hi, BLOCK_N)
        tile_lo = split * INVARIANT_SPLIT
        tile_hi = tl.minimum(tile_lo + INVARIANT_SPLIT, n_all)
    else:
        n_tiles = tl.cdiv(hi, BLOCK_N)
        per_split = tl.cdiv(n_tiles, num_splits)
        tile_lo = split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, n_tiles)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS and not SPLIT:  # the sink joins the normaliser (one logit of value 0)
        m_i = (
            tl.load(SINKS + h, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        )
        l_i = tl.where(row_ok, 1.0, 0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_V], dtype=tl.float32)
    for tile in range(tile_lo, tile_hi):
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        if SPARSE:  # the listed keys: a paged cache's slot, a contiguous one's position
            key = tl.load(INDICES + b * si_b + query * si_t + cols, mask=cols < topk, other=-1)
            if PAGED:
                col_ok = (key >= 0) & (key < num_rows * PAGE_SIZE)
            else:
                col_ok = (key >= 0) & (key < seq_end)
            key = tl.where(col_ok, key, 0)
            if PAGED:
                row = (key // PAGE_SIZE).to(tl.int64) * skv_b
                row += (key % PAGE_SIZE).to(tl.int64) * skv_t
            else:
                row = b * skv_b + key.to(tl.int64) * skv_t
        elif PAGED:
            key = cols
            col_ok = cols < seq_end
            page = tl.load(BLOCK_TABLE + b * sbt_b + cols // PAGE_SIZE, mask=col_ok, other=0)
            page = tl.minimum(tl.maximum(page, 0), num_rows - 1).to(tl.int64)
            row = page * skv_b + (cols % PAGE_SIZE).to(tl.int64) * skv_t
        else:
            key = cols
            col_ok = cols < seq_end
            row = b * skv_b + cols.to(tl.int64) * skv_t
        # the latent tile: K's first part and all of V, loaded once
        c = tl.load(KV + row[:, None] + v[None, :], mask=col_ok[:, None] & (v < Dv)[None, :],
                    other=0.0)  # fmt: skip
        if CACHE_FP8 == 3:  # 656-byte rows: e4m3 bytes x their 128-group's float32 scale
            if not INTERPRETED:
                c = c.to(tl.float8e4nv, bitcast=True)
            groups = (KV + row[:, None] + Dv).to(tl.pointer_type(tl.float32))
            group_scale = tl.load(
                groups + tl.arange(0, 4)[None, :], mask=col_ok[:, None], other=0.0
            )  # (BLOCK_N, 4): one load per row and group
            c = tl.reshape(fp8_to_float(c, False, INTERPRETED), (BLOCK_N, 4, BLOCK_V // 4))
            c = tl.reshape(c * group_scale[:, :, None], (BLOCK_N, BLOCK_V)).to(q.dtype)
        elif CACHE_FP8:
            c = fp8_to_float(c, CACHE_FP8 == 2, INTERPRETED).to(q.dtype)
        qk = _dot(q, tl.trans(c), PRECISION, DOT_IN_FP32)
        if HAS_ROPE:
            if CACHE_FP8 == 3:  # the rope columns as bfloat16 after the 4 scales
                rope = (KV + row[None, :] + Dv + 16).to(tl.pointer_type(tl.bfloat16))
                kr = tl.load(rope + r[:, None], mask=col_ok[None, :] & (r < Dr)[:, None],
                             other=0.0).to(q.dtype)  # fmt: skip
            else:
                kr = tl.load(KV + row[None, :] + Dv + r[:, None],
                             mask=col_ok[None, :] & (r < Dr)[:, None], other=0.0)  # fmt: skip
                if CACHE_FP8:
                    kr = fp8_to_float(kr, CACHE_FP8 == 2, INTERPRETED).to(q.dtype)
            qk += _dot(q_pe, kr, PRECISION, DOT_IN_FP32)
        s = qk * (scale * 1.4426950408889634)
        keep = col_ok[None, :] & row_ok[:, None]
        if IS_CAUSAL:
            keep = keep & (key[None, :] <= pos[:, None])
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dot(p.to(c.dtype), c, PRECISION, DOT_IN_FP32)
        m_i = m_new
    seen = l_i > 0.0
    out = acc * (v_scale / tl.where(seen, l_i, 1.0))[:, None]
    lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
    if SPLIT:
        part = (b * num_splits + split) * n_rows + rows
        tl.store(PART_O + part.to(tl.int64)[:, None] * Dv + v[None, :], out,
                 mask=row_ok[:, None] & (v < Dv)[None, :])  # fmt: skip
        tl.store(PART_LSE + part, lse2, mask=row_ok)
    else:
        tl.store(OUT + b * so_b + q_row[:, None] * so_t + h[:, None] * so_h + v[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (v < Dv)[None, :])  # fmt: skip
        tl.store(LSE + b * sl_b + h * sl_h + q_row, lse2 * 0.6931471805599453, mask=row_ok)
