"""LayerNorm and RMSNorm kernels: forward and backward, one-pass (row in registers) and looped.

RMSNorm is LayerNorm without the centring and the bias (RMS=True: the mean is 0, so rstd is
1 / sqrt(mean(x^2) + eps), and the backward loses its mean term); one set of kernels serves
both. Rows are the flattened leading dims (M rows of N elements, unit column stride, any row
stride). Statistics are fp32; the variance is biased, as torch's. The backward writes dx per
row and fp32 partial sums of dweight/dbias per program into a (programs, N) buffer that a
second step reduces: deterministic, no atomics, no locks.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl

# Rows up to this many elements are held in registers (one read of x). 16 warps x 32 lanes
# x 64 fp32 values is 32768: beyond that registers spill, so longer rows loop over blocks.
MAX_ONE_PASS_N = 32768
LOOP_BLOCK_N = 4096
# The backward holds x, dy and their products per row: past 8192 elements its one-pass kernel
# spills on sm_90 (16 warps: 528 B per thread at 16384, 5.8 KB at 32768, against none at 8192;
# scripts/static_norms.py), so longer rows take the looped backward, which re-reads x and dy
# instead. Where the crossover lies between 8192 and 16384 is for scripts/tune_norms.py to time.
MAX_ONE_PASS_BWD_N = 8192


@dataclass(frozen=True)
class LayerNormConfig:
    block_n: int
    num_warps: int
    one_pass: bool


@functools.lru_cache(maxsize=256)  # on every call's host path: ~5 µs saved (bench_host.py)
def layer_norm_config(n: int, max_one_pass_n: int = MAX_ONE_PASS_N) -> LayerNormConfig:
    """Block size, warps and path for rows of n elements (pure; tested)."""
    if n <= max_one_pass_n:
        block = triton.next_power_of_2(n)
        # about 8 to 16 elements per thread for loads wide enough to fill 16-byte vectors
        warps = min(16, max(1, block // 256))
        return LayerNormConfig(block, warps, True)
    return LayerNormConfig(min(LOOP_BLOCK_N, max_one_pass_n), 8, False)


def backward_programs(M: int, num_sms: int) -> int:
    """Programs for the backward: enough to fill the GPU a few times over, few enough that
    the (programs, N) partial-sum buffer stays small next to x."""
    return max(1, min(M, 4 * num_sms))


@triton.jit
def layer_norm_fwd_one_pass(
    X, Y, W, B, Mean, Rstd,
    stride_x, stride_y, N, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr,
    BLOCK_N: tl.constexpr, STORE_STATS: tl.constexpr = True,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    inb = cols < N
    x = tl.load(X + row * stride_x + cols, mask=inb, other=0.0).to(tl.float32)
    mean = 0.0
    if not RMS:
        mean = tl.sum(x, axis=0) / N
    xc = tl.where(inb, x - mean, 0.0)
    var = tl.sum(xc * xc, axis=0) / N
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    y = xc * rstd
    if HAS_WEIGHT:
        y = y * tl.load(W + cols, mask=inb, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(B + cols, mask=inb, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=inb)
    if STORE_STATS:  # the backward's; an inference call does not keep them
        tl.store(Mean + row, mean)
        tl.store(Rstd + row, rstd)


@triton.jit
def layer_norm_fwd_looped(
    X, Y, W, B, Mean, Rstd,
    stride_x, stride_y, N, eps,
    HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr, RMS: tl.constexpr,
    BLOCK_N: tl.constexpr, STORE_STATS: tl.constexpr = True,
):  # fmt: skip
    """Two reads of x: shifted sums for the statistics, then normalise. Shifting by the row's
    first element keeps sum((x - x0)^2) - n * mean(x - x0)^2 free of cancellation when the
    mean is large next to the spread (RMSNorm needs no shift: its sum of squares is the
    statistic itself)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    pivot = 0.0
    if not RMS:
        pivot = tl.load(x_row).to(tl.float32)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_sq = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inb = cols < N
        d = tl.where(inb, tl.load(x_row + cols, mask=inb, other=0.0).to(tl.float32) - pivot, 0.0)
        acc += d
        acc_sq += d * d
    shifted_mean = tl.sum(acc, axis=0) / N
    if RMS:
        shifted_mean = 0.0
    var = tl.maximum(tl.sum(acc_sq, axis=0) / N - shifted_mean * shifted_mean, 0.0)
    mean = pivot + shifted_mean
    rstd = 1.0 / tl.sqrt_rn(var + eps)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inb = cols < N
        x = tl.load(x_row + cols, mask=inb, other=0.0).to(tl.float32)
        y = (x - mean) * rstd
        if HAS_WEIGHT:
            y = y * tl.load(W + cols, mask=inb, other=0.0).to(tl.float32)
        if HAS_BIAS:
            y = y + tl.load(B + cols, mask=inb, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=inb)
    if STORE_STATS:  # the backward's; an inference call does not keep them
        tl.store(Mean + row, mean)
        tl.store(Rstd + row, rstd)


