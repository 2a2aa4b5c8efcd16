"""Flash attention in Triton: forward (online softmax, O(T) memory, log-sum-exp saved) and a
deterministic backward (dk/dv by key block, dq by query block, no atomics).

Layouts: q (B, Hq, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv) with any strides and a unit
last stride; GQA maps q head h to kv head h // (Hq / Hkv). Masks, each optional: an attn_mask
read through its broadcast strides (bool: True keeps; float: added to the scaled scores),
key padding (B, Tk) bool (True = padding), causal top-left (key j for query i when j <= i).
Scores are kept in the log2 domain (scaled by log2(e)) so the kernels use exp2. A query row
that sees no key gets output 0, lse -inf and zero gradients. Offsets are 64-bit; the B*H
programs ride grid axis 0 (2^31 - 1), query/key blocks axis 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@dataclass(frozen=True)
class AttentionConfig:
    block_m: int
    block_n: int
    block_d: int
    block_dv: int
    num_warps: int
    num_stages: int


def attention_config(D: int, Dv: int, on_gpu: bool) -> AttentionConfig:
    """Tiles for head dims D/Dv (pure; tested). On the CPU interpreter small tiles keep tests
    fast and cross several blocks. GPU tiles are a safe starting point for sm_80/sm_90
    (64x64, 4 warps, 2 stages; 32-wide key tiles past D=128 to stay in registers) until the
    Hopper benchmarks of issue #3 tune them."""
    bd = max(16, triton.next_power_of_2(D))
    bdv = max(16, triton.next_power_of_2(Dv))
    if not on_gpu:
        return AttentionConfig(32, 32, bd, bdv, 1, 1)
    block_n = 64 if max(bd, bdv) <= 128 else 32
    return AttentionConfig(64, block_n, bd, bdv, 4, 2)


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
def _dropout(p, SEED, dropout_p, bh, rows, cols, Tq, Tk):
    """Keep each probability with chance 1 - dropout_p, scaled by 1 / (1 - dropout_p). The
    Philox stream is indexed by (batch*head, query, key) with 64-bit offsets, so the backward
    regenerates exactly the forward's mask from the same seed."""
    offsets = (bh * Tq + rows[:, None]) * Tk + cols[None, :]
    keep = tl.rand(tl.load(SEED), offsets) >= dropout_p
    return tl.where(keep, p * (1.0 / (1.0 - dropout_p)), 0.0)


@triton.jit
def _masked_scores(
    s, rows, cols, b, h, Tq, Tk, MASK, KPM, sm_b, sm_h, sm_q, sm_k, skp_b,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
):  # fmt: skip
    """Apply every mask to a (BLOCK_M, BLOCK_N) tile of log2-domain scores: -inf where a key
    is hidden (or out of range); a float mask is added (times log2 e)."""
    keep = (cols < Tk)[None, :] & (rows < Tq)[:, None]
    if IS_CAUSAL:
        keep = keep & (cols[None, :] <= rows[:, None])
    if HAS_KPM:
        pad = tl.load(KPM + b * skp_b + cols, mask=cols < Tk, other=1)
        keep = keep & (pad == 0)[None, :]
    if HAS_MASK:
        m = tl.load(
            MASK + b * sm_b + h * sm_h + rows[:, None] * sm_q + cols[None, :] * sm_k,
            mask=(rows < Tq)[:, None] & (cols < Tk)[None, :],
            other=0,
        )
        if MASK_IS_BOOL:
            keep = keep & (m != 0)
        else:
            s = s + m.to(tl.float32) * 1.4426950408889634
    return tl.where(keep, s, float("-inf"))


