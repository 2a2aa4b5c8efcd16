"""Flash attention in Triton: forward (online softmax, O(T) memory, log-sum-exp saved) and a
deterministic backward (dk/dv by key block, dq by query block, no atomics), with the variants
in the kernels: key windows (causal is the window (-1, 0)), top-left or bottom-right
alignment, softcap, ALiBi, attention sinks and packed variable-length batches.

Layouts: q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) with any strides and a unit
last stride; GQA maps q head h to kv head h // (Hq / Hkv). Packed (varlen) batches are the
same kernels with batch strides 0 and each sequence's rows read from cu_seqlens. Masks, each
optional: an attn_mask read through its broadcast strides (bool: True keeps; float: added to
the scores), key padding (B, Tk) bool (True = padding), and the positional window: query i
sits at key position p = i (+ Tk - Tq when bottom-right) and sees key j iff
p - left <= j <= p + right (a side of -1 is unbounded).

The backward is two launches: dq (which also writes delta = rowsum(dO * O)), then dk/dv.
Key tiles outside a query block's window are never visited; inside it, the tiles that every
row of the block sees in full run without the positional mask (an unmasked interior loop
between two masked boundary loops). Scores are kept in the log2 domain (scaled by log2(e)) so
the kernels use exp2. A query row that sees no key gets output 0, lse -inf (the sink logit
with sinks) and zero gradients. Offsets are 64-bit; every kernel runs on one flattened grid
axis (2^31 - 1 programs), the blocks of one head adjacent so its K/V stay in L2, and causal
query blocks longest first.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import attention_blocks

# the tiles and their choice (callers take them from here, the kernels' module)
from .attention_config import (  # noqa: F401
    HOPPER_SMEM_ARCHS,
    AttentionConfig,
    Tiles,
    attention_config,
)
from .attention_loops import (
    _clip_to_valid_keys,
    _dkdv_tiles,
    _dq_tiles,
    _fwd_tiles,
    _grid_block,
    _key_range,
    _part_bounds,
    _query_range,
    _seq_bounds,
    _tile_order,
)


@triton.jit
def _fwd_block(
    bh, m_blk,
    Q, K, V, Out, LSE, MASK, KPM, KV_RANGE, SEED, SLOPES, SINKS, CU_Q, CU_K,
    Q_DESCALE, K_DESCALE, V_DESCALE,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t, slse_b, slse_h,
    sm_b, sm_h, sm_q, sm_k, skp_b, sal_b,
    H, Tq, Tk, D, Dv, group, scale, softcap, window_left, window_right,
    dropout_p, sqd_b, sqd_h, skd_b, skd_h, svd_b, svd_h,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PIPELINE: tl.constexpr, MASK_IN_DOT: tl.constexpr, FP8: tl.constexpr,
    WARP_SPEC: tl.constexpr,
    BLOCK_SPARSE: tl.constexpr = False, LISTS=None, KINDS=None, BITS=None, sl_b=0, sl_h=0,
    sl_r=0, BS_Q: tl.constexpr = 128, BS_K: tl.constexpr = 128, BITS_IN_DOT: tl.constexpr = False,
    SCORE_MOD: tl.constexpr = None, MOD_ARGS=None,
):  # fmt: skip
    """One query block (bh, m_blk) of attention_fwd: its rows' output and lse (BLOCK_SPARSE:
    the key blocks a block mask lists, attention_blocks.py)."""
    b = bh // H
    h = bh % H
    hk = h // group
    q_start, q_len, k_start, k_len = _seq_bounds(b, CU_Q, CU_K, Tq, Tk, VARLEN)
    offset = 0
    if BOTTOM_RIGHT:
        offset = k_len - q_len
    start_m = m_blk * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    row_ptr = (q_start + rows).to(tl.int64)
    if WARP_SPEC:  # q through a descriptor too: loaded by pointer, Triton 3.6's warp
        # specialization asserts (WSLowerToken, processProducerCommitOp)
        q = tl.make_tensor_descriptor(
            Q + b * sq_b + h * sq_h + q_start * sq_t,
            shape=[q_len, D],
            strides=[sq_t, 1],
            block_shape=[BLOCK_M, BLOCK_D],
        ).load([start_m, 0])
    elif USE_TMA:  # descriptor coordinates are 32-bit
        q = Q.load([b.to(tl.int32), h.to(tl.int32), start_m, 0]).reshape(BLOCK_M, BLOCK_D)
    else:
        q = tl.load(Q + b * sq_b + h * sq_h + row_ptr[:, None] * sq_t + d[None, :],
                    mask=(rows < q_len)[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + b * sal_b + h) * 1.4426950408889634
    P_SHIFT: tl.constexpr = 8.0 if FP8 else 0.0
    P_ONE: tl.constexpr = 256.0 if FP8 else 1.0  # 2^P_SHIFT: a sink's scaled probability
    v_scale = 1.0
    if FP8:  # stored × descale: q's and k's into the scores' scale, v's into the output
        scale = scale * tl.load(Q_DESCALE + b * sqd_b + hk * sqd_h)
        scale = scale * tl.load(K_DESCALE + b * skd_b + hk * skd_h)
        v_scale = tl.load(V_DESCALE + b * svd_b + hk * svd_h)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # the sink joins the normaliser as one more logit of value 0
        sink2 = tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634
        m_i = tl.full([BLOCK_M], 1.0, tl.float32) * sink2
        l_i = tl.full([BLOCK_M], P_ONE, tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    TMA_MODE: tl.constexpr = 2 if WARP_SPEC else (1 if USE_TMA else 0)
    if WARP_SPEC:  # this head's K/V rows as descriptors (zero-filled past k_len and D)
        K_head = tl.make_tensor_descriptor(
            K + b * sk_b + hk * sk_h + k_start * sk_t,
            shape=[k_len, D],
            strides=[sk_t, 1],
            block_shape=[BLOCK_N, BLOCK_D],
        )
        V_head = tl.make_tensor_descriptor(
            V + b * sv_b + hk * sv_h + k_start * sv_t,
            shape=[k_len, Dv],
            strides=[sv_t, 1],
            block_shape=[BLOCK_N, BLOCK_DV],
        )
    elif USE_TMA:
        K_head = K
        V_head = V
    else:
        K_head = K + b * sk_b + hk * sk_h + k_start * sk_t
        V_head = V + b * sv_b + hk * sv_h + k_start * sv_t
    lo, mid_lo, mid_hi, hi = _key_range(start_m, q_len, k_len, offset, window_left,
                                        window_right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)  # fmt: skip
    if HAS_KPM:
        lo, mid_lo, mid_hi, hi = _clip_to_valid_keys(lo, mid_lo, mid_hi, hi, KV_RANGE, b,
                                                     BLOCK_N)  # fmt: skip
    if WARP_SPEC:  # one loop over every tile, masks and all: Triton 3.6's warp-specialization
        # pass fails (PassManager) on a kernel whose loop has neighbours (static_attention.py)
        acc, l_i, m_i = _fwd_tiles(
            acc, l_i, m_i, q, K_head, V_head, sk_t, sv_t, lo, hi, rows, d, dv,
            b, h, hk, bh, q_len, k_len, offset, slope2, scale, softcap, window_left,
            window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv, Tq, Tk,
            dropout_p, HAS_MASK, MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP,
            HAS_ALIBI, DROPOUT, True, PRECISION, DOT_IN_FP32, INTERPRETED, TMA_MODE, False,
            MASK_IN_DOT, BLOCK_N, BLOCK_D, BLOCK_DV, FP8, True,
            SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS,
        )  # fmt: skip
    elif BLOCK_SPARSE:
        acc, l_i, m_i = attention_blocks.fwd_listed_blocks(
            acc, l_i, m_i, q, K_head, V_head, sk_t, sv_t, lo, hi, rows, d, dv,
            b, h, hk, bh, q_len, k_len, offset, slope2, scale, softcap, window_left,
            window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv, Tq, Tk,
            dropout_p, start_m, LISTS, KINDS, BITS, sl_b, sl_h, sl_r, HAS_MASK, MASK_IS_BOOL,
            HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, PRECISION, DOT_IN_FP32,
            INTERPRETED, MASK_IN_DOT, BITS_IN_DOT, BLOCK_N, BLOCK_D, BLOCK_DV, BS_Q, BS_K, FP8,
            SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS,
        )  # fmt: skip
    else:
        for part in tl.static_range(3):  # boundary, interior (no positional mask), boundary
            first, last = _part_bounds(part, lo, mid_lo, mid_hi, hi)
            acc, l_i, m_i = _fwd_tiles(
                acc, l_i, m_i, q, K_head, V_head, sk_t, sv_t, first, last, rows, d, dv,
                b, h, hk, bh, q_len, k_len, offset, slope2, scale, softcap, window_left,
                window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv, Tq, Tk,
                dropout_p, HAS_MASK, MASK_IS_BOOL, HAS_KPM and part != 1, HAS_LEFT, HAS_RIGHT,
                SOFTCAP, HAS_ALIBI, DROPOUT, part != 1, PRECISION, DOT_IN_FP32, INTERPRETED,
                TMA_MODE, PIPELINE and part == 1, MASK_IN_DOT, BLOCK_N, BLOCK_D, BLOCK_DV, FP8,
                SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS,
            )  # fmt: skip
    out = acc * (v_scale / tl.where(l_i == 0.0, 1.0, l_i))[:, None]
    if USE_TMA:  # the copy clips rows past Tq and columns past Dv
        Out.store(
            [b.to(tl.int32), h.to(tl.int32), start_m, 0],
            out.to(Out.dtype).reshape(1, 1, BLOCK_M, BLOCK_DV),
        )
    else:
        tl.store(Out + b * so_b + h * so_h + row_ptr[:, None] * so_t + dv[None, :],
                 out.to(Out.dtype.element_ty), mask=(rows < q_len)[:, None] & (dv < Dv)[None, :])  # fmt: skip
    seen = l_i > 0.0
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0)) - P_SHIFT) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    tl.store(LSE + b * slse_b + h * slse_h + row_ptr, lse, mask=rows < q_len)


@triton.jit
def attention_fwd(
    Q, K, V, Out, LSE, MASK, KPM, KV_RANGE, SEED, SLOPES, SINKS, CU_Q, CU_K,
    Q_DESCALE, K_DESCALE, V_DESCALE,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t, slse_b, slse_h,
    sm_b, sm_h, sm_q, sm_k, skp_b, sal_b,
    H, Tq, Tk, D, Dv, group, num_m_blocks, num_tiles, scale, softcap, window_left, window_right,
    dropout_p, sqd_b, sqd_h, skd_b, skd_h, svd_b, svd_h,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, HAS_SINKS: tl.constexpr,
    VARLEN: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PIPELINE: tl.constexpr = False, MASK_IN_DOT: tl.constexpr = False, FP8: tl.constexpr = False,
    WARP_SPEC: tl.constexpr = False, PERSISTENT: tl.constexpr = False,
    BLOCK_SPARSE: tl.constexpr = False, LISTS=None, KINDS=None, BITS=None, sl_b=0, sl_h=0,
    sl_r=0, BS_Q: tl.constexpr = 128, BS_K: tl.constexpr = 128, BITS_IN_DOT: tl.constexpr = False,
    SCORE_MOD: tl.constexpr = None, MOD_ARGS=None,
):  # fmt: skip
    """USE_TMA (never with VARLEN): Q, K, V and Out are tensor descriptors over the (B, H, T,
    D) tensors with blocks (1, 1, BLOCK_M or BLOCK_N, BLOCK_D); their strides go unused.
    WARP_SPEC (Tiles.warp_spec; pointers passed, no USE_TMA): the kernel makes each head's
    (T, D) K and V descriptors itself (Triton 3.6's warp specialization takes only those:
    host descriptors fail to compile, triton-lang/triton#7658; they need the global scratch
    allocator, triton_args.ensure_scratch_allocator) and the interior key loop runs
    warp-specialized; varlen works the same (a sequence's rows are its descriptor).
    PIPELINE (Tiles.pipeline): the interior loop overlaps each tile's softmax with the tensor
    cores (_fwd_tiles); the boundary loops, a few tiles each, stay plain. MASK_IN_DOT: the
    attn_mask enters through the dot's accumulator (_fwd_scores).

    FP8 (inference): Q, K, V hold float8_e4m3fn and both products run on fp8 tensor cores. A
    stored element means stored × descale (Q_DESCALE, K_DESCALE, V_DESCALE: one value per
    sequence and kv head, or one for all with strides 0): q's and k's fold into the scores'
    scale, v's into the output. P is rounded to float8_e4m3fn for P·V, as flash-attention 3
    does, scaled by 2^8 first (P_SHIFT: exp2's argument gains 8, free) so that probabilities
    down to 2^-14 of the row's maximum keep e4m3's 3 mantissa bits (subnormal down to 2^-17)
    instead of flushing below its 2^-9; the normaliser sums the same scaled p, so the output
    needs no correction and the lse subtracts 8.

    PERSISTENT (Tiles.persistent): a grid of about one program per multiprocessor, each
    taking query blocks num_programs apart from one order of all num_tiles of them; with a
    right window bound (causal) that order is longest first across every head (_tile_order),
    so the last wave holds the shortest blocks instead of a straggler of long ones."""
    if PERSISTENT:
        for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
            bh, m_blk = _tile_order(tile, num_tiles, num_m_blocks, HAS_RIGHT)
            _fwd_block(
                bh, m_blk,
                Q, K, V, Out, LSE, MASK, KPM, KV_RANGE, SEED, SLOPES, SINKS, CU_Q, CU_K,
                Q_DESCALE, K_DESCALE, V_DESCALE,
                sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
                so_b, so_h, so_t, slse_b, slse_h,
                sm_b, sm_h, sm_q, sm_k, skp_b, sal_b,
                H, Tq, Tk, D, Dv, group, scale, softcap, window_left, window_right,
                dropout_p, sqd_b, sqd_h, skd_b, skd_h, svd_b, svd_h,
                HAS_MASK, MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT,
                SOFTCAP, HAS_ALIBI,
                HAS_SINKS, VARLEN, DROPOUT, PRECISION, DOT_IN_FP32, INTERPRETED, USE_TMA,
                BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PIPELINE, MASK_IN_DOT, FP8, WARP_SPEC,
                BLOCK_SPARSE, LISTS, KINDS, BITS, sl_b, sl_h, sl_r, BS_Q, BS_K, BITS_IN_DOT,
                SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS,
            )  # fmt: skip
    else:
        bh, m_blk = _grid_block(tl.program_id(0), num_m_blocks, HAS_RIGHT)
        _fwd_block(
            bh, m_blk,
            Q, K, V, Out, LSE, MASK, KPM, KV_RANGE, SEED, SLOPES, SINKS, CU_Q, CU_K,
            Q_DESCALE, K_DESCALE, V_DESCALE,
            sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t,
            so_b, so_h, so_t, slse_b, slse_h,
            sm_b, sm_h, sm_q, sm_k, skp_b, sal_b,
            H, Tq, Tk, D, Dv, group, scale, softcap, window_left, window_right,
            dropout_p, sqd_b, sqd_h, skd_b, skd_h, svd_b, svd_h,
            HAS_MASK, MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, BOTTOM_RIGHT,
            SOFTCAP, HAS_ALIBI,
            HAS_SINKS, VARLEN, DROPOUT, PRECISION, DOT_IN_FP32, INTERPRETED, USE_TMA,
            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PIPELINE, MASK_IN_DOT, FP8, WARP_SPEC,
            BLOCK_SPARSE, LISTS, KINDS, BITS, sl_b, sl_h, sl_r, BS_Q, BS_K, BITS_IN_DOT,
            SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS,
        )  # fmt: skip


@triton.jit
def attention_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, MASK, KPM, KV_RANGE, SEED, SLOPES, CU_Q, CU_K,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
    sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t, slse_b, slse_h,
    sm_b, sm_h, sm_q, sm_k, skp_b, sal_b,
    H, Hkv, Tq, Tk, D, Dv, group, num_n_blocks, scale, softcap, window_left, window_right,
    dropout_p,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, VARLEN: tl.constexpr,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    MERGE_BOUNDARIES: tl.constexpr = False, PIPELINE: tl.constexpr = False,
    BLOCK_SPARSE: tl.constexpr = False, LISTS=None, KINDS=None, BITS=None, sl_b=0, sl_h=0,
    sl_r=0, BS_Q: tl.constexpr = 128, BS_K: tl.constexpr = 128, BITS_IN_DOT: tl.constexpr = False,
    SCORE_MOD: tl.constexpr = None, SCORE_MOD_GRAD: tl.constexpr = None, MOD_ARGS=None,
):  # fmt: skip
    """dk, dv of one key block of one kv head, summed over the q heads of its group in a fixed
    order (deterministic GQA). PIPELINE: the interior query tiles' loop rotated
    (_dkdv_tiles)."""
    bhk, n_blk = _grid_block(tl.program_id(0), num_n_blocks, False)
    b = bhk // Hkv
    hk = bhk % Hkv
    q_start, q_len, k_start, k_len = _seq_bounds(b, CU_Q, CU_K, Tq, Tk, VARLEN)
    offset = 0
    if BOTTOM_RIGHT:
        offset = k_len - q_len
    start_n = n_blk * BLOCK_N
    cols = start_n + tl.arange(0, BLOCK_N)
    col_ptr = (k_start + cols).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    real = cols < k_len
    if HAS_KPM:  # padded keys: never read (a NaN there must not reach dk/dv of others)
        real = real & (tl.load(KPM + b * skp_b + cols, mask=cols < k_len, other=1) == 0)
    k = tl.load(K + b * sk_b + hk * sk_h + col_ptr[:, None] * sk_t + d[None, :],
                mask=real[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
    v_keep = real[:, None] & (dv < Dv)[None, :]
    v = tl.load(V + b * sv_b + hk * sv_h + col_ptr[:, None] * sv_t + dv[None, :], mask=v_keep,
                other=0.0)  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv_acc = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _query_range(start_n, q_len, k_len, offset, window_left,
                                          window_right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)  # fmt: skip
    if HAS_KPM:  # a key block of padding only: no query tile (dk, dv stay 0)
        all_padding = (start_n + BLOCK_N <= tl.load(KV_RANGE + 3 * b)) | (
            start_n >= tl.load(KV_RANGE + 3 * b + 1)
        )
        hi = tl.where(all_padding, lo, hi)
        mid_lo = tl.minimum(mid_lo, hi)
        mid_hi = tl.minimum(mid_hi, hi)
    for g in range(0, group):
        h = hk * group + g
        bhq = b * H + h
        slope2 = 0.0
        if HAS_ALIBI:
            slope2 = tl.load(SLOPES + b * sal_b + h) * 1.4426950408889634
        Q_head = Q + b * sq_b + h * sq_h + q_start * sq_t
        DO_head = DO + b * sdo_b + h * sdo_h + q_start * sdo_t
        LSE_head = LSE + b * slse_b + h * slse_h + q_start
        DELTA_head = DELTA + b * slse_b + h * slse_h + q_start
        if BLOCK_SPARSE:  # the query blocks a block mask lists (attention_blocks.py)
            dk, dv_acc = attention_blocks.dkdv_listed_blocks(
                dk, dv_acc, k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, lo, hi,
                cols, d, dv, b, h, bhq, q_len, k_len, offset, slope2, scale, softcap,
                window_left, window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv,
                Tq, Tk, dropout_p, start_n, LISTS, KINDS, BITS, sl_b, sl_h, sl_r, HAS_MASK,
                MASK_IS_BOOL, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, PRECISION,
                DOT_IN_FP32, INTERPRETED, BLOCK_M, BS_Q, BS_K,
                SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
            )  # fmt: skip
        # boundary, interior (no positional mask), boundary; with MERGE_BOUNDARIES the
        # interior, then both boundary ranges in one loop (see Tiles.merge)
        for part in tl.static_range(0 if BLOCK_SPARSE else (2 if MERGE_BOUNDARIES else 3)):
            if MERGE_BOUNDARIES:
                first, last, first2, last2 = mid_lo, mid_hi, mid_hi, mid_hi
                if part == 1:
                    first, last, first2, last2 = lo, mid_lo, mid_hi, hi
            else:
                first, last = _part_bounds(part, lo, mid_lo, mid_hi, hi)
                first2, last2 = last, last
            dk, dv_acc = _dkdv_tiles(
                dk, dv_acc, k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, first,
                last, first2, last2, cols, d, dv, b, h, bhq, q_len, k_len, offset, slope2, scale,
                softcap, window_left, window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k,
                skp_b, D, Dv, Tq, Tk, dropout_p, HAS_MASK, MASK_IS_BOOL, False, HAS_LEFT,
                HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
                (part == 1) if MERGE_BOUNDARIES else (part != 1), PRECISION, DOT_IN_FP32,
                INTERPRETED, BLOCK_M, MERGE_BOUNDARIES and part == 1,
                PIPELINE and part == (0 if MERGE_BOUNDARIES else 1),
                SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
            )  # fmt: skip
    if HAS_KPM:
        # Key padding is applied here, once, not to every tile's scores: row j of dK and dV
        # depends on key j's scores alone, so a padded key's rows (whatever the loop made of
        # them, inf or NaN included) are replaced by 0. On sm_90 the loop then matches the
        # unpadded one (580 -> 474 instructions per iteration, spills 200 -> 44 B at D=128).
        dk = tl.where(real[:, None], dk, 0.0)
        dv_acc = tl.where(real[:, None], dv_acc, 0.0)
    tl.store(DK + b * sdk_b + hk * sdk_h + col_ptr[:, None] * sdk_t + d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=(cols < k_len)[:, None] & (d < D)[None, :])  # fmt: skip
    tl.store(DV + b * sdv_b + hk * sdv_h + col_ptr[:, None] * sdv_t + dv[None, :],
             dv_acc.to(DV.dtype.element_ty), mask=(cols < k_len)[:, None] & (dv < Dv)[None, :])  # fmt: skip


@triton.jit
def attention_bwd_dq(
    Q, K, V, Out, DO, LSE, DELTA, DQ, DMASK, MASK, KPM, KV_RANGE, SEED, SLOPES, SINKS, CU_Q,
    CU_K, DLSE,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t, sdo_b, sdo_h, sdo_t,
    sdq_b, sdq_h, sdq_t, slse_b, slse_h,
    sm_b, sm_h, sm_q, sm_k, skp_b, sal_b,
    H, Tq, Tk, D, Dv, group, num_m_blocks, scale, softcap, window_left, window_right,
    dropout_p,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BOTTOM_RIGHT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr, VARLEN: tl.constexpr,
    DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr, PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_SINKS: tl.constexpr = False, EXACT_DELTA: tl.constexpr = False,
    EXACT_DELTA_KEYS: tl.constexpr = 0, PIPELINE: tl.constexpr = False,
    BLOCK_SPARSE: tl.constexpr = False, LISTS=None, KINDS=None, BITS=None, sl_b=0, sl_h=0,
    sl_r=0, BS_Q: tl.constexpr = 128, BS_K: tl.constexpr = 128, BITS_IN_DOT: tl.constexpr = False,
    HAS_DLSE: tl.constexpr = False,
    SCORE_MOD: tl.constexpr = None, SCORE_MOD_GRAD: tl.constexpr = None, MOD_ARGS=None,
):  # fmt: skip
    """dq of one query block, the backward's first kernel (PIPELINE: the interior key tiles'
    loop rotated, _dq_tiles): it also computes the block's
    delta (the softmax-backward correction term, rowsum(P ∘ dP)) and stores it, laid out as
    lse, for the dk/dv kernel that runs next (no separate launch for it). With MASK_GRAD also
    dS, the gradient of the float mask, into a dense (B, H, Tq, Tk) fp32 buffer (padded
    batches only).

    delta is rowsum(dO ∘ O) from the stored output (flash-attention's choice: no extra pass),
    or with EXACT_DELTA (the launcher sets it for a float-mask gradient and for fp32 without
    TF32) rowsum(P ∘ dP) / rowsum(P) from a first pass over the keys, P as this backward
    recomputes it (the sink's share included). The quotient makes every row of dS sum to 0
    for the P the backward uses: where one key holds nearly all of a row's mass, dS is a
    small difference, and rowsum(dO ∘ O) carries the output's rounding (bf16: 2^-9 relative;
    fp32 at scale 2: dq 3-6x the naive fp32 error, issue #31) or an unnormalised sum the
    rounding of lse, both larger than that difference. EXACT_DELTA_KEYS > 0 (half
    precision): the exact delta also for a query block that sees at most that many keys (the
    first blocks of a causal or windowed call), where the extra pass is short and a row's mass
    most often sits on one or two keys: from the rounded output, the first rows' dq missed
    flash-attention's own tolerance (its packed-QKV test at T=200, D=32, causal with a
    window: 1.44x its bound, the worst element in row 1 of 200); see scripts/fa_tolerance.py.

    HAS_DLSE: the loss also reads the returned lse, whose gradient dlse (DLSE, laid out as
    lse) enters the row term: d lse_i / d s_ij = P_ij, so dS_ij = P_ij (dP_ij - delta_i +
    dlse_i), i.e. delta - dlse in place of delta, here and in the dk/dv kernel (which reads
    the stored delta) and the sinks' gradient."""
    bh, m_blk = _grid_block(tl.program_id(0), num_m_blocks, HAS_RIGHT)
    b = bh // H
    h = bh % H
    hk = h // group
    q_start, q_len, k_start, k_len = _seq_bounds(b, CU_Q, CU_K, Tq, Tk, VARLEN)
    offset = 0
    if BOTTOM_RIGHT:
        offset = k_len - q_len
    start_m = m_blk * BLOCK_M
    rows = start_m + tl.arange(0, BLOCK_M)
    row_ptr = (q_start + rows).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    inb = rows < q_len
    q = tl.load(Q + b * sq_b + h * sq_h + row_ptr[:, None] * sq_t + d[None, :],
                mask=inb[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
    do = tl.load(DO + b * sdo_b + h * sdo_h + row_ptr[:, None] * sdo_t + dv[None, :],
                 mask=inb[:, None] & (dv < Dv)[None, :], other=0.0)  # fmt: skip
    lse = tl.load(LSE + b * slse_b + h * slse_h + row_ptr, mask=inb, other=float("-inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    o = tl.load(Out + b * so_b + h * so_h + row_ptr[:, None] * so_t + dv[None, :],
                mask=inb[:, None] & (dv < Dv)[None, :], other=0.0)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    slope2 = 0.0
    if HAS_ALIBI:
        slope2 = tl.load(SLOPES + b * sal_b + h) * 1.4426950408889634
    K_head = K + b * sk_b + hk * sk_h + k_start * sk_t
    V_head = V + b * sv_b + hk * sv_h + k_start * sv_t
    DMASK_row = DMASK  # None unless MASK_GRAD
    if MASK_GRAD:
        DMASK_row = DMASK + bh * Tq * Tk
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, mid_lo, mid_hi, hi = _key_range(start_m, q_len, k_len, offset, window_left,
                                        window_right, HAS_LEFT, HAS_RIGHT, BLOCK_M, BLOCK_N)  # fmt: skip
    if HAS_KPM:
        lo, mid_lo, mid_hi, hi = _clip_to_valid_keys(lo, mid_lo, mid_hi, hi, KV_RANGE, b,
                                                     BLOCK_N)  # fmt: skip
    p_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    exact = EXACT_DELTA
    if not EXACT_DELTA and EXACT_DELTA_KEYS > 0:
        exact = hi - lo <= EXACT_DELTA_KEYS
    if exact:
        delta = tl.zeros([BLOCK_M], dtype=tl.float32)
        if HAS_SINKS:  # the sink's probability joins the normaliser (its value is 0)
            p_sum = tl.exp2(tl.load(SINKS + h).to(tl.float32) * 1.4426950408889634 - lse2)
        if BLOCK_SPARSE:
            dq, delta, p_sum = attention_blocks.dq_listed_blocks(
                dq, delta, p_sum, q, do, lse2, delta, K_head, V_head, sk_t, sv_t, lo, hi, rows,
                d, dv, DMASK_row, b, h, bh, q_len, k_len, Tk, offset, slope2,
                scale, softcap, window_left, window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q,
                sm_k, skp_b, D, Dv, Tq, Tk, dropout_p, start_m, LISTS, KINDS, BITS, sl_b, sl_h,
                sl_r, HAS_MASK, MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
                DROPOUT, True, False, PRECISION, DOT_IN_FP32, INTERPRETED, BLOCK_N, BS_Q, BS_K,
                SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
            )  # fmt: skip
        for part in tl.static_range(0 if BLOCK_SPARSE else 3):
            first, last = _part_bounds(part, lo, mid_lo, mid_hi, hi)
            dq, delta, p_sum = _dq_tiles(
                dq, delta, p_sum, q, do, lse2, delta, K_head, V_head, sk_t, sv_t, first, last, rows,
                d, dv, DMASK_row, b, h, bh, q_len, k_len, Tk, offset, slope2, scale, softcap,
                window_left, window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D,
                Dv, Tq, Tk, dropout_p, HAS_MASK, MASK_IS_BOOL, HAS_KPM and part != 1, HAS_LEFT,
                HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, part != 1, True, False, PRECISION,
                DOT_IN_FP32, INTERPRETED, BLOCK_N,
                SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
            )  # fmt: skip
        delta = tl.where(p_sum > 0.0, delta / tl.where(p_sum > 0.0, p_sum, 1.0), 0.0)
    if HAS_DLSE:
        delta -= tl.load(DLSE + b * slse_b + h * slse_h + row_ptr, mask=inb, other=0.0)
    tl.store(DELTA + b * slse_b + h * slse_h + row_ptr, delta, mask=inb)
    if BLOCK_SPARSE:  # the key blocks a block mask lists (attention_blocks.py)
        dq, delta, p_sum = attention_blocks.dq_listed_blocks(
            dq, delta, p_sum, q, do, lse2, delta, K_head, V_head, sk_t, sv_t, lo, hi, rows, d,
            dv, DMASK_row, b, h, bh, q_len, k_len, Tk, offset, slope2, scale,
            softcap, window_left, window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b,
            D, Dv, Tq, Tk, dropout_p, start_m, LISTS, KINDS, BITS, sl_b, sl_h, sl_r, HAS_MASK,
            MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, False,
            MASK_GRAD, PRECISION, DOT_IN_FP32, INTERPRETED, BLOCK_N, BS_Q, BS_K,
            SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
        )  # fmt: skip
    for part in tl.static_range(0 if BLOCK_SPARSE else 3):  # boundary, interior, boundary
        first, last = _part_bounds(part, lo, mid_lo, mid_hi, hi)
        dq, delta, p_sum = _dq_tiles(
            dq, delta, p_sum, q, do, lse2, delta, K_head, V_head, sk_t, sv_t, first, last, rows, d,
            dv, DMASK_row, b, h, bh, q_len, k_len, Tk, offset, slope2, scale, softcap,
            window_left, window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv,
            Tq, Tk, dropout_p, HAS_MASK, MASK_IS_BOOL, HAS_KPM and part != 1, HAS_LEFT,
            HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, part != 1, False, MASK_GRAD, PRECISION,
            DOT_IN_FP32, INTERPRETED, BLOCK_N, PIPELINE and part == 1,
            SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
        )  # fmt: skip
    tl.store(DQ + b * sdq_b + h * sdq_h + row_ptr[:, None] * sdq_t + d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=inb[:, None] & (d < D)[None, :])  # fmt: skip


@triton.jit
def key_padding_range(KPM, OUT, Tk, s_b, BLOCK: tl.constexpr):
    """The launcher's valid_key_range for batch row b = the program id: (first, end) of the
    keys that are not padding (end <= first when every key is) and 1 when every key in
    between is real, else 0, as int32 OUT[b, 0:3]. KPM is the (B, Tk) padding mask as bytes
    (non-zero = padding). One launch where the torch expression took ten small ops, which made
    a key-padded forward at T=1024 host-bound on the H200 (0.28 -> 0.57 ms back to back)."""
    b = tl.program_id(0).to(tl.int64)
    first = tl.full([BLOCK], 0, tl.int32) + Tk
    end = tl.zeros([BLOCK], tl.int32)
    count = tl.zeros([BLOCK], tl.int32)
    for start in range(0, Tk, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        inside = cols < Tk
        real = (tl.load(KPM + b * s_b + cols, mask=inside, other=1) == 0) & inside
        first = tl.minimum(first, tl.where(real, cols, Tk))
        end = tl.maximum(end, tl.where(real, cols + 1, 0))
        count += real.to(tl.int32)
    lo = tl.min(first, axis=0)
    hi = tl.max(end, axis=0)
    whole = tl.sum(count, axis=0) == tl.maximum(hi - lo, 0)
    tl.store(OUT + 3 * b, lo)
    tl.store(OUT + 3 * b + 1, hi)
    tl.store(OUT + 3 * b + 2, whole.to(tl.int32))
