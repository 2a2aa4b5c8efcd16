"""Attention over a KV cache in Triton: split-key decoding (flash-decoding) for one to a few
new queries per sequence, over a contiguous or paged cache.

One program per (sequence, kv head, query block, key split). Its M dimension holds every
query row of the kv head's group: row r is query i = r // group of head hk * group +
r % group, so each K/V tile is read from memory once per kv head, not once per query head
(GQA/MQA decoding reads K/V group times less than one program per query head would).
Sequence b's keys are cache positions [leftpad_b, L_b), L_b = seqlens_k[b]; query i sits at
position L_b - Tq + i (bottom-right), and sees key j iff the window allows it. Decoding is
memory-bound: the time to read each sequence's K/V once at the copy bandwidth is the limit.

With one split the program writes the output and the lse (the sink joined to the row's
normaliser). With several, each split writes its fp32 partial output (normalised) and its
log2-sum-exp, and `decode_combine` merges the splits of a row in a fixed order (the same
inputs give the same bits), the sink joining there. A paged cache is read through
block_table one key row at a time (any page size from 1), so the same logical tiles, and
the same bits, come out of a contiguous, a paged and a (B, Hkv, S, D).transpose(1, 2) cache.
Keys outside [leftpad_b, L_b) are never loaded (a NaN in an unused slot or page never
reaches the output), and the block table is read only for positions below L_b.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl

from .attention_loops import _dot, _tanh
from .fp8 import fp8_bits, fp8_to_f16, fp8_to_float


@dataclass(frozen=True)
class DecodeConfig:
    block_m: int  # query rows (group * Tq, padded) per program
    block_n: int  # keys per tile
    block_d: int
    block_dv: int
    num_warps: int
    num_stages: int


@functools.lru_cache(maxsize=256)
def decode_config(rows: int, D: int, Dv: int, on_gpu: bool) -> DecodeConfig:
    """Tiles for group * Tq query rows and head dims D/Dv (pure; tested). tl.dot needs 16 rows
    at least; more than 64 rows (chunked prefill through the cache) take several query
    blocks. On a GPU: 64 keys per tile (32 past a head dim of 128, to stay in registers), 4
    warps, 3 stages so two K/V tiles are in flight while one is used (untimed: the decode
    benchmark decides). An fp8 cache keeps the 64 keys: 128 (the same bytes a tile as a
    16-bit cache) cut the contiguous loop's instructions per key by 16 % on the sm_90 screen
    but spilled for a paged-16 cache and the paged prefill (benchmarks/results/sm90-static/
    README.md). The CPU interpreter takes 16-key tiles so that tests cross tiles, pages and
    splits at small sizes."""
    bd = max(16, triton.next_power_of_2(D))
    bdv = max(16, triton.next_power_of_2(Dv))
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    if not on_gpu:
        return DecodeConfig(block_m, 16, bd, bdv, 1, 1)
    block_n = 64 if max(bd, bdv) <= 128 else 32
    return DecodeConfig(block_m, block_n, bd, bdv, 4, 3)


def choose_splits(programs: int, capacity: int, sm_count: int, block_n: int) -> int:
    """Key splits per (sequence, kv head, query block) when the caller passes num_splits=0:
    enough programs for two per SM (batch 1 with 8 kv heads on 132 SMs: 33 splits), each
    split at least 4 key tiles of the cache's capacity (lengths are on the device: reading
    them would cost a sync; a split with no keys exits at once), at most 128."""
    if programs <= 0:
        return 1
    wanted = -(-2 * sm_count // programs)
    useful = max(1, capacity // (4 * block_n))
    return max(1, min(wanted, useful, 128))


@triton.jit
def _key_rows(BLOCK_TABLE, b, tile, cols, col_ok, sk_b, sk_t, sv_b, sv_t, sbt_b, num_rows,
              PAGED: tl.constexpr, ONE_PAGE: tl.constexpr, PAGE_SIZE: tl.constexpr,
              BLOCK_N: tl.constexpr):  # fmt: skip
    """64-bit offsets of the tile's key rows in K and V: a contiguous cache's sequence b, one
    page (ONE_PAGE: one block-table entry), or an entry per key row (any page size; no entry
    read for a position outside the sequence). A block-table entry outside the cache's
    num_rows pages is clamped into them (_page): never a read outside the cache."""
    if ONE_PAGE:
        page = _page(tl.load(BLOCK_TABLE + b * sbt_b + (tile * BLOCK_N) // PAGE_SIZE), num_rows)
        slot = ((tile * BLOCK_N) % PAGE_SIZE + tl.arange(0, BLOCK_N)).to(tl.int64)
        return page * sk_b + slot * sk_t, page * sv_b + slot * sv_t
    if PAGED:
        page = tl.load(BLOCK_TABLE + b * sbt_b + cols // PAGE_SIZE, mask=col_ok, other=0)
        page = _page(page, num_rows)
        slot = (cols % PAGE_SIZE).to(tl.int64)
        return page * sk_b + slot * sk_t, page * sv_b + slot * sv_t
    return b * sk_b + cols.to(tl.int64) * sk_t, b * sv_b + cols.to(tl.int64) * sv_t


@triton.jit
def _page(entry, num_rows):
    """A block-table entry as a 64-bit page index inside the cache's num_rows pages: a bad
    entry (unchecked on a GPU) reads some page of the cache, a wrong answer for its sequence
    but never an access outside the cache (two integer ops; hiding the page's keys instead
    cost 38 more SASS instructions per key tile at page 16 on sm_90)."""
    return tl.minimum(tl.maximum(entry, 0), num_rows - 1).to(tl.int64)


@triton.jit
def _mask_bounds(KEY_MASK, b, skm_b, capacity, MASK_SCAN: tl.constexpr):
    """(first visible position, one past the last) of sequence b's (capacity,) bool row; (0,
    0) when none is visible."""
    first = tl.full([MASK_SCAN], 0, tl.int32) + capacity
    end = tl.zeros([MASK_SCAN], tl.int32)
    for start in range(0, capacity, MASK_SCAN):
        cols = start + tl.arange(0, MASK_SCAN)
        inside = cols < capacity
        seen = (tl.load(KEY_MASK + b * skm_b + cols, mask=inside, other=0) != 0) & inside
        first = tl.minimum(first, tl.where(seen, cols, capacity))
        end = tl.maximum(end, tl.where(seen, cols + 1, 0))
    seq_end = tl.max(end, axis=0)
    return tl.minimum(tl.min(first, axis=0), seq_end), seq_end


@triton.jit
def _whole_page_tiles(
    K, V, BLOCK_TABLE, b, hk, tile, seq_end, col_ok, d, dv, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    sbt_b, D, Dv, num_rows, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """(K tile transposed, V tile) of a tile made of whole pages: one block-table entry per
    page, each page's slots contiguous rows (16-byte loads along the head dim); an entry
    outside the cache's num_rows pages clamped into them (_page)."""
    PAGES: tl.constexpr = BLOCK_N // PAGE_SIZE
    first = tile * PAGES + tl.arange(0, PAGES)
    pages = tl.load(BLOCK_TABLE + b * sbt_b + first, mask=first * PAGE_SIZE < seq_end, other=0)
    pages = _page(pages, num_rows)[:, None, None]
    slot = tl.arange(0, PAGE_SIZE).to(tl.int64)[None, :, None]
    ok = tl.reshape(col_ok, (PAGES, PAGE_SIZE))[:, :, None]  # (pages, slots, 1)
    k = tl.load(K + pages * sk_b + slot * sk_t + hk * sk_h + d[None, None, :],
                mask=ok & (d < D)[None, None, :], other=0.0)  # fmt: skip
    v = tl.load(V + pages * sv_b + slot * sv_t + hk * sv_h + dv[None, None, :],
                mask=ok & (dv < Dv)[None, None, :], other=0.0)  # fmt: skip
    return tl.trans(tl.reshape(k, (BLOCK_N, BLOCK_D))), tl.reshape(v, (BLOCK_N, BLOCK_DV))


