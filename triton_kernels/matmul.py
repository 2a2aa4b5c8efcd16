"""A batch-invariant matmul: C = A @ B (+ bias), fp32 accumulation, for fusedattn.linear.

A row of C is the same bits whatever the other rows of A are and however many there are
(M), which is what batch_invariant serving needs of every matmul of a decoder step (a decode
step multiplies B rows; cuBLAS, and torch's CPU matmuls, choose their kernel, their tiles and
a split of K by M, so a row's sum runs in another order in a batch of 8 than alone). Here:

- the tiles (BLOCK_M, BLOCK_N, BLOCK_K), warps and stages come from the dtype alone
  (matmul_config), never from M, N or K;
- no split of K: each program sums its (BLOCK_M, BLOCK_N) tile over K in one loop, tile by
  tile from k = 0, each tile's product added by the dot itself (its accumulator input), so an
  element's sum runs in the same order in every call;
- rows past M and columns past K are loaded as zeros, which add nothing.

A (M, K) and B (K, N) are read through their strides (F.linear's B is the weight (N, K)
transposed: strides (1, K)); C (M, N) is written in its own dtype. Programs run on one grid
axis, GROUP_M row tiles next to each other per column tile so a column tile of B stays in L2
(the order of programs changes no sum).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import triton
import triton.language as tl


@dataclass(frozen=True)
class MatmulConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


@functools.cache
def matmul_config(element_size: int) -> MatmulConfig:
    """The tiles for inputs of `element_size` bytes: one per dtype, so that no shape changes
    a row's sum. 16-bit inputs: 64 x 64 tiles, 64 deep; at decode (M of a few rows) a
    4096-wide projection is 64 column programs, the most a tile of 64 columns gives without
    splitting K (a split would make the sum's order follow the batch). fp32 (exact fp32
    products unless TF32 is allowed): 32 deep, the same registers. Screened for sm_90 by
    scripts/static_matmul.py; timed against cuBLAS by benchmarks/bench_invariant.py."""
    if element_size == 2:
        return MatmulConfig(64, 64, 64, 8, 4, 4)
    return MatmulConfig(64, 64, 32, 8, 4, 3)


@triton.jit
def _dot_acc(a, b, acc, PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr):
    """acc + a @ b, the sum taken by the dot (its accumulator input). DOT_IN_FP32 upcasts
    first: the launcher sets it for bf16 in the CPU interpreter, whose bf16 dot is wrong
    (triton_kernels/attention.py's _dot says more); bf16 products are exact in fp32."""
    if DOT_IN_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def matmul_kernel(
    A, B, Bias, C,
    M, N, K,
    stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    rows = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    a_ptrs = A + rows[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = B + ks[:, None] * stride_bk + cols[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = _dot_acc(a, b, acc, PRECISION, DOT_IN_FP32)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if HAS_BIAS:
        acc += tl.load(Bias + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = C + rows[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