@triton.jit
def layer_norm_bwd_one_pass(
    X, DY, DX, W, Mean, Rstd, DW_partial, DB_partial,
    stride_x, stride_dy, stride_dx, M, N, rows_per_program,
    HAS_WEIGHT: tl.constexpr, PARAM_GRADS: tl.constexpr, RMS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dx for rows_per_program rows, and this program's fp32 partial dweight/dbias."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    inb = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=inb, other=0.0).to(tl.float32)
    else:
        w = tl.where(inb, 1.0, 0.0)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # int64 bounds make the row index, and so every offset, 64-bit.
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for row in range(first, last):
        x = tl.load(X + row * stride_x + cols, mask=inb, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=inb, other=0.0).to(tl.float32)
        mean = 0.0
        if not RMS:  # RMSNorm saves no mean (its Mean argument is a placeholder)
            mean = tl.load(Mean + row)
        rstd = tl.load(Rstd + row)
        xhat = tl.where(inb, (x - mean) * rstd, 0.0)
        wdy = w * dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        c2 = 0.0
        if not RMS:
            c2 = tl.sum(wdy, axis=0) / N
        dx = (wdy - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=inb)
        if PARAM_GRADS:
            dw_acc += dy * xhat
            db_acc += dy
    if PARAM_GRADS:
        tl.store(DW_partial + pid.to(tl.int64) * N + cols, dw_acc, mask=inb)
        tl.store(DB_partial + pid.to(tl.int64) * N + cols, db_acc, mask=inb)


@triton.jit
def layer_norm_bwd_dx_looped(
    X, DY, DX, W, Mean, Rstd,
    stride_x, stride_dy, stride_dx, N,
    HAS_WEIGHT: tl.constexpr, RMS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """dx of one long row: the two row sums, then dx (two reads of x and dy)."""
    row = tl.program_id(0).to(tl.int64)
    mean = 0.0
    if not RMS:
        mean = tl.load(Mean + row)
    rstd = tl.load(Rstd + row)
    acc1 = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inb = cols < N
        x = tl.load(X + row * stride_x + cols, mask=inb, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=inb, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            dy = dy * tl.load(W + cols, mask=inb, other=0.0).to(tl.float32)
        acc1 += tl.where(inb, (x - mean) * rstd, 0.0) * dy
        acc2 += dy
    c1 = tl.sum(acc1, axis=0) / N
    c2 = 0.0
    if not RMS:
        c2 = tl.sum(acc2, axis=0) / N
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inb = cols < N
        x = tl.load(X + row * stride_x + cols, mask=inb, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=inb, other=0.0).to(tl.float32)
        if HAS_WEIGHT:
            dy = dy * tl.load(W + cols, mask=inb, other=0.0).to(tl.float32)
        xhat = (x - mean) * rstd
        dx = (dy - (xhat * c1 + c2)) * rstd
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=inb)


@triton.jit
def layer_norm_bwd_params_looped(
    X, DY, Mean, Rstd, DW_partial, DB_partial,
    stride_x, stride_dy, M, N, rows_per_program,
    RMS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Partial dweight/dbias of a group of rows over one block of columns."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inb = cols < N
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # int64 bounds make the row index, and so every offset, 64-bit.
    first = pid.to(tl.int64) * rows_per_program
    last = tl.minimum(first + rows_per_program, M)
    for row in range(first, last):
        x = tl.load(X + row * stride_x + cols, mask=inb, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=inb, other=0.0).to(tl.float32)
        mean = 0.0
        if not RMS:
            mean = tl.load(Mean + row)
        dw_acc += dy * (x - mean) * tl.load(Rstd + row)
        db_acc += dy
    tl.store(DW_partial + pid.to(tl.int64) * N + cols, dw_acc, mask=inb)
    tl.store(DB_partial + pid.to(tl.int64) * N + cols, db_acc, mask=inb)
