"""Block-sparse key and query loops of the Triton attention (a `fusedattn.masks.BlockMask`):
the forward and dq visit the key blocks listed for their query block, dk/dv the query blocks
listed for their key block, and nothing else.

A block mask cuts (Q_LEN, KV_LEN) into BS_Q x BS_K blocks, each empty (not listed), full (every
query of it sees every key of it) or partial. Per (batch, head, block row) it lists the
visible blocks in ascending order, both orientations:

    LISTS[b, h, r, 0]      the number n of blocks listed for block row r
    LISTS[b, h, r, 1 + i]  the i-th listed block (i < n)
    KINDS[b, h, r, 1 + i]  -1 for a full block, else the partial block's number p

b and h strides are 0 where the mask broadcasts (built with B or H None). Partial block p's
bits are BITS[p] (BS_Q rows of BS_K / 32 int32 words; key j of row i is bit j % 32 of word
j // 32), read through _mask_tile's packed mode. Full and partial blocks run in one tile loop
per listed block: a full block's bit words are not loaded (_mask_tile's PARTIAL predicate: they
read as all ones), and every tile applies the positional mask (window, sequence bounds). The
four inlined loops this replaced (a partial block's, and a full block's three window parts)
spilled at the Hopper tiles; one loop spills nowhere (benchmarks/results/sm90-static/flex.csv).
A user's attn_mask in the same call is merged with the block mask by the launcher (a dense
mask the tiles read instead of the bits; the lists still skip).

The kernels' tiles divide the blocks (the launcher caps BLOCK_M at BS_Q and BLOCK_N at
BS_K), so a tile lies in one block, and every visited tile is one the mask lists.
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import attention_loops as loops


@triton.jit
def _bits_base(BITS, kind, q_block, BS_Q: tl.constexpr, BS_K: tl.constexpr):
    """BITS offset so that _mask_tile's packed mode reads row qi, key kj of partial block
    `kind` (whose first row is q_block * BS_Q and first key k_block * BS_K) at
    qi * WORDS + (kj & (BS_K - 1)) // 32, WORDS = (BS_K + 31) // 32 words a row (one for
    16 keys)."""
    WORDS: tl.constexpr = (BS_K + 31) // 32
    return BITS + (kind.to(tl.int64) * BS_Q - q_block.to(tl.int64) * BS_Q) * WORDS


@triton.jit
def fwd_listed_blocks(
    acc, l_i, m_i, q, K_head, V_head, sk_t, sv_t, lo, hi, rows, d, dv,
    b, h, hk, bh, q_len, k_len, offset, slope2, scale, softcap, window_left, window_right,
    MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv, Tq, Tk, dropout_p, start_m,
    LISTS, KINDS, BITS, sl_b, sl_h, sl_r,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr, MASK_IN_DOT: tl.constexpr,
    BITS_IN_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, BS_Q: tl.constexpr, BS_K: tl.constexpr, FP8: tl.constexpr,
    SCORE_MOD: tl.constexpr = None, MOD_ARGS=None,
):  # fmt: skip
    """attention._fwd_block's key loop over the listed key blocks of query block
    start_m // BS_Q, each clipped to the window's [lo, hi)."""
    WORDS: tl.constexpr = (BS_K + 31) // 32  # a partial block's words per row
    q_block = start_m // BS_Q
    row = b * sl_b + h * sl_h + q_block * sl_r
    n = tl.load(LISTS + row)
    for i in range(0, n):
        k_block = tl.load(LISTS + row + 1 + i)
        kind = tl.load(KINDS + row + 1 + i)
        first = tl.maximum(k_block * BS_K, lo)
        last = tl.minimum(k_block * BS_K + BS_K, hi)
        if HAS_MASK:  # the user's mask, merged with the block mask: every tile reads it
            acc, l_i, m_i = loops._fwd_tiles(
                acc, l_i, m_i, q, K_head, V_head, sk_t, sv_t, first, last, rows, d, dv,
                b, h, hk, bh, q_len, k_len, offset, slope2, scale, softcap, window_left,
                window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv, Tq, Tk,
                dropout_p, True, MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                HAS_ALIBI, DROPOUT, True, PRECISION, DOT_IN_FP32, INTERPRETED, 0, False,
                MASK_IN_DOT, BLOCK_N, BLOCK_D, BLOCK_DV, FP8,
                SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS,
            )  # fmt: skip
        else:  # partial blocks read their bits, full ones none (PARTIAL): one loop for both
            bits = _bits_base(BITS, tl.maximum(kind, 0), q_block, BS_Q, BS_K)
            acc, l_i, m_i = loops._fwd_tiles(
                acc, l_i, m_i, q, K_head, V_head, sk_t, sv_t, first, last, rows, d, dv,
                b, h, hk, bh, q_len, k_len, offset, slope2, scale, softcap, window_left,
                window_right, bits, KPM, SEED, 0, 0, WORDS, BS_K - 1, skp_b, D, Dv, Tq, Tk,
                dropout_p, True, 2, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
                True, PRECISION, DOT_IN_FP32, INTERPRETED, 0, False, BITS_IN_DOT, BLOCK_N,
                BLOCK_D, BLOCK_DV, FP8,
                SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS, PARTIAL=kind >= 0,
            )  # fmt: skip
    return acc, l_i, m_i