@triton.jit
def attention_fwd(
    Q, K, V, Out, LSE, MASK, KPM, SEED,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
    sm_b, sm_h, sm_q, sm_k, skp_b,
    H, Tq, Tk, D, Dv, group, scale, dropout_p,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    hk = h // group
    start_m = tl.program_id(1) * BLOCK_M
    rows = (start_m + tl.arange(0, BLOCK_M)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        Q + b * sq_b + h * sq_h + rows[:, None] * sq_t + d[None, :],
        mask=(rows < Tq)[:, None] & (d < D)[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634
    end_n = Tk
    if IS_CAUSAL:  # key blocks right of the diagonal are fully masked: never visited
        end_n = tl.minimum(Tk, start_m + BLOCK_M)
    for start_n in range(0, end_n, BLOCK_N):
        cols = (start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        kt = tl.load(
            K + b * sk_b + hk * sk_h + cols[None, :] * sk_t + d[:, None],
            mask=(cols < Tk)[None, :] & (d < D)[:, None],
            other=0.0,
        )
        s = _dot(q, kt, PRECISION, DOT_IN_FP32) * qk_scale
        s = _masked_scores(s, rows, cols, b, h, Tq, Tk, MASK, KPM, sm_b, sm_h, sm_q, sm_k,
                           skp_b, HAS_MASK, MASK_IS_BOOL, HAS_KPM, IS_CAUSAL)  # fmt: skip
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that see nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            V + b * sv_b + hk * sv_h + cols[:, None] * sv_t + dv[None, :],
            mask=(cols < Tk)[:, None] & (dv < Dv)[None, :],
            other=0.0,
        )
        if DROPOUT:  # the normaliser l_i keeps the undropped mass
            p = _dropout(p, SEED, dropout_p, bh, rows, cols, Tq, Tk)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, DOT_IN_FP32)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        Out + b * so_b + h * so_h + rows[:, None] * so_t + dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=(rows < Tq)[:, None] & (dv < Dv)[None, :],
    )
    seen = l_i > 0.0
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453,
                   float("-inf"))  # fmt: skip
    tl.store(LSE + bh * Tq + rows, lse, mask=rows < Tq)


