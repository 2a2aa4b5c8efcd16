"""Softmax kernels: scaled, masked (bool or additive, broadcast through strides), causal;
forward and backward, one-pass (row in registers) and looped (online softmax).

The input is seen as (A, B, C, N) with any strides: N is the softmax dim (its stride need not
be 1, so softmax along any dim runs without a copy) and C is the query dim for causal masking
(key j is kept for query i when j <= i, top-left, Tq != Tk allowed). A mask is read through its
broadcast strides (0 where it broadcasts), never expanded. A row with nothing kept gives 0
output and 0 gradient.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl

# Rows up to this many elements stay in registers; longer rows take the looped kernels
# (online max/sum, then a normalising pass). Same register budget as LayerNorm's.
MAX_ONE_PASS_N = 32768
LOOP_BLOCK_N = 4096


@dataclass(frozen=True)
class SoftmaxConfig:
    block_n: int
    num_warps: int
    one_pass: bool


@functools.lru_cache(maxsize=256)  # on every call's host path: ~5 µs saved (bench_host.py)
def softmax_config(n: int, max_one_pass_n: int = MAX_ONE_PASS_N) -> SoftmaxConfig:
    """Block size, warps and path for rows of n elements (pure; tested)."""
    if n <= max_one_pass_n:
        block = triton.next_power_of_2(n)
        return SoftmaxConfig(block, min(16, max(1, block // 256)), True)
    return SoftmaxConfig(min(LOOP_BLOCK_N, max_one_pass_n), 8, False)


@triton.jit
def _row_offsets(pid, B, C, s_a, s_b, s_c):
    """Offset of row pid of an (A, B, C, N) view with strides (s_a, s_b, s_c)."""
    c = pid % C
    b = (pid // C) % B
    a = pid // (B * C)
    return a * s_a + b * s_b + c * s_c, c


@triton.jit
def _masked_scores(
    X, MASK, x_off, m_off, cols, query, N, sx_n, sm_n, scale,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr,
):  # fmt: skip
    """x * scale with masked entries at -inf (and out-of-row lanes), in fp32."""
    keep = cols < N
    x = tl.load(X + x_off + cols * sx_n, mask=keep, other=0.0).to(tl.float32) * scale
    if HAS_MASK:
        m = tl.load(MASK + m_off + cols * sm_n, mask=keep, other=0)
        if MASK_IS_BOOL:
            keep = keep & (m != 0)
        else:
            x = x + m.to(tl.float32)
    if IS_CAUSAL:
        keep = keep & (cols <= query)
    return tl.where(keep, x, float("-inf"))


@triton.jit
def softmax_fwd_one_pass(
    X, Y, MASK,
    sx_a, sx_b, sx_c, sx_n, sy_a, sy_b, sy_c, sy_n, sm_a, sm_b, sm_c, sm_n,
    B, C, N, scale,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    x_off, query = _row_offsets(pid, B, C, sx_a, sx_b, sx_c)
    y_off, _ = _row_offsets(pid, B, C, sy_a, sy_b, sy_c)
    m_off, _ = _row_offsets(pid, B, C, sm_a, sm_b, sm_c)
    cols = tl.arange(0, BLOCK_N)
    s = _masked_scores(X, MASK, x_off, m_off, cols, query, N, sx_n, sm_n, scale,
                       HAS_MASK, MASK_IS_BOOL, IS_CAUSAL)  # fmt: skip
    row_max = tl.max(s, axis=0)
    # A row with nothing kept has max -inf: shift by 0 instead, so exp gives 0, not NaN.
    e = tl.exp(s - tl.where(row_max == float("-inf"), 0.0, row_max))
    total = tl.sum(e, axis=0)
    y = e / tl.where(total == 0.0, 1.0, total)
    tl.store(Y + y_off + cols * sy_n, y.to(Y.dtype.element_ty), mask=cols < N)


@triton.jit
def softmax_fwd_looped(
    X, Y, MASK,
    sx_a, sx_b, sx_c, sx_n, sy_a, sy_b, sy_c, sy_n, sm_a, sm_b, sm_c, sm_n,
    B, C, N, scale,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Online softmax: per-lane running max and sum in one read, then a normalising read."""
    pid = tl.program_id(0).to(tl.int64)
    x_off, query = _row_offsets(pid, B, C, sx_a, sx_b, sx_c)
    y_off, _ = _row_offsets(pid, B, C, sy_a, sy_b, sy_c)
    m_off, _ = _row_offsets(pid, B, C, sm_a, sm_b, sm_c)
    lane_max = tl.full([BLOCK_N], float("-inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        s = _masked_scores(X, MASK, x_off, m_off, cols, query, N, sx_n, sm_n, scale,
                           HAS_MASK, MASK_IS_BOOL, IS_CAUSAL)  # fmt: skip
        new_max = tl.maximum(lane_max, s)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - safe) + tl.exp(s - safe)
        lane_max = new_max
    row_max = tl.max(lane_max, axis=0)
    safe_row = tl.where(row_max == float("-inf"), 0.0, row_max)
    total = tl.sum(lane_sum * tl.exp(lane_max - safe_row), axis=0)
    inv = 1.0 / tl.where(total == 0.0, 1.0, total)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        s = _masked_scores(X, MASK, x_off, m_off, cols, query, N, sx_n, sm_n, scale,
                           HAS_MASK, MASK_IS_BOOL, IS_CAUSAL)  # fmt: skip
        y = tl.exp(s - safe_row) * inv
        tl.store(Y + y_off + cols * sy_n, y.to(Y.dtype.element_ty), mask=cols < N)