@triton.jit
def dq_listed_blocks(
    dq, delta_sum, p_sum, q, do, lse2, delta, K_head, V_head, sk_t, sv_t, lo, hi, rows, d, dv,
    DMASK_row, b, h, bh, q_len, k_len, Tk_dense, offset, slope2, scale, softcap, window_left,
    window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv, Tq, Tk, dropout_p,
    start_m, LISTS, KINDS, BITS, sl_b, sl_h, sl_r,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, DELTA_PASS: tl.constexpr,
    MASK_GRAD: tl.constexpr, PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BS_Q: tl.constexpr, BS_K: tl.constexpr,
    SCORE_MOD: tl.constexpr = None, SCORE_MOD_GRAD: tl.constexpr = None, MOD_ARGS=None,
):  # fmt: skip
    """attention_bwd_dq's key loops (the exact delta's pass with DELTA_PASS, then dq) over the
    listed key blocks of query block start_m // BS_Q."""
    WORDS: tl.constexpr = (BS_K + 31) // 32  # a partial block's words per row
    q_block = start_m // BS_Q
    row = b * sl_b + h * sl_h + q_block * sl_r
    n = tl.load(LISTS + row)
    for i in range(0, n):
        k_block = tl.load(LISTS + row + 1 + i)
        kind = tl.load(KINDS + row + 1 + i)
        first = tl.maximum(k_block * BS_K, lo)
        last = tl.minimum(k_block * BS_K + BS_K, hi)
        if HAS_MASK:
            dq, delta_sum, p_sum = loops._dq_tiles(
                dq, delta_sum, p_sum, q, do, lse2, delta, K_head, V_head, sk_t, sv_t, first,
                last, rows, d, dv, DMASK_row, b, h, bh, q_len, k_len, Tk_dense, offset, slope2,
                scale, softcap, window_left, window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q,
                sm_k, skp_b, D, Dv, Tq, Tk, dropout_p, True, MASK_IS_BOOL, HAS_KPM, HAS_LEFT,
                HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, True, DELTA_PASS, MASK_GRAD, PRECISION,
                DOT_IN_FP32, INTERPRETED, BLOCK_N,
                SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
            )  # fmt: skip
        else:
            bits = _bits_base(BITS, tl.maximum(kind, 0), q_block, BS_Q, BS_K)
            dq, delta_sum, p_sum = loops._dq_tiles(
                dq, delta_sum, p_sum, q, do, lse2, delta, K_head, V_head, sk_t, sv_t, first,
                last, rows, d, dv, DMASK_row, b, h, bh, q_len, k_len, Tk_dense, offset, slope2,
                scale, softcap, window_left, window_right, bits, KPM, SEED, 0, 0, WORDS, BS_K - 1,
                skp_b, D, Dv, Tq, Tk, dropout_p, True, 2, HAS_KPM, HAS_LEFT, HAS_RIGHT,
                SOFTCAP, HAS_ALIBI, DROPOUT, True, DELTA_PASS, False, PRECISION, DOT_IN_FP32,
                INTERPRETED, BLOCK_N,
                SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
                PARTIAL=kind >= 0,
            )  # fmt: skip
    return dq, delta_sum, p_sum


@triton.jit
def dkdv_listed_blocks(
    dk, dv_acc, k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, lo, hi, cols, d, dv,
    b, h, bhq, q_len, k_len, offset, slope2, scale, softcap, window_left, window_right, MASK,
    KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv, Tq, Tk, dropout_p, start_n, LISTS, KINDS,
    BITS, sl_b, sl_h, sl_r,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr, HAS_ALIBI: tl.constexpr,
    DROPOUT: tl.constexpr, PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BS_Q: tl.constexpr, BS_K: tl.constexpr,
    SCORE_MOD: tl.constexpr = None, SCORE_MOD_GRAD: tl.constexpr = None, MOD_ARGS=None,
):  # fmt: skip
    """attention_bwd_dkdv's query loop for query head h over the query blocks listed for key
    block start_n // BS_K (the mask's second orientation)."""
    WORDS: tl.constexpr = (BS_K + 31) // 32  # a partial block's words per row
    k_block = start_n // BS_K
    row = b * sl_b + h * sl_h + k_block * sl_r
    n = tl.load(LISTS + row)
    for i in range(0, n):
        q_block = tl.load(LISTS + row + 1 + i)
        kind = tl.load(KINDS + row + 1 + i)
        first = tl.maximum(q_block * BS_Q, lo)
        last = tl.minimum(q_block * BS_Q + BS_Q, hi)
        if HAS_MASK:
            dk, dv_acc = loops._dkdv_tiles(
                dk, dv_acc, k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, first,
                last, last, last, cols, d, dv, b, h, bhq, q_len, k_len, offset, slope2, scale,
                softcap, window_left, window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k,
                skp_b, D, Dv, Tq, Tk, dropout_p, True, MASK_IS_BOOL, False, HAS_LEFT, HAS_RIGHT,
                SOFTCAP, HAS_ALIBI, DROPOUT, True, PRECISION, DOT_IN_FP32, INTERPRETED, BLOCK_M,
                False,
                SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
            )  # fmt: skip
        else:
            bits = _bits_base(BITS, tl.maximum(kind, 0), q_block, BS_Q, BS_K)
            dk, dv_acc = loops._dkdv_tiles(
                dk, dv_acc, k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, first,
                last, last, last, cols, d, dv, b, h, bhq, q_len, k_len, offset, slope2, scale,
                softcap, window_left, window_right, bits, KPM, SEED, 0, 0, WORDS, BS_K - 1, skp_b,
                D, Dv, Tq, Tk, dropout_p, True, 2, False, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                HAS_ALIBI, DROPOUT, True, PRECISION, DOT_IN_FP32, INTERPRETED, BLOCK_M, False,
                SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
                PARTIAL=kind >= 0,
            )  # fmt: skip
    return dk, dv_acc