@triton.jit
def attention_bwd_delta(
    Out, DO, DELTA, so_b, so_h, so_t, sdo_b, sdo_h, sdo_t, H, Tq, Dv,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """delta = rowsum(dO * O), the softmax-backward correction term, fp32 (B, H, Tq)."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    rows = (tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    dv = tl.arange(0, BLOCK_DV)
    inb = (rows < Tq)[:, None] & (dv < Dv)[None, :]
    o = tl.load(Out + b * so_b + h * so_h + rows[:, None] * so_t + dv[None, :], mask=inb, other=0.0)
    do = tl.load(DO + b * sdo_b + h * sdo_h + rows[:, None] * sdo_t + dv[None, :], mask=inb,
                 other=0.0)  # fmt: skip
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    tl.store(DELTA + bh * Tq + rows, delta, mask=rows < Tq)


@triton.jit
def attention_bwd_dkdv(
    Q, K, V, DO, LSE, DELTA, DK, DV, MASK, KPM, SEED,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
    sdk_b, sdk_h, sdk_t, sdv_b, sdv_h, sdv_t,
    sm_b, sm_h, sm_q, sm_k, skp_b,
    H, Hkv, Tq, Tk, D, Dv, group, scale, dropout_p,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
    DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """dk, dv of one key block of one kv head, summed over the q heads of its group in a fixed
    order (deterministic GQA)."""
    bhk = tl.program_id(0).to(tl.int64)
    b = bhk // Hkv
    hk = bhk % Hkv
    start_n = tl.program_id(1) * BLOCK_N
    cols = (start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    k = tl.load(K + b * sk_b + hk * sk_h + cols[:, None] * sk_t + d[None, :],
                mask=(cols < Tk)[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
    v = tl.load(V + b * sv_b + hk * sv_h + cols[:, None] * sv_t + dv[None, :],
                mask=(cols < Tk)[:, None] & (dv < Dv)[None, :], other=0.0)  # fmt: skip
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dvacc = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634
    begin_m = 0
    if IS_CAUSAL:  # query blocks above the diagonal see none of these keys
        begin_m = (start_n // BLOCK_M) * BLOCK_M
    for g in range(0, group):
        h = hk * group + g
        for start_m in range(begin_m, Tq, BLOCK_M):
            rows = (start_m + tl.arange(0, BLOCK_M)).to(tl.int64)
            q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_t + d[None, :],
                        mask=(rows < Tq)[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
            do = tl.load(DO + b * sdo_b + h * sdo_h + rows[:, None] * sdo_t + dv[None, :],
                         mask=(rows < Tq)[:, None] & (dv < Dv)[None, :], other=0.0)  # fmt: skip
            lse = tl.load(LSE + (b * H + h) * Tq + rows, mask=rows < Tq, other=float("-inf"))
            delta = tl.load(DELTA + (b * H + h) * Tq + rows, mask=rows < Tq, other=0.0)
            s = _dot(q, tl.trans(k), PRECISION, DOT_IN_FP32) * qk_scale
            s = _masked_scores(s, rows, cols, b, h, Tq, Tk, MASK, KPM, sm_b, sm_h, sm_q, sm_k,
                               skp_b, HAS_MASK, MASK_IS_BOOL, HAS_KPM, IS_CAUSAL)  # fmt: skip
            # rows that saw no key have lse -inf: make their probabilities exactly 0
            lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
            p = tl.exp2(s - lse2[:, None])
            dp = _dot(do, tl.trans(v), PRECISION, DOT_IN_FP32)
            p_used = p
            if DROPOUT:  # the forward's mask again: 0 or 1 / (1 - dropout_p) per entry
                kept = _dropout(tl.full(p.shape, 1.0, tl.float32), SEED, dropout_p, b * H + h,
                                rows, cols, Tq, Tk)  # fmt: skip
                p_used = p * kept
                dp = dp * kept
            dvacc += _dot(tl.trans(p_used.to(do.dtype)), do, PRECISION, DOT_IN_FP32)
            ds = p * (dp - delta[:, None])
            dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION, DOT_IN_FP32)
    tl.store(DK + b * sdk_b + hk * sdk_h + cols[:, None] * sdk_t + d[None, :],
             (dk * scale).to(DK.dtype.element_ty), mask=(cols < Tk)[:, None] & (d < D)[None, :])  # fmt: skip
    tl.store(DV + b * sdv_b + hk * sdv_h + cols[:, None] * sdv_t + dv[None, :],
             dvacc.to(DV.dtype.element_ty), mask=(cols < Tk)[:, None] & (dv < Dv)[None, :])  # fmt: skip


@triton.jit
def attention_bwd_dq(
    Q, K, V, DO, LSE, DELTA, DQ, DMASK, MASK, KPM, SEED,
    sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, sdo_b, sdo_h, sdo_t,
    sdq_b, sdq_h, sdq_t,
    sm_b, sm_h, sm_q, sm_k, skp_b,
    H, Tq, Tk, D, Dv, group, scale, dropout_p,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, HAS_KPM: tl.constexpr,
    IS_CAUSAL: tl.constexpr, DROPOUT: tl.constexpr, MASK_GRAD: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    """dq of one query block; with MASK_GRAD also dS, the gradient of the float mask, into a
    dense (B, H, Tq, Tk) fp32 buffer (each element written once: deterministic)."""
    bh = tl.program_id(0).to(tl.int64)
    b = bh // H
    h = bh % H
    hk = h // group
    start_m = tl.program_id(1) * BLOCK_M
    rows = (start_m + tl.arange(0, BLOCK_M)).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_t + d[None, :],
                mask=(rows < Tq)[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
    do = tl.load(DO + b * sdo_b + h * sdo_h + rows[:, None] * sdo_t + dv[None, :],
                 mask=(rows < Tq)[:, None] & (dv < Dv)[None, :], other=0.0)  # fmt: skip
    lse = tl.load(LSE + bh * Tq + rows, mask=rows < Tq, other=float("-inf"))
    delta = tl.load(DELTA + bh * Tq + rows, mask=rows < Tq, other=0.0)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634
    end_n = Tk
    if IS_CAUSAL:
        end_n = tl.minimum(Tk, start_m + BLOCK_M)
    for start_n in range(0, end_n, BLOCK_N):
        cols = (start_n + tl.arange(0, BLOCK_N)).to(tl.int64)
        k = tl.load(K + b * sk_b + hk * sk_h + cols[:, None] * sk_t + d[None, :],
                    mask=(cols < Tk)[:, None] & (d < D)[None, :], other=0.0)  # fmt: skip
        v = tl.load(V + b * sv_b + hk * sv_h + cols[:, None] * sv_t + dv[None, :],
                    mask=(cols < Tk)[:, None] & (dv < Dv)[None, :], other=0.0)  # fmt: skip
        s = _dot(q, tl.trans(k), PRECISION, DOT_IN_FP32) * qk_scale
        s = _masked_scores(s, rows, cols, b, h, Tq, Tk, MASK, KPM, sm_b, sm_h, sm_q, sm_k,
                           skp_b, HAS_MASK, MASK_IS_BOOL, HAS_KPM, IS_CAUSAL)  # fmt: skip
        p = tl.exp2(s - lse2[:, None])
        dp = _dot(do, tl.trans(v), PRECISION, DOT_IN_FP32)
        if DROPOUT:
            kept = _dropout(tl.full(p.shape, 1.0, tl.float32), SEED, dropout_p, bh, rows, cols,
                            Tq, Tk)  # fmt: skip
            dp = dp * kept
        ds = p * (dp - delta[:, None])
        dq += _dot(ds.to(k.dtype), k, PRECISION, DOT_IN_FP32)
        if MASK_GRAD:
            tl.store(DMASK + bh * Tq * Tk + rows[:, None] * Tk + cols[None, :], ds,
                     mask=(rows < Tq)[:, None] & (cols < Tk)[None, :])  # fmt: skip
    tl.store(DQ + b * sdq_b + h * sdq_h + rows[:, None] * sdq_t + d[None, :],
             (dq * scale).to(DQ.dtype.element_ty), mask=(rows < Tq)[:, None] & (d < D)[None, :])  # fmt: skip
