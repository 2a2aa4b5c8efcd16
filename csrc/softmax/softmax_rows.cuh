// The softmax fast path: rows of unit stride and 16-byte alignment, no mask, no causal. Each
// thread holds its slice of the row in registers as 16-byte vectors (one read of x, one write
// of y), the scale and log2(e) fold into one multiply per element, exp2 replaces exp, and the
// row takes one reciprocal. A warp per row up to 1024 elements (2-byte types), a block of 128
// to 512 threads per row beyond, up to 32768 elements; everything else takes the general
// kernels of softmax.cu (scalar strided loads, masks, causal, rows of any length).
//
// Why: the general kernel reads each element twice through a run-time stride with 64-bit index
// math and three accurate expf, predicted at 20-30 % of the copy bandwidth on the H200
// (issue #14). Not yet timed on a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/fast_math.cuh"
#include "common/reduce.cuh"
#include "common/rows.cuh"
#include "softmax/softmax.h"

namespace fusedattn {
namespace softmax_rows {

using rows::block_threads;
using rows::row_sum;

constexpr float kLog2e = 1.4426950408889634f;

// Offset of flat row `row` of the (A, B, C) rows. 32-bit division when the rows fit (a 64-bit
// one is ~3x the instructions, which short rows feel: it is paid once per thread per row).
__device__ __forceinline__ int64_t row_offset(const int64_t* stride, const int64_t* sizes,
                                              int64_t row) {
  int64_t a, b, c;
  if (sizes[0] * sizes[1] * sizes[2] <= 0x7fffffff) {
    const uint32_t r = static_cast<uint32_t>(row), C = static_cast<uint32_t>(sizes[2]);
    const uint32_t B = static_cast<uint32_t>(sizes[1]);
    c = r % C;
    b = (r / C) % B;
    a = r / (B * C);
  } else {
    c = row % sizes[2];
    b = (row / sizes[2]) % sizes[1];
    a = row / (sizes[1] * sizes[2]);
  }
  return a * stride[0] + b * stride[1] + c * stride[2];
}

// The row this thread works on and its index within the row's threads; false past the end.
template <int kRowThreads>
__device__ __forceinline__ bool my_row(const SoftmaxParams& p, int64_t& row, int& t) {
  return rows::my_row<kRowThreads>(p.sizes[0] * p.sizes[1] * p.sizes[2], row, t);
}

template <int kRowThreads>
__device__ __forceinline__ float row_max(float v, float* scratch) {
  return kRowThreads == kWarpSize ? warp_max(v) : block_max(v, scratch);
}

// kElems elements of T as one 16-byte vector, in fp32.
template <typename T, int kElems>
__device__ __forceinline__ void load_vec(float (&out)[kElems], const T* src) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int j = 0; j < kElems; ++j) out[j] = to_float(e[j]);
}
template <typename T, int kElems>
__device__ __forceinline__ void store_vec(T* dst, const float (&in)[kElems], float factor) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int j = 0; j < kElems; ++j) e[j] = from_float<T>(in[j] * factor);
  *reinterpret_cast<uint4*>(dst) = raw;
}

// y = softmax(x * scale) along N; a row whose inputs are all -inf gives 0 (as the general
// kernel), never NaN.
template <typename T, int kRowThreads, int kVecs>
__global__ void __launch_bounds__(block_threads<kRowThreads>())
    softmax_fwd_rows_kernel(const SoftmaxParams p) {
  constexpr int kElems = 16 / sizeof(T);
  __shared__ float scratch[kWarpSize];
  int64_t row;
  int t;
  if (!my_row<kRowThreads>(p, row, t)) return;
  const int64_t N = p.sizes[3];
  const T* x = static_cast<const T*>(p.x) + row_offset(p.x_stride, p.sizes, row);
  T* y = static_cast<T*>(p.out) + row_offset(p.out_stride, p.sizes, row);
  const float scale_log2 = p.scale * kLog2e;

  float v[kVecs][kElems];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t col = static_cast<int64_t>(t + i * kRowThreads) * kElems;
    if (col < N) {
      load_vec<T, kElems>(v[i], x + col);
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        v[i][j] *= scale_log2;
        m = fmaxf(m, v[i][j]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < kElems; ++j) v[i][j] = -INFINITY;
    }
  }
  m = row_max<kRowThreads>(m, scratch);
  const float m_safe = m == -INFINITY ? 0.f : m;  // every input -inf: every exp2 is 0
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
#pragma unroll
    for (int j = 0; j < kElems; ++j) {
      v[i][j] = ex2(v[i][j] - m_safe);
      s += v[i][j];
    }
  }
  s = row_sum<kRowThreads>(s, scratch);
  const float inv = s > 0.f ? 1.f / s : 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t col = static_cast<int64_t>(t + i * kRowThreads) * kElems;
    if (col < N) store_vec<T, kElems>(y + col, v[i], inv);
  }
}