@triton.jit
def attention_decode(
    Q, K, V, OUT, LSE, PART_O, PART_LSE, SEQLENS_K, LEFTPAD, BLOCK_TABLE, SLOPES, SINKS,
    KEY_MASK, CU_SEQLENS_Q, Q_DESCALE, K_DESCALE, V_DESCALE,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h, sl_b, sl_h,
    sbt_b, sal_b, skm_b,
    Tq, Hq, Hkv, D, Dv, group, num_m_blocks, num_splits, scale, softcap, window_left,
    window_right, capacity, num_rows, seqlen_add, sqd_b, sqd_h, skd_b, skd_h, svd_b, svd_h,
    VARLEN_Q: tl.constexpr,
    HAS_LEFTPAD: tl.constexpr, PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    HAS_SINKS: tl.constexpr, SPLIT: tl.constexpr, HAS_KEY_MASK: tl.constexpr,
    PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MASK_BOUNDS: tl.constexpr = False, MASK_SCAN: tl.constexpr = 1024,
    Q_FP8: tl.constexpr = 0, CACHE_FP8: tl.constexpr = 0, DOT_F16: tl.constexpr = False,
    INVARIANT_SPLIT: tl.constexpr = 0,
):  # fmt: skip
    """One (sequence b, kv head hk, query block, key split) program.

    INVARIANT_SPLIT > 0 (fusedattn.batch_invariant): key tiles counted from the sequence's
    first key (leftpad_b), split s holding tiles [s, s + 1) * INVARIANT_SPLIT of them, so a
    query's tiles and splits are the same whatever the batch, the number of splits (the grid
    covers the capacity), the chunk its query came in, and the cache's layout (tiles read
    through the block table one key row at a time); DOT_F16's power of two is per row. K strides: (sequence,
    position, head) for a contiguous cache; (page, slot, head) for a paged one. PART_O
    (B, Hkv, num_splits, group * Tq, Dv) and PART_LSE (B, Hkv, num_splits, group * Tq) fp32
    take the partials when SPLIT; otherwise OUT (B, Tq, Hq, Dv) and LSE (B, Hq, Tq) (strides
    sl_b, sl_h, 1).
    VARLEN_Q (paged prefill, varlen_attention with a block table): the queries are packed,
    sequence b's rows CU_SEQLENS_Q[b] .. CU_SEQLENS_Q[b + 1] - 1 of Q and OUT (their b
    strides 0) and of LSE (Hq, total_q) along its last dim; Tq is then the longest sequence's
    count, which sizes the grid and the partials, and each sequence's queries sit
    bottom-right of its own keys.
    KEY_MASK (HAS_KEY_MASK; internal, the Hugging Face integration's): a (B, capacity) bool
    row of the positions the sequence's queries may see, holes allowed; keys outside it are
    neither loaded nor weighed. MASK_BOUNDS: the sequence's keys are the row's first visible
    position to its last, found by each program scanning the row (MASK_SCAN bytes a step, from
    L2 after the first program of the sequence: S bytes next to the S * Hkv * (D + Dv) * 2 of
    K/V), so a padded decode step launches what an unpadded one does; SEQLENS_K and LEFTPAD are
    then not read.

    CACHE_FP8 (1 float8_e4m3fn, 2 float8_e5m2): K and V hold fp8, one byte an element read
    as such, each tile converted in registers (exactly: every fp8 value is an fp16, bf16 and
    fp32 value); a stored element means stored × descale, the descales one value per
    (sequence, kv head) (strides 0: one value) folded into the scores' scale and the output.
    Q_FP8 (same codes): q is fp8 too, with Q_DESCALE. DOT_F16 (an fp8 cache under a 16-bit or
    fp8 q): both products in fp16, whatever q's 16-bit type. fp8 converts to fp16 in one
    instruction per two elements where bf16 takes four (e4m3 -> f16 -> f32 -> bf16: the
    sm_90 screen's key loop, 860 instructions per iteration against the bf16 cache's 459,
    would issue about as long as its 16 KB take to arrive at the copy rate). q joins them
    scaled by a power of two, 2^e with max|q| 2^e in [2^14, 2^15) for the program's rows
    (exact, never past fp16's 65504; 2^-e goes into the scale); p = 2^(s - m + 8) scaled by
    2^8 (folded into exp2's argument, out of fp16's subnormals down to 2^-22 of the row's
    maximum; the normaliser sums the same scaled p and the lse takes the 8 back). fp16's 10
    mantissa bits carry q and p more exactly than bf16's 7.

    L_b = SEQLENS_K[b] + seqlen_add (the keys an append in the same step adds: its lengths
    tensor is read as it was, no add on the host). Whatever the values of the lengths and the block table (checked on the host only on
    request, a sync), nothing outside the caches, the block table or the lengths is read:
    L_b is clamped to [0, capacity] (capacity: positions per sequence), leftpad_b to
    [0, L_b], and a block-table entry outside [0, num_rows) clamped into it.

    PAGE_SIZE is a constexpr: the page and slot of a key are then a shift and a mask (a
    multiply for other sizes), not a division, and where the page size is a multiple of the
    key tile each tile reads one block-table entry (sm_90, D=128, page 256: see
    scripts/static_decode.py)."""
    pid = tl.program_id(0)
    split = pid % num_splits
    rest = pid // num_splits
    m_blk = rest % num_m_blocks
    bhk = rest // num_m_blocks
    b = (bhk // Hkv).to(tl.int64)
    hk = bhk % Hkv
    rows = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    n_rows = group * Tq  # rows per (sequence, kv head) in the partials
    q0 = 0  # the sequence's first query row (packed queries)
    Tq_b = Tq
    if VARLEN_Q:
        q0 = tl.load(CU_SEQLENS_Q + b).to(tl.int64)
        Tq_b = tl.load(CU_SEQLENS_Q + b + 1) - q0
    row_ok = rows < group * Tq_b
    qi = rows // group  # query index
    h = hk * group + rows % group  # query head
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q_row = q0 + qi.to(tl.int64)
    q = tl.load(Q + b * sq_b + q_row[:, None] * sq_t + h[:, None] * sq_h + d[None, :],
                mask=row_ok[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
    v_scale = 1.0
    if CACHE_FP8:  # stored × descale: K's into the scores' scale, V's into the output
        scale = scale * tl.load(K_DESCALE + b * skd_b + hk * skd_h)
        v_scale = tl.load(V_DESCALE + b * svd_b + hk * svd_h)
    if Q_FP8:
        q = fp8_to_float(q, Q_FP8 == 2, INTERPRETED).to(tl.bfloat16)
        scale = scale * tl.load(Q_DESCALE + b * sqd_b + hk * sqd_h)
    P_SHIFT: tl.constexpr = 8.0 if DOT_F16 else 0.0
    if DOT_F16 and INVARIANT_SPLIT:  # per row: a row's bits must not depend on its block
        qf = q.to(tl.float32)
        amax = tl.max(tl.abs(qf), axis=1)
        e = 14 - (((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127)
        e = tl.minimum(tl.maximum(e, -126), 126)
        q = (qf * ((e + 127) << 23).to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        scale = scale * ((127 - e) << 23).to(tl.float32, bitcast=True)[:, None]
    elif DOT_F16:  # q into fp16 by a power of two (see the docstring)
        qf = q.to(tl.float32)
        amax = tl.max(tl.max(tl.abs(qf), axis=1), axis=0)
        e = 14 - (((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127)
        e = tl.minimum(tl.maximum(e, -126), 126)  # an all-zero q: any scale
        q = (qf * ((e + 127) << 23).to(tl.float32, bitcast=True)).to(tl.float16)
        scale = scale * ((127 - e) << 23).to(tl.float32, bitcast=True)
    if MASK_BOUNDS:  # the keys run from the mask row's first visible position to its last
        seq_start, seq_end = _mask_bounds(KEY_MASK, b, skm_b, capacity, MASK_SCAN)
    else:
        seq_end = tl.minimum(tl.maximum(tl.load(SEQLENS_K + b) + seqlen_add, 0), capacity)
        seq_start = 0
        if HAS_LEFTPAD:
            seq_start = tl.minimum(tl.maximum(tl.load(LEFTPAD + b), 0), seq_end)
    pos = seq_end - Tq_b + qi  # each row's key position (bottom-right)
    lo = seq_start
    if HAS_LEFT:  # the first query's window starts here; no row sees a key before it
        lo = tl.maximum(lo, seq_end - Tq_b - window_left)
    hi = seq_end
    if VARLEN_Q:  # a query block past the sequence's rows reads nothing
        hi = tl.where(m_blk * BLOCK_M < group * Tq_b, hi, lo)
    if INVARIANT_SPLIT:  # tiles from the sequence's first key, splits at fixed tiles
        base = seq_start
        n_all = tl.where(hi > base, tl.cdiv(hi - base, BLOCK_N), 0)
        tile_lo = tl.maximum(split * INVARIANT_SPLIT, (lo - base) // BLOCK_N)
        tile_hi = tl.minimum(split * INVARIANT_SPLIT + INVARIANT_SPLIT, n_all)
    else:  # this split's key tiles: the sequence's tiles cut into num_splits runs of whole tiles
        base = 0
        first_tile = lo // BLOCK_N
        n_tiles = tl.where(hi > lo, tl.cdiv(hi, BLOCK_N) - first_tile, 0)
        per_split = tl.cdiv(n_tiles, num_splits)
        tile_lo = first_tile + split * per_split
        tile_hi = tl.minimum(tile_lo + per_split, first_tile + n_tiles)
    slope2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + b * sal_b + h, mask=row_ok, other=0.0) * 1.4426950408889634
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS and not SPLIT:  # the sink joins the normaliser (one logit of value 0)
        m_i = (
            tl.load(SINKS + h, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
        )
        l_i = tl.where(row_ok, 2.0**P_SHIFT, 0.0)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    # How a paged cache is read: a tile inside one page takes one block-table entry; a tile of
    # whole pages takes one entry per page and loads (pages, slots, D) blocks (sm_90, page 16:
    # 491 instructions per iteration against 781 with an entry per key row; see
    # scripts/static_decode.py); other page sizes take an entry per key row.
    # (Under INVARIANT_SPLIT tiles start at the sequence's first key: one entry per key row.)
    ONE_PAGE: tl.constexpr = PAGED and PAGE_SIZE % BLOCK_N == 0 and not INVARIANT_SPLIT
    WHOLE_PAGES: tl.constexpr = (
        PAGED and not ONE_PAGE and BLOCK_N % PAGE_SIZE == 0 and not INVARIANT_SPLIT
    )
    for tile in range(tile_lo, tile_hi):
        cols = base + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = (cols >= seq_start) & (cols < seq_end)
        if HAS_KEY_MASK:
            col_ok = col_ok & (tl.load(KEY_MASK + b * skm_b + cols, mask=col_ok, other=0) != 0)
        if WHOLE_PAGES:
            kt, vt = _whole_page_tiles(
                K, V, BLOCK_TABLE, b, hk, tile, seq_end, col_ok, d, dv, sk_b, sk_t, sk_h, sv_b,
                sv_t, sv_h, sbt_b, D, Dv, num_rows, PAGE_SIZE, BLOCK_N, BLOCK_D, BLOCK_DV,
            )  # fmt: skip
        else:
            k_row, v_row = _key_rows(
                BLOCK_TABLE, b, tile, cols, col_ok, sk_b, sk_t, sv_b, sv_t, sbt_b, num_rows,
                PAGED, ONE_PAGE, PAGE_SIZE, BLOCK_N,
            )  # fmt: skip
            kt = tl.load(K + k_row[None, :] + hk * sk_h + d[:, None],
                         mask=col_ok[None, :] & (d < D)[:, None], other=0.0)  # fmt: skip
        if DOT_F16:
            kt = fp8_to_f16(kt, CACHE_FP8 == 2, INTERPRETED)
        elif CACHE_FP8:
            kt = fp8_to_float(kt, CACHE_FP8 == 2, INTERPRETED).to(q.dtype)
        qk = _dot(q, kt, PRECISION, DOT_IN_FP32)
        if SOFTCAP:
            s = _tanh(qk * (scale / softcap), PRECISION, INTERPRETED) * (
                softcap * 1.4426950408889634
            )
        else:
            s = qk * (scale * 1.4426950408889634)
        if HAS_ALIBI:
            s -= slope2[:, None] * tl.abs((pos[:, None] - cols[None, :]).to(tl.float32))
        keep = col_ok[None, :] & row_ok[:, None]
        if HAS_RIGHT:
            keep = keep & (cols[None, :] <= pos[:, None] + window_right)
        if HAS_LEFT:
            keep = keep & (cols[None, :] >= pos[:, None] - window_left)
        s = tl.where(keep, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - (m_safe - P_SHIFT)[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if not WHOLE_PAGES:
            vt = tl.load(V + v_row[:, None] + hk * sv_h + dv[None, :],
                         mask=col_ok[:, None] & (dv < Dv)[None, :], other=0.0)  # fmt: skip
        if DOT_F16:
            vt = fp8_to_f16(vt, CACHE_FP8 == 2, INTERPRETED)
        elif CACHE_FP8:
            vt = fp8_to_float(vt, CACHE_FP8 == 2, INTERPRETED).to(q.dtype)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), vt, PRECISION, DOT_IN_FP32)
        m_i = m_new
    seen = l_i > 0.0
    out = acc * (v_scale / tl.where(seen, l_i, 1.0))[:, None]
    lse2 = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)) - P_SHIFT, float("-inf"))
    if SPLIT:
        part = ((b * Hkv + hk) * num_splits + split) * n_rows + rows
        tl.store(PART_O + part.to(tl.int64)[:, None] * Dv + dv[None, :], out,
                 mask=row_ok[:, None] & (dv < Dv)[None, :])  # fmt: skip
        tl.store(PART_LSE + part, lse2, mask=row_ok)
    else:
        tl.store(OUT + b * so_b + q_row[:, None] * so_t + h[:, None] * so_h + dv[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (dv < Dv)[None, :])  # fmt: skip
        tl.store(LSE + b * sl_b + h * sl_h + q_row, lse2 * 0.6931471805599453, mask=row_ok)


@triton.jit
def decode_combine(
    PART_O, PART_LSE, OUT, LSE, SINKS, CU_SEQLENS_Q, so_b, so_t, so_h, sl_b, sl_h, Tq, Hq, Hkv,
    Dv, group, num_splits,
    VARLEN_Q: tl.constexpr, HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr, ORDERED: tl.constexpr = False,
):  # fmt: skip
    """One output row (sequence b, query i, head h): the splits' partials merged with their
    log2-sum-exp weights, summed over the split axis in one fixed order (deterministic, no
    atomics); the sink joins the normaliser here. VARLEN_Q: packed queries as in
    attention_decode (Tq the longest sequence's count; rows past a sequence's exit).
    ORDERED (batch invariance): the splits summed one after another, split 0 first, so that
    splits past a short sequence's end (w = 0, o = 0: exact zeros) leave its bits as they are
    however many there are (a tree sum's pairing follows BLOCK_S)."""
    pid = tl.program_id(0)
    h = pid % Hq
    bi = pid // Hq
    qi = bi % Tq
    b = (bi // Tq).to(tl.int64)
    q_row = qi.to(tl.int64)
    row_ok = qi >= 0  # true; a query row past its sequence stores nothing (VARLEN_Q)
    if VARLEN_Q:
        q0 = tl.load(CU_SEQLENS_Q + b).to(tl.int64)
        row_ok = qi < tl.load(CU_SEQLENS_Q + b + 1) - q0
        q_row += q0
    hk = h // group
    row = qi * group + h % group
    dv = tl.arange(0, BLOCK_DV)
    if ORDERED:
        _combine_ordered(PART_O, PART_LSE, OUT, LSE, SINKS, b, h, hk, row, q_row, row_ok, dv,
                         so_b, so_t, so_h, sl_b, sl_h, Tq, Hkv, Dv, group, num_splits, HAS_SINKS,
                         BLOCK_DV)  # fmt: skip
        return
    s = tl.arange(0, BLOCK_S)
    part = ((b * Hkv + hk) * num_splits + s) * (group * Tq) + row
    lse2 = tl.load(PART_LSE + part, mask=s < num_splits, other=float("-inf"))
    m = tl.max(lse2, axis=0)
    if HAS_SINKS:
        sink2 = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse2 - m_safe)  # 0 for a split that saw no key
    total = tl.sum(w, axis=0)
    if HAS_SINKS:
        total += tl.exp2(sink2 - m_safe)
    o = tl.load(PART_O + part.to(tl.int64)[:, None] * Dv + dv[None, :],
                mask=(s < num_splits)[:, None] & (dv < Dv)[None, :], other=0.0)  # fmt: skip
    o = tl.where((w > 0.0)[:, None], o, 0.0)  # a split that saw nothing wrote 0, never NaN
    seen = total > 0.0
    out = tl.sum(o * w[:, None], axis=0) / tl.where(seen, total, 1.0)
    tl.store(OUT + b * so_b + q_row * so_t + h * so_h + dv, out.to(OUT.dtype.element_ty),
             mask=row_ok & (dv < Dv))  # fmt: skip
    lse = tl.where(seen, (m_safe + tl.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    tl.store(LSE + b * sl_b + h * sl_h + q_row, lse, mask=row_ok)


@triton.jit
def _combine_ordered(PART_O, PART_LSE, OUT, LSE, SINKS, b, h, hk, row, q_row, row_ok, dv, so_b,
                     so_t, so_h, sl_b, sl_h, Tq, Hkv, Dv, group, num_splits,
                     HAS_SINKS: tl.constexpr, BLOCK_DV: tl.constexpr):  # fmt: skip
    """decode_combine's ORDERED form: the maximum, then the weighted sums, split by split."""
    first = ((b * Hkv + hk) * num_splits) * (group * Tq) + row
    m = tl.load(PART_LSE + first)
    for s in range(1, num_splits):
        m = tl.maximum(m, tl.load(PART_LSE + first + s * (group * Tq)))
    if HAS_SINKS:
        sink2 = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink2)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s in range(0, num_splits):
        part = first + s * (group * Tq)
        w = tl.exp2(tl.load(PART_LSE + part) - m_safe)  # 0 for a split that saw no key
        o = tl.load(PART_O + part.to(tl.int64) * Dv + dv, mask=dv < Dv, other=0.0)
        acc += tl.where(w > 0.0, o, 0.0) * w
        total += w
    if HAS_SINKS:
        total += tl.exp2(sink2 - m_safe)
    seen = total > 0.0
    out = acc / tl.where(seen, total, 1.0)
    tl.store(OUT + b * so_b + q_row * so_t + h * so_h + dv, out.to(OUT.dtype.element_ty),
             mask=row_ok & (dv < Dv))  # fmt: skip
    lse = tl.where(seen, (m_safe + tl.log2(tl.where(seen, total, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    tl.store(LSE + b * sl_b + h * sl_h + q_row, lse, mask=row_ok)


@triton.jit
def append_kv(
    K, V, K_CACHE, V_CACHE, SEQLENS, BLOCK_TABLE, K_DESCALE, V_DESCALE,
    sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
    skc_b, skc_t, skc_h, svc_b, svc_t, svc_h, sbt_b,
    Tnew, Hkv, D, Dv, capacity, num_rows, skd_b, skd_h, svd_b, svd_h,
    PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CACHE_FP8: tl.constexpr = 0,
):  # fmt: skip
    """The in-place append of attention_with_kvcache: new key/value row (b, t, h) of k, v
    (B, Tnew, Hkv, D[v]) goes to cache position seqlens[b] + t of sequence b (through
    block_table when PAGED), one program per row. One launch where torch's indexed writes took
    about ten ops (the host time of a decode step). Whatever the values (checked on the host
    only on request), nothing outside the caches, the block table or the lengths is touched:
    positions outside [0, capacity) and pages outside [0, num_rows) are not written, and no
    block-table entry is read for them. CACHE_FP8 (1 float8_e4m3fn, 2 float8_e5m2; the caches
    passed as their bytes): each value x is written as x / descale rounded to nearest-even,
    saturating, NaN kept (fp8.fp8_bits: the bits torch's cast gives after
    fusedattn.fp8.quantize's clamp)."""
    pid = tl.program_id(0)
    h = pid % Hkv
    t = (pid // Hkv) % Tnew
    b = (pid // (Hkv * Tnew)).to(tl.int64)
    pos = tl.load(SEQLENS + b).to(tl.int64) + t
    ok = (pos >= 0) & (pos < capacity)
    if PAGED:
        page = tl.load(BLOCK_TABLE + b * sbt_b + pos // PAGE_SIZE, mask=ok, other=0).to(tl.int64)
        ok = ok & (page >= 0) & (page < num_rows)
        row = page
        slot = pos % PAGE_SIZE
    else:
        row = b
        slot = pos
    d = tl.arange(0, BLOCK_D)
    x = tl.load(K + b * sk_b + t * sk_t + h * sk_h + d, mask=d < D)
    dv = tl.arange(0, BLOCK_DV)
    y = tl.load(V + b * sv_b + t * sv_t + h * sv_h + dv, mask=dv < Dv)
    if CACHE_FP8:
        x = fp8_bits(x.to(tl.float32) / tl.load(K_DESCALE + b * skd_b + h * skd_h), CACHE_FP8 == 2)
        y = fp8_bits(y.to(tl.float32) / tl.load(V_DESCALE + b * svd_b + h * svd_h), CACHE_FP8 == 2)
    tl.store(K_CACHE + row * skc_b + slot * skc_t + h * skc_h + d, x, mask=ok & (d < D))
    tl.store(V_CACHE + row * svc_b + slot * svc_t + h * svc_h + dv, y, mask=ok & (dv < Dv))