@triton.jit
def softmax_bwd_one_pass(
    Y, DY, DX,
    sy_a, sy_b, sy_c, sy_n, sd_a, sd_b, sd_c, sd_n, sx_a, sx_b, sx_c, sx_n,
    B, C, N, scale,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dx = scale * y * (dy - sum(dy * y)); masked entries have y = 0, so dx = 0 there."""
    pid = tl.program_id(0).to(tl.int64)
    y_off, _ = _row_offsets(pid, B, C, sy_a, sy_b, sy_c)
    d_off, _ = _row_offsets(pid, B, C, sd_a, sd_b, sd_c)
    x_off, _ = _row_offsets(pid, B, C, sx_a, sx_b, sx_c)
    cols = tl.arange(0, BLOCK_N)
    inb = cols < N
    y = tl.load(Y + y_off + cols * sy_n, mask=inb, other=0.0).to(tl.float32)
    dy = tl.load(DY + d_off + cols * sd_n, mask=inb, other=0.0).to(tl.float32)
    dot = tl.sum(y * dy, axis=0)
    dx = scale * y * (dy - dot)
    tl.store(DX + x_off + cols * sx_n, dx.to(DX.dtype.element_ty), mask=inb)


@triton.jit
def softmax_bwd_looped(
    Y, DY, DX,
    sy_a, sy_b, sy_c, sy_n, sd_a, sd_b, sd_c, sd_n, sx_a, sx_b, sx_c, sx_n,
    B, C, N, scale,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    y_off, _ = _row_offsets(pid, B, C, sy_a, sy_b, sy_c)
    d_off, _ = _row_offsets(pid, B, C, sd_a, sd_b, sd_c)
    x_off, _ = _row_offsets(pid, B, C, sx_a, sx_b, sx_c)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inb = cols < N
        y = tl.load(Y + y_off + cols * sy_n, mask=inb, other=0.0).to(tl.float32)
        dy = tl.load(DY + d_off + cols * sd_n, mask=inb, other=0.0).to(tl.float32)
        acc += y * dy
    dot = tl.sum(acc, axis=0)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inb = cols < N
        y = tl.load(Y + y_off + cols * sy_n, mask=inb, other=0.0).to(tl.float32)
        dy = tl.load(DY + d_off + cols * sd_n, mask=inb, other=0.0).to(tl.float32)
        tl.store(DX + x_off + cols * sx_n, (scale * y * (dy - dot)).to(DX.dtype.element_ty),
                 mask=inb)  # fmt: skip