// dx = scale * y * (dy - sum(dy * y)) along N, y held in registers, and dy too unless that
// would pass the 128 registers a 512-thread block allows (the longest rows read dy twice: 72 B
// of spills otherwise, sm_90a).
template <typename T, int kRowThreads, int kVecs>
__global__ void __launch_bounds__(block_threads<kRowThreads>())
    softmax_bwd_rows_kernel(const SoftmaxParams p) {
  constexpr int kElems = 16 / sizeof(T);
  constexpr bool kHoldDy = kVecs * kElems <= 32;
  __shared__ float scratch[kWarpSize];
  int64_t row;
  int t;
  if (!my_row<kRowThreads>(p, row, t)) return;
  const int64_t N = p.sizes[3];
  const T* y = static_cast<const T*>(p.x) + row_offset(p.x_stride, p.sizes, row);
  const T* dy = static_cast<const T*>(p.dy) + row_offset(p.dy_stride, p.sizes, row);
  T* dx = static_cast<T*>(p.out) + row_offset(p.out_stride, p.sizes, row);

  float yv[kVecs][kElems], dv[kHoldDy ? kVecs : 1][kElems];
  float dot = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t col = static_cast<int64_t>(t + i * kRowThreads) * kElems;
    if (col < N) {
      float (&d)[kElems] = dv[kHoldDy ? i : 0];
      load_vec<T, kElems>(yv[i], y + col);
      load_vec<T, kElems>(d, dy + col);
#pragma unroll
      for (int j = 0; j < kElems; ++j) dot += yv[i][j] * d[j];
    }
  }
  dot = row_sum<kRowThreads>(dot, scratch);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int64_t col = static_cast<int64_t>(t + i * kRowThreads) * kElems;
    if (col < N) {
      float (&d)[kElems] = dv[kHoldDy ? i : 0];
      if (!kHoldDy) load_vec<T, kElems>(d, dy + col);
#pragma unroll
      for (int j = 0; j < kElems; ++j) d[j] = yv[i][j] * (d[j] - dot);
      store_vec<T, kElems>(dx + col, d, p.scale);
    }
  }
}

// Whether the fast path takes these rows: unit stride along N, every row start and the base
// pointers 16-byte aligned, N whole vectors and at most one row's register capacity
// (kMaxVecs vectors of kMaxRowThreads threads), and (forward) no mask and no causal.
template <typename T>
bool takes(const SoftmaxParams& p, bool backward) {
  constexpr int kElems = 16 / sizeof(T);
  const int64_t N = p.sizes[3];
  if (!backward && (p.keep || p.bias || p.causal)) return false;
  if (N <= 0 || N % kElems || N > int64_t{rows::kMaxRowThreads} * rows::kMaxVecs * kElems)
    return false;
  const void* ptrs[3] = {p.x, p.out, backward ? p.dy : p.x};
  const int64_t* strides[3] = {p.x_stride, p.out_stride, backward ? p.dy_stride : p.x_stride};
  for (int i = 0; i < 3; ++i) {
    if (reinterpret_cast<uintptr_t>(ptrs[i]) % 16 || strides[i][3] != 1) return false;
    for (int d = 0; d < 3; ++d) {
      if (p.sizes[d] > 1 && (strides[i][d] * static_cast<int64_t>(sizeof(T))) % 16) return false;
    }
  }
  return true;
}

// Runs the fast path when it takes the rows; false otherwise (nothing launched). The row
// length in 16-byte vectors picks the shape (rows::with_shape).
template <typename T>
bool run(bool backward, const SoftmaxParams& p, cudaStream_t stream) {
  if (!takes<T>(p, backward)) return false;
  rows::with_shape(p.sizes[3] / (16 / sizeof(T)), [&](auto threads, auto vecs) {
    constexpr int kRowThreads = decltype(threads)::value, kVecs = decltype(vecs)::value;
    rows::launch<kRowThreads>(backward ? softmax_bwd_rows_kernel<T, kRowThreads, kVecs>
                                       : softmax_fwd_rows_kernel<T, kRowThreads, kVecs>,
                              p.sizes[0] * p.sizes[1] * p.sizes[2], "softmax", p, stream);
  });
  return true;
}

}  // namespace softmax_rows
}  // namespace fusedattn
