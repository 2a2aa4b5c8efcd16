"""The attention kernels' tile loops and the helpers they share: scores, masks and key ranges
of a tile, the forward's online softmax over a run of key tiles, the backward's dK/dV and dQ
updates over runs of tiles. The dense kernels (attention.py) and the block-sparse loops over
listed blocks (attention_blocks.py) both call them, so the kernels' files import one way:
attention.py -> attention_blocks.py -> attention_loops.py (issue #82; they imported each
other). See attention.py for the layouts, masks and positions.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from .fp8 import round_to_fp8

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453

# ---- helpers ---------------------------------------------------------------------------------


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """a @ b with fp32 accumulation. DOT_IN_FP32 upcasts the operands first: the launcher sets
    it for bf16 in the CPU interpreter, whose bf16 tl.dot returns garbage (triton 3.8: an error
    of 2.5e10 on a 16x16 product, seen 2026-11-26); bf16 products are exact in fp32, so the
    result is what tensor cores give."""
    if DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _dot_acc(a, b, acc, PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """acc + a @ b, the sum taken by the dot itself (its accumulator input); as _dot."""
    if DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def _tanh(x, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """tanh of the softcap. Where the dots run at reduced precision (half inputs, or fp32 with
    TF32 allowed): 1 - 2 / (2^(2x log2 e) + 1) in fp32, one ex2 and one division, at most
    ~3e-7 absolute error (the logit's is softcap times that, far below what half inputs
    carry); on sm_90 the softcap loops drop from 2.8-3.6x to 1.7-2.2x the plain loops'
    instructions (benchmarks/results/sm90-static/). With PRECISION "ieee" (fp32, TF32 off):
    fp32-accurate libdevice on a GPU; the CPU interpreter has no libdevice, so there it is
    the same form in fp64 (fp64 keeps it accurate near 0)."""
    if PRECISION != "ieee":
        e = tl.exp2(x * 2.885390081777927)  # 2 log2(e); inf / 0 at the ends give +1 / -1
        return 1.0 - 2.0 / (e + 1.0)
    if INTERPRETED:
        e = tl.exp(2.0 * x.to(tl.float64))
        return (1.0 - 2.0 / (e + 1.0)).to(tl.float32)
    return libdevice.tanh(x)


@triton.jit
def _keep_scale(SEED, dropout_p, bh, qi, kj, Tq, Tk):
    """The dropout factor of each (query qi, key kj) pair: 0 or 1 / (1 - dropout_p). The
    Philox stream is indexed by (batch*head, query, key) with 64-bit offsets (the CUDA backend
    draws the same stream), so the backward regenerates exactly the forward's mask; qi and kj
    are broadcast to the tile in either orientation."""
    offsets = (bh * Tq + qi.to(tl.int64)) * Tk + kj
    keep = tl.rand(tl.load(SEED), offsets) >= dropout_p
    return tl.where(keep, 1.0 / (1.0 - dropout_p), 0.0)


@triton.jit
def _seq_bounds(b, CU_Q, CU_K, Tq, Tk, VARLEN: tl.constexpr):
    """(first row, length) of sequence b's queries and keys: the whole (padded) batch row, or
    its slice of a packed batch."""
    if VARLEN:
        q_start = tl.load(CU_Q + b).to(tl.int64)
        k_start = tl.load(CU_K + b).to(tl.int64)
        q_len = (tl.load(CU_Q + b + 1) - tl.load(CU_Q + b)).to(tl.int32)
        k_len = (tl.load(CU_K + b + 1) - tl.load(CU_K + b)).to(tl.int32)
    else:
        q_start = 0
        k_start = 0
        q_len = Tq
        k_len = Tk
    return q_start, q_len, k_start, k_len


@triton.jit
def _tile_scores(
    qk, qi, kj, b, q_len, k_len, offset, slope2, scale, softcap, window_left, window_right, m,
    KPM, skp_b, lse2,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, POSITIONAL: tl.constexpr, INTERPRETED: tl.constexpr,
    PRECISION: tl.constexpr, SCORE_MOD: tl.constexpr = None, MOD_ARGS=None, h=None,
):  # fmt: skip
    """log2-domain scores of a tile from its raw product qk = q·k (either orientation: qi and
    kj are the query and key indices broadcast to the tile's shape), and t = tanh(s / softcap)
    (the softcap's derivative is 1 - t^2; t is qk itself without softcap).

    scale, then softcap, then ALiBi (-slope·|p - j|) and the float mask m (the tile
    _mask_tile read) are added; -inf where a key is hidden: key padding, a bool mask (the
    backward applies its bool masks to P instead), and with POSITIONAL the window and the
    sequence bounds (interior tiles skip those: every row of the tile sees every key of it).
    lse2 (the backward: the rows' log2-sum-exp, broadcast; None in the forward) is subtracted
    right after the scale, so that the two fuse into one FFMA and each later term is one more
    (sm_90, D=128: float mask dq 443 -> 411 and dK/dV 638 -> 606 instructions per iteration,
    ALiBi 392 -> 374 and 668 -> 641; p = exp2(s) after it).

    SCORE_MOD (a generated score_mod function, fusedattn/score_mod/codegen.py; MOD_ARGS its
    captured tensors, h the query head): Flex's score_mod applied to scale·q·k first, then
    softcap and the rest as without it (_mod_indices: the indices it sees)."""
    if SCORE_MOD is not None:
        qi_m, kj_m = _mod_indices(qi, kj, q_len, k_len, POSITIONAL)
        qk = SCORE_MOD(qk * scale, b.to(tl.int32), h.to(tl.int32), qi_m, kj_m, MOD_ARGS)
        scale = 1.0
    t = qk
    if SOFTCAP:
        t = _tanh(qk * (scale / softcap), PRECISION, INTERPRETED)
        s = t * (softcap * 1.4426950408889634)
    else:
        s = qk * (scale * 1.4426950408889634)
    if lse2 is not None:
        s = s - lse2
    if HAS_ALIBI:
        s -= slope2 * tl.abs((qi + offset - kj).to(tl.float32))
    if POSITIONAL:
        keep = (qi < q_len) & (kj < k_len)
        if HAS_RIGHT:
            keep = keep & (kj <= qi + offset + window_right)
        if HAS_LEFT:
            keep = keep & (kj >= qi + offset - window_left)
        s = tl.where(keep, s, float("-inf"))
    if HAS_KPM:
        if POSITIONAL:
            pad = tl.load(KPM + b * skp_b + kj, mask=kj < k_len, other=1)
        else:  # interior tiles hold no key past the sequence end
            pad = tl.load(KPM + b * skp_b + kj)
        s = tl.where(pad == 0, s, float("-inf"))
    if HAS_MASK:
        if MASK_IS_BOOL:
            s = tl.where(m != 0, s, float("-inf"))
        else:
            s = s + m.to(tl.float32) * 1.4426950408889634
    return s, t


@triton.jit
def _mod_indices(qi, kj, q_len, k_len, POSITIONAL: tl.constexpr):
    """The query and key indices a score_mod sees: the tile's own, those past the sequence
    moved to its last row and key (their scores are hidden and their rows never stored), so
    that a mod indexing a (Q_LEN, KV_LEN) table never reads past it. On every tile, interior
    ones included (POSITIONAL is about the keys: the last query tile may still run past
    Q_LEN): the generated loads whose indices bounds.py proves inside the tensor for indices
    in [0, Q_LEN) x [0, KV_LEN) carry no bounds mask."""
    return tl.minimum(qi, q_len - 1), tl.minimum(kj, k_len - 1)


@triton.jit
def _mod_grad(ds, qk, scale, b, h, qi, kj, q_len, k_len, MOD_ARGS, SCORE_MOD_GRAD: tl.constexpr,
              POSITIONAL: tl.constexpr):  # fmt: skip
    """dS of scale·q·k from dS of the modified score: through the score_mod's derivative
    (SCORE_MOD_GRAD: codegen.py's score_mod_grad in the dq kernel, which also adds the
    captured tensors' gradients, score_mod_dscore in dK/dV's)."""
    qi_m, kj_m = _mod_indices(qi, kj, q_len, k_len, POSITIONAL)
    inside = (qi < q_len) & (kj < k_len)  # no gradient from past the sequence (any tile)
    return SCORE_MOD_GRAD(qk * scale, b.to(tl.int32), h.to(tl.int32), qi_m, kj_m, MOD_ARGS, ds,
                          inside)  # fmt: skip


@triton.jit
def _mask_tile(MASK, b, h, qi, kj, q_len, k_len, sm_b, sm_h, sm_q, sm_k,
               POSITIONAL: tl.constexpr, MASK_IS_BOOL: tl.constexpr = False, PARTIAL=None):  # fmt: skip
    """The attn_mask's entries at query rows qi and keys kj (broadcast to the tile's shape),
    0 outside [0, q_len) x [0, k_len) on boundary tiles (POSITIONAL). Interior tiles read
    without bounds, so the loads carry no predicate and the tile no select after them: the
    caller passes rows clamped into the sequence where its block runs past the end (forward,
    dq: those rows are never stored), and interior key or query tiles are whole.

    MASK_IS_BOOL == 2: a block mask's partial block, packed 32 keys to an int32 word (bit
    j % 32 of word j // 32 of row i, j the key's offset in its block; attention_blocks.py):
    MASK is offset so that row qi is words qi * sm_q on, and sm_k is the block's width - 1
    (a power of two), so kj & sm_k is the offset (a 16-key block: the low bits of one word).
    PARTIAL (a runtime bool, or None): False for a full block, whose words are not read and
    every bit is 1 (attention_blocks.py runs full and partial blocks in one loop); where it
    is given, entries outside the sequence read as 1 too (the positional mask hides them)."""
    if MASK_IS_BOOL == 2:
        local = kj & sm_k
        ptrs = MASK + qi.to(tl.int64) * sm_q + (local >> 5)
        if PARTIAL is not None:
            words = tl.load(ptrs, mask=(qi < q_len) & (kj < k_len) & PARTIAL, other=-1)
        elif POSITIONAL:
            words = tl.load(ptrs, mask=(qi < q_len) & (kj < k_len), other=0)
        else:
            words = tl.load(ptrs)
        return (words >> (local & 31)) & 1
    ptrs = MASK + b * sm_b + h * sm_h + qi.to(tl.int64) * sm_q + kj.to(tl.int64) * sm_k
    if POSITIONAL:
        return tl.load(ptrs, mask=(qi < q_len) & (kj < k_len), other=0)
    return tl.load(ptrs)


@triton.jit
def _key_keep(cols, k_len, dv, Dv, KPM, b, skp_b, HAS_KPM: tl.constexpr,
              POSITIONAL: tl.constexpr):  # fmt: skip
    """(BLOCK_N, BLOCK_DV) mask of the value (or, given d and D, key) rows to read: inside the
    head dim, inside the sequence (boundary tiles only: interior tiles are whole), not padding
    (a padded key never contributes, even a NaN in it)."""
    keep = (dv < Dv)[None, :]
    if POSITIONAL:
        keep = keep & (cols < k_len)[:, None]
    if HAS_KPM:
        if POSITIONAL:
            pad = tl.load(KPM + b * skp_b + cols, mask=cols < k_len, other=1)
        else:
            pad = tl.load(KPM + b * skp_b + cols)
        keep = keep & (pad == 0)[:, None]
    return keep


@triton.jit
def _tile_split(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """Rows (or columns) [lo, hi) that see something, of which [full_lo, full_hi) see
    everything, cut at multiples of BLOCK: -> (lo, mid_lo, mid_hi, hi) with lo a multiple of
    BLOCK, [mid_lo, mid_hi) the whole tiles inside [full_lo, full_hi), and
    lo <= mid_lo <= mid_hi <= hi (empty parts when nothing is seen)."""
    lo = tl.minimum(lo // BLOCK * BLOCK, tl.maximum(hi, 0))
    hi = tl.maximum(hi, lo)
    mid_lo = tl.minimum(tl.maximum(tl.cdiv(full_lo, BLOCK) * BLOCK, lo), hi)
    mid_hi = tl.maximum(tl.minimum(tl.maximum(full_hi, 0) // BLOCK * BLOCK, hi), mid_lo)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _key_range(start_m, q_len, k_len, offset, window_left, window_right,
               HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr):  # fmt: skip
    """Key tiles of the query block at start_m: [lo, hi) holds every key some row sees (lo a
    multiple of BLOCK_N); [mid_lo, mid_hi) the full tiles that every row sees whole. Empty
    when the block starts past the sequence."""
    p_first = start_m + offset
    p_last = tl.minimum(start_m + BLOCK_M, q_len) - 1 + offset
    lo = 0
    hi = k_len
    full_lo = 0
    full_hi = k_len
    if HAS_LEFT:
        lo = tl.maximum(p_first - window_left, 0)
        full_lo = tl.maximum(p_last - window_left, 0)
    if HAS_RIGHT:
        hi = tl.minimum(p_last + window_right + 1, k_len)
        full_hi = tl.minimum(p_first + window_right + 1, k_len)
    hi = tl.where(start_m < q_len, hi, 0)
    return _tile_split(lo, full_lo, full_hi, hi, BLOCK_N)


@triton.jit
def _query_range(start_n, q_len, k_len, offset, window_left, window_right,
                 HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):  # fmt: skip
    """Query tiles that see the key block at start_n: [lo, hi) holds every row that sees some
    of its keys (lo a multiple of BLOCK_M); [mid_lo, mid_hi) the full query tiles whose rows
    all see every key of the block (none when the key block is cut by the sequence end)."""
    k_last = tl.minimum(start_n + BLOCK_N, k_len) - 1
    lo = 0
    hi = q_len
    full_lo = 0
    full_hi = q_len
    if HAS_RIGHT:  # row i sees key j only if j <= i + offset + right
        lo = tl.maximum(start_n - window_right - offset, 0)
        full_lo = tl.maximum(k_last - window_right - offset, 0)
    if HAS_LEFT:  # ... and j >= i + offset - left
        hi = tl.minimum(k_last + window_left - offset + 1, q_len)
        full_hi = tl.minimum(start_n + window_left - offset + 1, q_len)
    hi = tl.where(start_n < k_len, hi, 0)
    full_hi = tl.where(start_n + BLOCK_N <= k_len, full_hi, 0)
    return _tile_split(lo, full_lo, full_hi, hi, BLOCK_M)


@triton.jit
def _clip_to_valid_keys(lo, mid_lo, mid_hi, hi, KV_RANGE, b, BLOCK_N: tl.constexpr):
    """With key padding: the key range cut to [first, end) of the keys that are not padding in
    batch row b (KV_RANGE, from the launcher), so tiles that hold only padding are never read
    (a right-padded batch with lengths in [T/2, T] skips a quarter of them). The interior part
    then keeps only whole tiles inside [first, end) when every key there is real (padding at
    either end, as tokenizers pad): it reads no key-padding mask (on sm_90 the forward's
    interior loop 517 -> 419 instructions at D=128, as without padding's 416; dQ's 555 -> 386).
    With holes in the padding every tile takes a boundary loop, which reads the mask."""
    first = tl.load(KV_RANGE + 3 * b)
    end = tl.load(KV_RANGE + 3 * b + 1)
    contiguous = tl.load(KV_RANGE + 3 * b + 2) != 0
    hi = tl.minimum(hi, end)
    lo = tl.minimum(tl.maximum(lo, first // BLOCK_N * BLOCK_N), tl.maximum(hi, 0))
    hi = tl.maximum(hi, lo)
    whole_lo = tl.where(contiguous, tl.cdiv(first, BLOCK_N) * BLOCK_N, hi)
    whole_hi = tl.where(contiguous, end // BLOCK_N * BLOCK_N, hi)
    mid_lo = tl.minimum(tl.maximum(tl.maximum(mid_lo, whole_lo), lo), hi)
    mid_hi = tl.minimum(tl.maximum(tl.minimum(mid_hi, whole_hi), mid_lo), hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit
def _tile_start(lo, hi, BLOCK: tl.constexpr):
    """The tile range [lo, hi) with lo in a form whose divisibility the compiler sees, for
    loops that load the dense mask along the loop's index. A range that holds tiles starts on
    a multiple of BLOCK, but through the min/max of the range split the compiler cannot tell,
    and tl.multiple_of on a loop variable is lost (no defining op to carry it): the mask's
    addresses then had unknown alignment and its loads went to single bytes outside the
    cp.async pipeline. On sm_90 (Triton 3.6, D=128) the dq loop with a bool mask and causal:
    851 -> 527 instructions per iteration, 156 B of spills -> none; the forward's likewise
    (benchmarks/results/sm90-static/). An empty range may start anywhere (at the end of the
    one before it): it stays empty. Loops without a mask keep their bounds: the rounding moved
    their SASS by a few percent either way."""
    start = lo // BLOCK * BLOCK
    return start, tl.where(lo < hi, hi, start)


@triton.jit
def _part_bounds(part: tl.constexpr, lo, mid_lo, mid_hi, hi):
    """Tile range of loop part 0 (leading boundary), 1 (interior: no positional mask) or 2
    (trailing boundary) of a [lo, mid_lo) + [mid_lo, mid_hi) + [mid_hi, hi) split."""
    first = mid_hi
    last = hi
    if part == 0:
        first = lo
        last = mid_lo
    if part == 1:
        first = mid_lo
        last = mid_hi
    return first, last


@triton.jit
def _grid_block(pid, num_blocks, LONGEST_FIRST: tl.constexpr):
    """(batch*head, block) of a flattened program id: the blocks of one head are adjacent,
    and with LONGEST_FIRST (a right window bound, as causal) the last query blocks, which
    see the most keys, start first."""
    bh = pid // num_blocks
    blk = pid % num_blocks
    if LONGEST_FIRST:
        blk = num_blocks - 1 - blk
    return bh.to(tl.int64), blk


@triton.jit
def _tile_order(tile, num_tiles, num_blocks, LONGEST_FIRST: tl.constexpr):
    """(batch*head, block) of the tile-th query block of a persistent forward. LONGEST_FIRST:
    every head's last block (the most keys under causal), then every head's second to last,
    ...: programs taking tiles num_programs apart start on the longest and end on the
    shortest. Otherwise the blocks of one head are adjacent, as _grid_block's."""
    if LONGEST_FIRST:
        num_bh = num_tiles // num_blocks
        return (tile % num_bh).to(tl.int64), num_blocks - 1 - tile // num_bh
    return (tile // num_blocks).to(tl.int64), tile % num_blocks


# ---- forward ---------------------------------------------------------------------------------


@triton.jit
def _fwd_scores(
    q, K_head, sk_t, start_n, rows, d, b, h, hk, q_len, k_len, offset, slope2, scale, softcap,
    window_left, window_right, MASK, KPM, sm_b, sm_h, sm_q, sm_k, skp_b, D,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, POSITIONAL: tl.constexpr, PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr, USE_TMA: tl.constexpr,
    MASK_IN_DOT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SCORE_MOD: tl.constexpr = None, MOD_ARGS=None, PARTIAL=None,
):  # fmt: skip
    """log2-domain scores of the key tile at start_n. USE_TMA: K_head is the (B, Hkv, Tk, D)
    tensor descriptor, whose copies zero-fill past Tk and D (no bounds masks); 2: this
    head's (k_len, D) descriptor made in the kernel (WARP_SPEC); otherwise a pointer to this
    head's row 0.

    MASK_IN_DOT (attn_mask without softcap, scale != 0: the launcher decides): the mask enters
    as the dot's accumulator, mask / scale (a bool mask as 0 / -inf), so q·k + mask / scale
    times scale is the masked score. Added after the dot instead, on sm_90 (Triton 3.6) with
    causal or key padding beside it, the compiler kept the softmax's row statistics in two
    layouts and computed every exp2 twice: 2381 instructions per iteration and 1.4 KB of
    spills at D=128 against 850 and none this way (benchmarks/results/sm90-static/). A finite
    mask value below -3.4e38 * |scale| overflows to -inf here (added after the dot: below
    -2.4e38, through log2(e)): a row whose every key has one gives 0, where float64 averages
    them. Keeping it finite cost ~25 % more instructions per masked iteration."""
    cols = start_n + tl.arange(0, BLOCK_N)
    if USE_TMA == 2:  # the head's own (Tk, D) descriptor, made in the kernel
        kt = tl.trans(K_head.load([start_n, 0]))
    elif USE_TMA:
        at = [b.to(tl.int32), hk.to(tl.int32), start_n, 0]  # 32-bit coordinates
        kt = tl.trans(K_head.load(at).reshape(BLOCK_N, BLOCK_D))
    else:
        k_keep = (d < D)[:, None]
        if POSITIONAL:  # interior tiles are whole: no bounds to check
            k_keep = k_keep & (cols < k_len)[None, :]
        kt = tl.load(K_head + cols[None, :].to(tl.int64) * sk_t + d[:, None], mask=k_keep,
                     other=0.0)  # fmt: skip
    m = 0.0
    if HAS_MASK:  # rows past the end read the last row's mask
        m = _mask_tile(MASK, b, h, tl.minimum(rows, q_len - 1)[:, None], cols[None, :], q_len,
                       k_len, sm_b, sm_h, sm_q, sm_k, POSITIONAL, MASK_IS_BOOL, PARTIAL)  # fmt: skip
    if MASK_IN_DOT:
        inv_scale = 1.0 / scale  # a scalar: one division per tile, a multiply per element
        if MASK_IS_BOOL:
            # one select per entry (the product outside it: bool mask 601 -> 569 instructions
            # per iteration on sm_90 at D=128)
            bias = tl.where(m != 0, 0.0, float("-inf") * inv_scale)
        else:
            bias = m.to(tl.float32) * inv_scale
        qk = _dot_acc(q, kt, bias, PRECISION, DOT_IN_FP32)
    else:
        qk = _dot(q, kt, PRECISION, DOT_IN_FP32)
    s, _ = _tile_scores(
        qk, rows[:, None], cols[None, :], b, q_len, k_len, offset, slope2, scale, softcap,
        window_left, window_right, m, KPM, skp_b, None, HAS_MASK and not MASK_IN_DOT, MASK_IS_BOOL,
        HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, POSITIONAL, INTERPRETED, PRECISION,
        SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS, h=h,
    )  # fmt: skip
    return s


@triton.jit
def _fwd_softmax(s, acc, l_i, m_i, P_SHIFT: tl.constexpr = 0.0):
    """One tile's online-softmax step: its probabilities p = 2^(s - m + P_SHIFT) against the
    new running max m, the running sum l and the accumulator rescaled to m (P·V not yet
    added). P_SHIFT (fp8) scales p by a power of two, folded into the row's subtraction."""
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - (m_safe - P_SHIFT)[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    return p, acc * alpha[:, None], l_i, m_new


@triton.jit
def _fwd_pv(
    acc, p, V_head, sv_t, start_n, rows, dv, b, hk, bh, k_len, KPM, SEED, skp_b, Dv, Tq, Tk,
    dropout_p, HAS_KPM: tl.constexpr, DROPOUT: tl.constexpr, POSITIONAL: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, FP8: tl.constexpr = False,
    INTERPRETED: tl.constexpr = False,
):  # fmt: skip
    """acc + P·V for the key tile at start_n (dropout applied to p here: the normaliser keeps
    the undropped mass). FP8: p rounded to V's float8_e4m3fn for an fp8 product (in the
    interpreter onto the fp8 grid in fp32 first: its own conversion misrounds)."""
    cols = start_n + tl.arange(0, BLOCK_N)
    if USE_TMA:
        if USE_TMA == 2:  # the head's own (Tk, Dv) descriptor (WARP_SPEC)
            v = V_head.load([start_n, 0])
        else:
            v = V_head.load([b.to(tl.int32), hk.to(tl.int32), start_n, 0])
            v = v.reshape(BLOCK_N, BLOCK_DV)
        if HAS_KPM:  # a padded key never contributes, even a NaN in its value
            keep = _key_keep(cols, k_len, dv, Dv, KPM, b, skp_b, HAS_KPM, POSITIONAL)
            v = tl.where(keep, v, 0.0)
    else:
        v_keep = _key_keep(cols, k_len, dv, Dv, KPM, b, skp_b, HAS_KPM, POSITIONAL)
        v = tl.load(V_head + cols[:, None].to(tl.int64) * sv_t + dv[None, :], mask=v_keep,
                    other=0.0)  # fmt: skip
    if DROPOUT:
        p = p * _keep_scale(SEED, dropout_p, bh, rows[:, None], cols[None, :], Tq, Tk)
    if FP8 and INTERPRETED:
        p = round_to_fp8(p, False)
    return acc + _dot(p.to(v.dtype), v, PRECISION, DOT_IN_FP32)


@triton.jit
def _fwd_tiles(
    acc, l_i, m_i, q, K_head, V_head, sk_t, sv_t, lo, hi, rows, d, dv,
    b, h, hk, bh, q_len, k_len, offset, slope2, scale, softcap, window_left, window_right,
    MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv, Tq, Tk, dropout_p,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, POSITIONAL: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr,
    USE_TMA: tl.constexpr, PIPELINE: tl.constexpr, MASK_IN_DOT: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    FP8: tl.constexpr = False, WARP_SPEC: tl.constexpr = False,
    SCORE_MOD: tl.constexpr = None, MOD_ARGS=None, PARTIAL=None,
):  # fmt: skip
    """The online-softmax update of key tiles [lo, hi) (FP8: see attention_fwd; WARP_SPEC:
    the loop warp-specialized, see Tiles).

    PIPELINE: tile j's softmax runs in the iteration that issues tile j+1's Q·K^T, and its P·V
    is issued last, so neither product is waited on before the softmax that does not need it.
    On sm_90 (Triton 3.6) the SASS then issues tile j's exp2 between the next tile's wgmma and
    the wait for it, and P·V stays in flight across the back edge; without it the softmax runs
    with no product in flight. The scores of one tile stay live across an iteration (D=128,
    128x64/8 warps: 170 -> 215 registers, 173 with TMA; benchmarks/results/sm90-static/).
    Carrying the raw product q·k instead of the scores made ptxas serialize every wgmma (it
    copies the in-flight accumulator at the back edge: C7514)."""
    if HAS_MASK:
        lo, hi = _tile_start(lo, hi, BLOCK_N)
    if PIPELINE:
        if lo < hi:
            s = _fwd_scores(
                q, K_head, sk_t, lo, rows, d, b, h, hk, q_len, k_len, offset, slope2, scale,
                softcap, window_left, window_right, MASK, KPM, sm_b, sm_h, sm_q, sm_k, skp_b,
                D, HAS_MASK, MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
                POSITIONAL, PRECISION, DOT_IN_FP32, INTERPRETED, USE_TMA, MASK_IN_DOT, BLOCK_N,
                BLOCK_D,
                SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS, PARTIAL=PARTIAL,
            )  # fmt: skip
            for start_n in range(lo + BLOCK_N, hi, BLOCK_N):
                start_n = tl.multiple_of(start_n, BLOCK_N)
                s_next = _fwd_scores(
                    q, K_head, sk_t, start_n, rows, d, b, h, hk, q_len, k_len, offset,
                    slope2, scale, softcap, window_left, window_right, MASK, KPM, sm_b, sm_h,
                    sm_q, sm_k, skp_b, D, HAS_MASK, MASK_IS_BOOL, HAS_KPM, HAS_LEFT,
                    HAS_RIGHT, SOFTCAP, HAS_ALIBI, POSITIONAL, PRECISION, DOT_IN_FP32,
                    INTERPRETED, USE_TMA, MASK_IN_DOT, BLOCK_N, BLOCK_D,
                    SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS, PARTIAL=PARTIAL,
                )  # fmt: skip
                p, acc, l_i, m_i = _fwd_softmax(s, acc, l_i, m_i, 8.0 if FP8 else 0.0)
                acc = _fwd_pv(
                    acc, p, V_head, sv_t, start_n - BLOCK_N, rows, dv, b, hk, bh, k_len, KPM,
                    SEED, skp_b, Dv, Tq, Tk, dropout_p, HAS_KPM, DROPOUT, POSITIONAL,
                    PRECISION, DOT_IN_FP32, USE_TMA, BLOCK_N, BLOCK_DV, FP8, INTERPRETED,
                )  # fmt: skip
                s = s_next
            last = lo + (hi - lo - 1) // BLOCK_N * BLOCK_N  # the loop's last start_n
            p, acc, l_i, m_i = _fwd_softmax(s, acc, l_i, m_i, 8.0 if FP8 else 0.0)
            acc = _fwd_pv(
                acc, p, V_head, sv_t, last, rows, dv, b, hk, bh, k_len, KPM, SEED, skp_b, Dv,
                Tq, Tk, dropout_p, HAS_KPM, DROPOUT, POSITIONAL, PRECISION, DOT_IN_FP32,
                USE_TMA, BLOCK_N, BLOCK_DV, FP8, INTERPRETED,
            )  # fmt: skip
    else:
        for start_n in tl.range(lo, hi, BLOCK_N, warp_specialize=WARP_SPEC):
            start_n = tl.multiple_of(start_n, BLOCK_N)  # loops start on tile boundaries
            s = _fwd_scores(
                q, K_head, sk_t, start_n, rows, d, b, h, hk, q_len, k_len, offset, slope2,
                scale, softcap, window_left, window_right, MASK, KPM, sm_b, sm_h, sm_q, sm_k,
                skp_b, D, HAS_MASK, MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP,
                HAS_ALIBI, POSITIONAL, PRECISION, DOT_IN_FP32, INTERPRETED, USE_TMA,
                MASK_IN_DOT, BLOCK_N, BLOCK_D,
                SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS, PARTIAL=PARTIAL,
            )  # fmt: skip
            p, acc, l_i, m_i = _fwd_softmax(s, acc, l_i, m_i, 8.0 if FP8 else 0.0)
            acc = _fwd_pv(
                acc, p, V_head, sv_t, start_n, rows, dv, b, hk, bh, k_len, KPM, SEED, skp_b,
                Dv, Tq, Tk, dropout_p, HAS_KPM, DROPOUT, POSITIONAL, PRECISION, DOT_IN_FP32,
                USE_TMA, BLOCK_N, BLOCK_DV, FP8, INTERPRETED,
            )  # fmt: skip
    return acc, l_i, m_i


# ---- backward --------------------------------------------------------------------------------


@triton.jit
def _dkdv_products(
    k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, start_m, d, dv, q_len, D, Dv,
    POSITIONAL: tl.constexpr, PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, WITH_DP: tl.constexpr = True, WITH_S: tl.constexpr = True,
):  # fmt: skip
    """Query tile start_m's operands for one key block and its two products with them: Sᵀ =
    K·Qᵀ (scores, transposed; WITH_S) and dPᵀ = V·dOᵀ (WITH_DP) (_dkdv_tiles); a product
    not asked for comes back as 0."""
    start_m = tl.multiple_of(start_m, BLOCK_M)  # every range starts on a tile boundary
    rows = start_m + tl.arange(0, BLOCK_M)
    row_ptr = rows.to(tl.int64)
    if POSITIONAL:
        inb = rows < q_len
        qt = tl.load(Q_head + row_ptr[None, :] * sq_t + d[:, None],
                     mask=inb[None, :] & (d < D)[:, None], other=0.0)  # fmt: skip
        do = tl.load(DO_head + row_ptr[:, None] * sdo_t + dv[None, :],
                     mask=inb[:, None] & (dv < Dv)[None, :], other=0.0)  # fmt: skip
        # rows that saw no key (and rows past the end) have lse -inf: p must be exactly 0
        lse = tl.load(LSE_head + row_ptr, mask=inb, other=float("-inf"))
        delta = tl.load(DELTA_head + row_ptr, mask=inb, other=0.0)
    else:  # interior query tiles are whole
        qt = tl.load(Q_head + row_ptr[None, :] * sq_t + d[:, None], mask=(d < D)[:, None],
                     other=0.0)  # fmt: skip
        do = tl.load(DO_head + row_ptr[:, None] * sdo_t + dv[None, :],
                     mask=(dv < Dv)[None, :], other=0.0)  # fmt: skip
        lse = tl.load(LSE_head + row_ptr)
        delta = tl.load(DELTA_head + row_ptr)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    qkt = 0.0
    if WITH_S:
        qkt = _dot(k, qt, PRECISION, DOT_IN_FP32)
    dpt = 0.0
    if WITH_DP:
        dpt = _dot(v, tl.trans(do), PRECISION, DOT_IN_FP32)
    return rows, qt, do, lse2, delta, qkt, dpt


@triton.jit
def _dkdv_update(
    dk, dv_acc, rows, qt, do, lse2, delta, qkt, dpt, cols, b, h, bhq, q_len, k_len, offset,
    slope2, scale, softcap, window_left, window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k,
    skp_b, Tq, Tk, dropout_p,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, POSITIONAL: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr,
    SCORE_MOD: tl.constexpr = None, SCORE_MOD_GRAD: tl.constexpr = None, MOD_ARGS=None,
    PARTIAL=None,
):  # fmt: skip
    """One query tile's dk, dv contributions from its products (_dkdv_products): Pᵀ
    recomputed from the scores and the row lse, dV += Pᵀ·dO, dSᵀ = Pᵀ ∘ (dPᵀ - delta),
    dK += dSᵀ·Q."""
    m = 0.0
    if HAS_MASK:  # (interior query tiles are whole, and so is an interior key block)
        m = _mask_tile(MASK, b, h, rows[None, :], cols[:, None], q_len, k_len, sm_b, sm_h,
                       sm_q, sm_k, POSITIONAL, MASK_IS_BOOL, PARTIAL)  # fmt: skip
    st, t = _tile_scores(
        qkt, rows[None, :], cols[:, None], b, q_len, k_len, offset, slope2, scale, softcap,
        window_left, window_right, m, KPM, skp_b, lse2[None, :], HAS_MASK and not MASK_IS_BOOL,
        MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, POSITIONAL,
        INTERPRETED, PRECISION, SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS, h=h,
    )  # fmt: skip
    pt = tl.exp2(st)
    if HAS_MASK and MASK_IS_BOOL:  # on P, not the scores: see _dq_tiles
        pt = tl.where(m != 0, pt, 0.0)
    pt_used = pt
    if DROPOUT:  # the forward's mask again: 0 or 1 / (1 - dropout_p) per entry
        kept = _keep_scale(SEED, dropout_p, bhq, rows[None, :], cols[:, None], Tq, Tk)
        pt_used = pt * kept
        dpt = dpt * kept
    dv_acc += _dot(pt_used.to(do.dtype), do, PRECISION, DOT_IN_FP32)
    dst = pt * (dpt - delta[None, :])
    if SOFTCAP:
        dst = dst * (1.0 - t * t)
    if SCORE_MOD is not None:
        dst = _mod_grad(dst, qkt, scale, b, h, rows[None, :], cols[:, None], q_len, k_len,
                        MOD_ARGS, SCORE_MOD_GRAD, POSITIONAL)  # fmt: skip
    dk += _dot(dst.to(qt.dtype), tl.trans(qt), PRECISION, DOT_IN_FP32)
    return dk, dv_acc


@triton.jit
def _dkdv_tiles(
    dk, dv_acc, k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, lo, hi, lo2, hi2,
    cols, d, dv, b, h, bhq, q_len, k_len, offset, slope2, scale, softcap, window_left,
    window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv, Tq, Tk, dropout_p,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, POSITIONAL: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_M: tl.constexpr, TWO_RANGES: tl.constexpr, PIPELINE: tl.constexpr = False,
    SCORE_MOD: tl.constexpr = None, SCORE_MOD_GRAD: tl.constexpr = None, MOD_ARGS=None,
    PARTIAL=None,
):  # fmt: skip
    """dk, dv contributions of query tiles [lo, hi), then with TWO_RANGES [lo2, hi2) in the
    same loop (Tiles.merge), computed transposed (Sᵀ = K·Qᵀ, keys along rows) so that Pᵀ and
    dSᵀ feed the dk/dv products without register transposes.

    PIPELINE (Tiles.pipeline on dkdv; one range): tile j+1's scores Sᵀ are issued before tile
    j's softmax recomputation, dPᵀ and dV/dK products, so the exp2 of one tile can run while
    the tensor cores work on the next (the forward's rotation, _fwd_tiles); tile j's q and dO
    are loaded again for its own products. The same products and updates: the interpreter
    gives the plain loop's bits."""
    if PIPELINE:
        if lo < hi:
            rows, qt, _do_unused, lse2, _delta_unused, qkt, _dpt_unused = _dkdv_products(
                k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, lo, d, dv, q_len, D,
                Dv, POSITIONAL, PRECISION, DOT_IN_FP32, BLOCK_M, False,
            )  # fmt: skip
            for start_m in range(lo + BLOCK_M, hi, BLOCK_M):
                rows_n, _qt_n, _do_n, lse2_n, _delta_n, qkt_n, _dpt_n = _dkdv_products(
                    k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, start_m, d, dv,
                    q_len, D, Dv, POSITIONAL, PRECISION, DOT_IN_FP32, BLOCK_M, False,
                )  # fmt: skip
                # this tile's q and dO again (an L2 hit) rather than kept across the product
                # in flight: kept, the loop spilled 1.0-5.4 KB (benchmarks/results/sm90-static/)
                _rows_again, qt, do, _lse2_again, delta, _qkt_none, dpt = _dkdv_products(
                    k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t,
                    start_m - BLOCK_M, d, dv, q_len, D, Dv, POSITIONAL, PRECISION,
                    DOT_IN_FP32, BLOCK_M, True, False,
                )  # fmt: skip
                dk, dv_acc = _dkdv_update(
                    dk, dv_acc, rows, qt, do, lse2, delta, qkt, dpt, cols, b, h, bhq, q_len,
                    k_len, offset, slope2, scale, softcap, window_left, window_right, MASK, KPM,
                    SEED, sm_b, sm_h, sm_q, sm_k, skp_b, Tq, Tk, dropout_p, HAS_MASK,
                    MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT,
                    POSITIONAL, PRECISION, DOT_IN_FP32, INTERPRETED,
                    SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
                    PARTIAL=PARTIAL,
                )  # fmt: skip
                rows, lse2, qkt = rows_n, lse2_n, qkt_n
            last = lo + (hi - lo - 1) // BLOCK_M * BLOCK_M  # the loop's last start_m
            _rows_last, qt, do, _lse2_last, delta, _qkt_last, dpt = _dkdv_products(
                k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, last, d, dv, q_len,
                D, Dv, POSITIONAL, PRECISION, DOT_IN_FP32, BLOCK_M, True, False,
            )  # fmt: skip
            dk, dv_acc = _dkdv_update(
                dk, dv_acc, rows, qt, do, lse2, delta, qkt, dpt, cols, b, h, bhq, q_len, k_len,
                offset, slope2, scale, softcap, window_left, window_right, MASK, KPM, SEED,
                sm_b, sm_h, sm_q, sm_k, skp_b, Tq, Tk, dropout_p, HAS_MASK, MASK_IS_BOOL,
                HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, POSITIONAL,
                PRECISION, DOT_IN_FP32, INTERPRETED,
                SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
                PARTIAL=PARTIAL,
            )  # fmt: skip
        return dk, dv_acc
    if TWO_RANGES:
        n_first = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M)
        n_tiles = n_first + tl.cdiv(tl.maximum(hi2 - lo2, 0), BLOCK_M)
        end = n_tiles * BLOCK_M
    else:
        end = hi
    for start_m in range(lo if not TWO_RANGES else 0, end, BLOCK_M):
        if TWO_RANGES:  # start_m counts tiles of both ranges from 0
            i = start_m // BLOCK_M
            start_m = tl.where(i < n_first, lo + start_m, lo2 + (i - n_first) * BLOCK_M)
        rows, qt, do, lse2, delta, qkt, dpt = _dkdv_products(
            k, v, Q_head, DO_head, LSE_head, DELTA_head, sq_t, sdo_t, start_m, d, dv, q_len, D,
            Dv, POSITIONAL, PRECISION, DOT_IN_FP32, BLOCK_M,
        )  # fmt: skip
        dk, dv_acc = _dkdv_update(
            dk, dv_acc, rows, qt, do, lse2, delta, qkt, dpt, cols, b, h, bhq, q_len, k_len,
            offset, slope2, scale, softcap, window_left, window_right, MASK, KPM, SEED, sm_b,
            sm_h, sm_q, sm_k, skp_b, Tq, Tk, dropout_p, HAS_MASK, MASK_IS_BOOL, HAS_KPM,
            HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, POSITIONAL, PRECISION,
            DOT_IN_FP32, INTERPRETED,
            SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
            PARTIAL=PARTIAL,
        )  # fmt: skip
    return dk, dv_acc


@triton.jit
def _dq_keys(K_head, V_head, sk_t, sv_t, start_n, d, dv, k_len, D, Dv, KPM, b, skp_b,
             HAS_KPM: tl.constexpr, POSITIONAL: tl.constexpr, BLOCK_N: tl.constexpr,
             WITH_V: tl.constexpr = True):  # fmt: skip
    """Key tile start_n's columns, its keys and (WITH_V) values, transposed (D, BLOCK_N);
    padded keys read as 0, K included: dq sums dS * k, and 0 * NaN would be NaN."""
    start_n = tl.multiple_of(start_n, BLOCK_N)  # loops start on tile boundaries
    cols = start_n + tl.arange(0, BLOCK_N)
    col_ptr = cols[None, :].to(tl.int64)
    k_keep = tl.trans(_key_keep(cols, k_len, d, D, KPM, b, skp_b, HAS_KPM, POSITIONAL))
    kt = tl.load(K_head + col_ptr * sk_t + d[:, None], mask=k_keep, other=0.0)
    vt = 0.0
    if WITH_V:
        v_keep = tl.trans(_key_keep(cols, k_len, dv, Dv, KPM, b, skp_b, HAS_KPM, POSITIONAL))
        vt = tl.load(V_head + col_ptr * sv_t + dv[:, None], mask=v_keep, other=0.0)
    return cols, kt, vt


@triton.jit
def _dq_update(
    dq, delta_sum, p_sum, qk, kt, vt, cols, do, lse2, delta, rows, DMASK_row, b, h, bh,
    q_len, k_len, Tk_dense, offset, slope2, scale, softcap, window_left, window_right, MASK,
    KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, Tq, Tk, dropout_p,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, POSITIONAL: tl.constexpr,
    DELTA_PASS: tl.constexpr, MASK_GRAD: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr,
    SCORE_MOD: tl.constexpr = None, SCORE_MOD_GRAD: tl.constexpr = None, MOD_ARGS=None,
    PARTIAL=None,
):  # fmt: skip
    """One key tile's dq contribution from its scores qk = q·kᵀ (_dq_tiles)."""
    m = 0.0
    if HAS_MASK:  # rows past the end read the last row's mask (their dq is not stored)
        m = _mask_tile(MASK, b, h, tl.minimum(rows, q_len - 1)[:, None], cols[None, :],
                       q_len, k_len, sm_b, sm_h, sm_q, sm_k, POSITIONAL, MASK_IS_BOOL,
                       PARTIAL)  # fmt: skip
    s, t = _tile_scores(
        qk, rows[:, None], cols[None, :], b, q_len, k_len, offset, slope2, scale, softcap,
        window_left, window_right, m, KPM, skp_b, lse2[:, None], HAS_MASK and not MASK_IS_BOOL,
        MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, POSITIONAL,
        INTERPRETED, PRECISION, SCORE_MOD=SCORE_MOD, MOD_ARGS=MOD_ARGS, h=h,
    )  # fmt: skip
    p = tl.exp2(s)
    if HAS_MASK and MASK_IS_BOOL:
        # a hidden key's P is 0 either way; selected here rather than in the scores, the
        # scale and the row's log-sum-exp stay one FFMA (sm_90, D=128: dq 521 -> 423
        # instructions per iteration with a bool mask)
        p = tl.where(m != 0, p, 0.0)
    dp = _dot(do, vt, PRECISION, DOT_IN_FP32)
    if DROPOUT:
        dp = dp * _keep_scale(SEED, dropout_p, bh, rows[:, None], cols[None, :], Tq, Tk)
    if DELTA_PASS:
        delta_sum += tl.sum(p * dp, axis=1)
        p_sum += tl.sum(p, axis=1)
    else:
        ds = p * (dp - delta[:, None])
        if MASK_GRAD:
            tl.store(DMASK_row + rows[:, None].to(tl.int64) * Tk_dense + cols[None, :], ds,
                     mask=(rows < q_len)[:, None] & (cols < k_len)[None, :])  # fmt: skip
        if SOFTCAP:
            ds = ds * (1.0 - t * t)
        if SCORE_MOD is not None:
            ds = _mod_grad(ds, qk, scale, b, h, rows[:, None], cols[None, :], q_len, k_len,
                           MOD_ARGS, SCORE_MOD_GRAD, POSITIONAL)  # fmt: skip
        dq += _dot(ds.to(kt.dtype), tl.trans(kt), PRECISION, DOT_IN_FP32)
    return dq, delta_sum, p_sum


@triton.jit
def _dq_tiles(
    dq, delta_sum, p_sum, q, do, lse2, delta, K_head, V_head, sk_t, sv_t, lo, hi, rows, d, dv,
    DMASK_row, b, h, bh, q_len, k_len, Tk_dense, offset, slope2, scale, softcap,
    window_left, window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, D, Dv, Tq, Tk,
    dropout_p,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    HAS_LEFT: tl.constexpr, HAS_RIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
    HAS_ALIBI: tl.constexpr, DROPOUT: tl.constexpr, POSITIONAL: tl.constexpr,
    DELTA_PASS: tl.constexpr, MASK_GRAD: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, INTERPRETED: tl.constexpr,
    BLOCK_N: tl.constexpr, PIPELINE: tl.constexpr = False,
    SCORE_MOD: tl.constexpr = None, SCORE_MOD_GRAD: tl.constexpr = None, MOD_ARGS=None,
    PARTIAL=None,
):  # fmt: skip
    """dq contributions of key tiles [lo, hi); with DELTA_PASS only the row sums of P ∘ dP
    and of P (delta_sum, p_sum: the exact delta is their quotient, see attention_bwd_dq).
    With MASK_GRAD, dS is also written into the dense fp32 score-gradient buffer (each
    element once).

    PIPELINE (Tiles.pipeline on dq): tile j+1's scores q·kᵀ are issued before tile j's
    softmax recomputation and its dP and dQ products (the forward's rotation, _fwd_tiles),
    tile j's keys loaded again for its dQ product rather than kept across the product in
    flight (as dK/dV's, _dkdv_tiles). The same products and updates: the interpreter gives
    the plain loop's bits."""
    if HAS_MASK:
        lo, hi = _tile_start(lo, hi, BLOCK_N)
    if PIPELINE:
        if lo < hi:
            cols, kt, _no_v = _dq_keys(
                K_head, V_head, sk_t, sv_t, lo, d, dv, k_len, D, Dv, KPM, b, skp_b, HAS_KPM,
                POSITIONAL, BLOCK_N, False,
            )  # fmt: skip
            qk = _dot(q, kt, PRECISION, DOT_IN_FP32)
            for start_n in range(lo + BLOCK_N, hi, BLOCK_N):
                cols_n, kt_n, _no_v_n = _dq_keys(
                    K_head, V_head, sk_t, sv_t, start_n, d, dv, k_len, D, Dv, KPM, b, skp_b,
                    HAS_KPM, POSITIONAL, BLOCK_N, False,
                )  # fmt: skip
                qk_n = _dot(q, kt_n, PRECISION, DOT_IN_FP32)
                _cols_again, kt, vt = _dq_keys(
                    K_head, V_head, sk_t, sv_t, start_n - BLOCK_N, d, dv, k_len, D, Dv, KPM, b,
                    skp_b, HAS_KPM, POSITIONAL, BLOCK_N,
                )  # fmt: skip
                dq, delta_sum, p_sum = _dq_update(
                    dq, delta_sum, p_sum, qk, kt, vt, cols, do, lse2, delta, rows, DMASK_row, b, h,
                    bh, q_len, k_len, Tk_dense, offset, slope2, scale, softcap, window_left,
                    window_right, MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, Tq, Tk, dropout_p,
                    HAS_MASK, MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI,
                    DROPOUT, POSITIONAL, DELTA_PASS, MASK_GRAD, PRECISION, DOT_IN_FP32, INTERPRETED,
                    SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
                    PARTIAL=PARTIAL,
                )  # fmt: skip
                cols, qk = cols_n, qk_n
            last = lo + (hi - lo - 1) // BLOCK_N * BLOCK_N  # the loop's last start_n
            _cols_last, kt, vt = _dq_keys(
                K_head, V_head, sk_t, sv_t, last, d, dv, k_len, D, Dv, KPM, b, skp_b, HAS_KPM,
                POSITIONAL, BLOCK_N,
            )  # fmt: skip
            dq, delta_sum, p_sum = _dq_update(
                dq, delta_sum, p_sum, qk, kt, vt, cols, do, lse2, delta, rows, DMASK_row, b, h, bh,
                q_len, k_len, Tk_dense, offset, slope2, scale, softcap, window_left, window_right,
                MASK, KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, Tq, Tk, dropout_p, HAS_MASK,
                MASK_IS_BOOL, HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, POSITIONAL,
                DELTA_PASS, MASK_GRAD, PRECISION, DOT_IN_FP32, INTERPRETED,
                SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
                PARTIAL=PARTIAL,
            )  # fmt: skip
        return dq, delta_sum, p_sum
    for start_n in range(lo, hi, BLOCK_N):
        cols, kt, vt = _dq_keys(
            K_head, V_head, sk_t, sv_t, start_n, d, dv, k_len, D, Dv, KPM, b, skp_b, HAS_KPM,
            POSITIONAL, BLOCK_N,
        )  # fmt: skip
        qk = _dot(q, kt, PRECISION, DOT_IN_FP32)
        dq, delta_sum, p_sum = _dq_update(
            dq, delta_sum, p_sum, qk, kt, vt, cols, do, lse2, delta, rows, DMASK_row, b, h, bh,
            q_len, k_len, Tk_dense, offset, slope2, scale, softcap, window_left, window_right, MASK,
            KPM, SEED, sm_b, sm_h, sm_q, sm_k, skp_b, Tq, Tk, dropout_p, HAS_MASK, MASK_IS_BOOL,
            HAS_KPM, HAS_LEFT, HAS_RIGHT, SOFTCAP, HAS_ALIBI, DROPOUT, POSITIONAL, DELTA_PASS,
            MASK_GRAD, PRECISION, DOT_IN_FP32, INTERPRETED,
            SCORE_MOD=SCORE_MOD, SCORE_MOD_GRAD=SCORE_MOD_GRAD, MOD_ARGS=MOD_ARGS,
            PARTIAL=PARTIAL,
        )  # fmt: skip
    return dq, delta_sum, p_sum
