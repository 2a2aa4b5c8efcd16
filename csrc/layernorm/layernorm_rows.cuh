// The LayerNorm/RMSNorm fast path: rows of unit column stride whose starts, weight and bias are
// 16-byte aligned and whose length is whole 16-byte vectors, up to 32768 elements (2-byte
// types; 16384 fp32). Each thread loads its slice of the row once, as 16-byte vectors held raw
// in registers (4 registers per vector, converted to fp32 at each use), so the forward reads x
// once and the backward's dx kernel reads x and dy once (dy twice past 16384 elements). A warp per
// row up to 1024 elements (2-byte types), a block of 128 to 512 threads per row beyond: the shapes
// of the softmax fast path (softmax_rows.cuh). Everything else takes the general kernels of
// layernorm.cu.
//
// Why: the general forward reads x three times (mean, variance, normalise) with one load in
// flight per pass and thread; on the H100 it ran 1317-1547 GB/s at N = 1024-32768 against a
// 2960 GB/s copy, while the softmax fast path, built like this, ran 2232-2784 up to 8192
// (benchmarks/results/h100). Not yet timed on a GPU.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "common/rows.cuh"
#include "layernorm/layernorm.h"

namespace fusedattn {
namespace layernorm_rows {

using rows::block_threads;
using rows::kWarpRowsPerBlock;
using rows::my_row;
using rows::row_sum;

// A 16-byte vector of T, raw; element j in fp32.
template <typename T>
__device__ __forceinline__ float element(const uint4& raw, int j) {
  return to_float(reinterpret_cast<const T*>(&raw)[j]);
}

// kElems fp32 parameters from a 16-byte aligned address (kElems / 4 float4 loads); 1 without.
template <int kElems>
__device__ __forceinline__ void load_params(float (&out)[kElems], const float* src) {
#pragma unroll
  for (int j = 0; j < kElems; j += 4) {
    const float4 f = *reinterpret_cast<const float4*>(src + j);
    out[j] = f.x;
    out[j + 1] = f.y;
    out[j + 2] = f.z;
    out[j + 3] = f.w;
  }
}

// Column (element) where this thread's vector i starts; the row ends at n.
template <int kRowThreads, int kElems>
__device__ __forceinline__ int column(int t, int i) {
  return (t + i * kRowThreads) * kElems;
}

// y = (x - mean) * rstd * weight + bias; mean and rstd written per row (fp32, two passes over
// the registers: no cancellation). RMSNorm (p.rms): mean 0, no bias.
template <typename T, int kRowThreads, int kVecs>
__global__ void __launch_bounds__(block_threads<kRowThreads>())
    layer_norm_fwd_rows_kernel(const LayerNormParams p) {
  constexpr int kElems = 16 / sizeof(T);
  __shared__ float scratch[kWarpSize];
  int64_t row;
  int t;
  if (!my_row<kRowThreads>(p.rows, row, t)) return;
  const int n = static_cast<int>(p.n);  // <= 32768 (takes)
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  T* y = static_cast<T*>(p.y) + row * p.n;

  uint4 xv[kVecs];
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int col = column<kRowThreads, kElems>(t, i);
    if (col < n) {
      xv[i] = *reinterpret_cast<const uint4*>(x + col);
#pragma unroll
      for (int j = 0; j < kElems; ++j) sum += element<T>(xv[i], j);
    }
  }
  const float mean = p.rms ? 0.f : row_sum<kRowThreads>(sum, scratch) / n;
  float sq = 0.f;
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    if (column<kRowThreads, kElems>(t, i) < n) {
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        const float d = element<T>(xv[i], j) - mean;
        sq += d * d;
      }
    }
  }
  const float rstd = 1.f / sqrtf(row_sum<kRowThreads>(sq, scratch) / n + p.eps);

#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int col = column<kRowThreads, kElems>(t, i);
    if (col < n) {
      float w[kElems], b[kElems];
      if (p.weight) load_params<kElems>(w, p.weight + col);
      if (p.bias) load_params<kElems>(b, p.bias + col);
      uint4 out;
      T* o = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        float v = (element<T>(xv[i], j) - mean) * rstd;
        if (p.weight) v *= w[j];
        if (p.bias) v += b[j];
        o[j] = from_float<T>(v);
      }
      *reinterpret_cast<uint4*>(y + col) = out;
    }
  }
  if (t == 0) {
    p.mean[row] = mean;
    p.rstd[row] = rstd;
  }
}

// One row of the backward: dx = (w*dy - (xhat * mean(xhat*w*dy) + mean(w*dy))) * rstd
// (RMSNorm: without the mean(w*dy) term), x and dy read once, except at 8 vectors per thread
// (512-thread blocks, rows past 16384 elements), where dy is read again rather than held:
// holding it took the 128 registers a 512-thread block allows and spilled 38 B (sm_90a).
// kSumParams: also add this row's dweight (dy * xhat) and dbias (dy) terms to dw and db.
template <typename T, int kRowThreads, int kVecs, bool kSumParams>
__device__ __forceinline__ void backward_row(const LayerNormParams& p, int64_t row, int t,
                                             float* scratch, float (&dw)[kVecs][16 / sizeof(T)],
                                             float (&db)[kVecs][16 / sizeof(T)]) {
  constexpr int kElems = 16 / sizeof(T);
  constexpr bool kHoldDy = kVecs <= 4;
  const int n = static_cast<int>(p.n);  // <= 32768 (takes)
  const T* x = static_cast<const T*>(p.x) + row * p.x_row_stride;
  const T* dy = static_cast<const T*>(p.dy) + row * p.dy_row_stride;
  T* dx = static_cast<T*>(p.dx) + row * p.n;
  const float mean = p.rms ? 0.f : p.mean[row];
  const float rstd = p.rstd[row];

  uint4 xv[kVecs], dv[kHoldDy ? kVecs : 1];
  float c1 = 0.f, c2 = 0.f;  // sums of xhat * w * dy and of w * dy
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int col = column<kRowThreads, kElems>(t, i);
    if (col < n) {
      uint4& d = dv[kHoldDy ? i : 0];
      xv[i] = *reinterpret_cast<const uint4*>(x + col);
      d = *reinterpret_cast<const uint4*>(dy + col);
      float w[kElems];
      if (p.weight) load_params<kElems>(w, p.weight + col);
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        const float g = element<T>(d, j);
        const float xhat = (element<T>(xv[i], j) - mean) * rstd;
        const float wdy = g * (p.weight ? w[j] : 1.f);
        c1 += xhat * wdy;
        c2 += wdy;
        if (kSumParams) {
          dw[i][j] += g * xhat;
          db[i][j] += g;
        }
      }
    }
  }
  c1 = row_sum<kRowThreads>(c1, scratch) / n;
  c2 = p.rms ? 0.f : row_sum<kRowThreads>(c2, scratch) / n;

#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int col = column<kRowThreads, kElems>(t, i);
    if (col < n) {
      uint4& d = dv[kHoldDy ? i : 0];
      if (!kHoldDy) d = *reinterpret_cast<const uint4*>(dy + col);
      float w[kElems];
      if (p.weight) load_params<kElems>(w, p.weight + col);
      uint4 out;
      T* o = reinterpret_cast<T*>(&out);
#pragma unroll
      for (int j = 0; j < kElems; ++j) {
        const float wdy = element<T>(d, j) * (p.weight ? w[j] : 1.f);
        const float xhat = (element<T>(xv[i], j) - mean) * rstd;
        o[j] = from_float<T>((wdy - (xhat * c1 + c2)) * rstd);
      }
      *reinterpret_cast<uint4*>(dx + col) = out;
    }
  }
}

// The backward's dx, a row per warp or block; the parameter gradients stay with
// layer_norm_bwd_params_kernel.
template <typename T, int kRowThreads, int kVecs>
__global__ void __launch_bounds__(block_threads<kRowThreads>())
    layer_norm_bwd_dx_rows_kernel(const LayerNormParams p) {
  constexpr int kElems = 16 / sizeof(T);
  __shared__ float scratch[kWarpSize];
  int64_t row;
  int t;
  if (!my_row<kRowThreads>(p.rows, row, t)) return;
  float unused[kVecs][kElems];
  backward_row<T, kRowThreads, kVecs, false>(p, row, t, scratch, unused, unused);
}

// The backward with the parameter gradients fused in: a persistent grid of row groups (a warp
// each with a warp per row, a block each beyond) walks rows group, group + groups, ...; each
// thread keeps fp32 dweight/dbias sums for its columns in registers across its rows and writes
// its group's partials once ((groups, n) fp32, summed in group order by reduce_partials_kernel:
// deterministic for a given grid). x and dy are read once for dx and the partials together,
// where layer_norm_bwd_params_kernel read them a second time (5 row-sized passes -> 3).
// Shapes up to 4 vectors per thread and 256 threads: the sums (2 x 32 fp32 per thread at 4
// vectors of bf16) fit the registers those blocks allow; longer rows keep the two kernels.
template <int kRowThreads, int kVecs>
constexpr bool kFusesParams = kRowThreads <= 256 && kVecs <= 4;

template <typename T, int kRowThreads, int kVecs>
__global__ void __launch_bounds__(block_threads<kRowThreads>())
    layer_norm_bwd_fused_rows_kernel(const LayerNormParams p) {
  static_assert(kFusesParams<kRowThreads, kVecs>, "the parameter sums would not fit");
  constexpr int kElems = 16 / sizeof(T);
  __shared__ float scratch[kWarpSize];
  const bool warp_rows = kRowThreads == kWarpSize;
  const int group = warp_rows ? blockIdx.x * kWarpRowsPerBlock + threadIdx.x / kWarpSize
                              : static_cast<int>(blockIdx.x);
  const int groups = warp_rows ? gridDim.x * kWarpRowsPerBlock : gridDim.x;
  const int t = warp_rows ? threadIdx.x % kWarpSize : threadIdx.x;
  float dw[kVecs][kElems] = {}, db[kVecs][kElems] = {};
  for (int64_t row = group; row < p.rows; row += groups) {  // uniform per warp / per block
    backward_row<T, kRowThreads, kVecs, true>(p, row, t, scratch, dw, db);
  }
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int col = column<kRowThreads, kElems>(t, i);
    if (col < p.n) {
      float* pw = p.dweight_partial + static_cast<int64_t>(group) * p.n + col;
      float* pb = p.dbias_partial + static_cast<int64_t>(group) * p.n + col;
#pragma unroll
      for (int j = 0; j < kElems; j += 4) {
        *reinterpret_cast<float4*>(pw + j) =
            make_float4(dw[i][j], dw[i][j + 1], dw[i][j + 2], dw[i][j + 3]);
        *reinterpret_cast<float4*>(pb + j) =
            make_float4(db[i][j], db[i][j + 1], db[i][j + 2], db[i][j + 3]);
      }
    }
  }
}

// Whether the fast path takes these rows: unit column stride (the caller's layout), every row
// start, weight, bias (and dy, dx) 16-byte aligned, N whole vectors and at most one row's
// register capacity (kMaxVecs vectors of kMaxRowThreads threads).
template <typename T>
bool takes(const LayerNormParams& p, bool backward) {
  constexpr int kElems = 16 / sizeof(T);
  if (p.n <= 0 || p.n % kElems || p.n > int64_t{rows::kMaxRowThreads} * rows::kMaxVecs * kElems)
    return false;
  const auto aligned = [](const void* ptr) {
    return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
  };
  if (!aligned(p.x) || !aligned(p.weight) || !aligned(p.bias) || p.x_row_stride % kElems) {
    return false;
  }
  if (backward) return aligned(p.dy) && aligned(p.dx) && p.dy_row_stride % kElems == 0;
  return aligned(p.y);
}

// Runs the fast path (the forward, or the backward's dx) when it takes the rows; false
// otherwise (nothing launched).
template <typename T>
bool run(bool backward, const LayerNormParams& p, cudaStream_t stream) {
  if (!takes<T>(p, backward)) return false;
  rows::with_shape(p.n / (16 / sizeof(T)), [&](auto threads, auto vecs) {
    constexpr int kRowThreads = decltype(threads)::value, kVecs = decltype(vecs)::value;
    rows::launch<kRowThreads>(backward ? layer_norm_bwd_dx_rows_kernel<T, kRowThreads, kVecs>
                                       : layer_norm_fwd_rows_kernel<T, kRowThreads, kVecs>,
                              p.rows, "layer_norm", p, stream);
  });
  return true;
}

// The fused backward's grid: one wave of resident blocks (the occupancy the registers allow),
// no more blocks than the rows need.
template <typename T, int kRowThreads, int kVecs>
int64_t fused_blocks(int64_t num_rows) {
  constexpr int kMaxDevices = 64;
  static int resident[kMaxDevices] = {};  // blocks one wave holds, per device (0: not asked)
  int device = 0;
  FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  int wave = device < kMaxDevices ? resident[device] : 0;
  if (wave == 0) {
    int per_sm = 0, sms = 0;
    FUSEDATTN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
        &per_sm, layer_norm_bwd_fused_rows_kernel<T, kRowThreads, kVecs>,
        block_threads<kRowThreads>(), 0));
    FUSEDATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    wave = std::max(per_sm, 1) * sms;
    if (device < kMaxDevices) resident[device] = wave;  // any racing thread stores the same
  }
  const int64_t rows_per_block = kRowThreads == kWarpSize ? kWarpRowsPerBlock : 1;
  const int64_t needed = (num_rows + rows_per_block - 1) / rows_per_block;
  return std::max<int64_t>(1, std::min<int64_t>(wave, needed));
}

// Row groups of the fused backward for these rows (the partials' leading size), 0 when it does
// not take them (unaligned rows, or rows longer than kFusesParams allows).
template <typename T>
int64_t fused_groups(const LayerNormParams& p) {
  if (!takes<T>(p, true)) return 0;
  int64_t groups = 0;
  rows::with_shape(p.n / (16 / sizeof(T)), [&](auto threads, auto vecs) {
    constexpr int kRowThreads = decltype(threads)::value, kVecs = decltype(vecs)::value;
    if constexpr (kFusesParams<kRowThreads, kVecs>) {
      groups = fused_blocks<T, kRowThreads, kVecs>(p.rows) *
               (kRowThreads == kWarpSize ? kWarpRowsPerBlock : 1);
    }
  });
  return groups;
}

// Runs the fused backward when it takes the rows and p.groups is its group count
// (fused_groups); false otherwise (nothing launched).
template <typename T>
bool run_fused(const LayerNormParams& p, cudaStream_t stream) {
  if (p.dweight_partial == nullptr || p.groups != fused_groups<T>(p) || p.groups == 0) {
    return false;
  }
  rows::with_shape(p.n / (16 / sizeof(T)), [&](auto threads, auto vecs) {
    constexpr int kRowThreads = decltype(threads)::value, kVecs = decltype(vecs)::value;
    if constexpr (kFusesParams<kRowThreads, kVecs>) {
      const int64_t per_block = kRowThreads == kWarpSize ? kWarpRowsPerBlock : 1;
      const dim3 grid(static_cast<unsigned>(p.groups / per_block));
      layer_norm_bwd_fused_rows_kernel<T, kRowThreads, kVecs>
          <<<grid, block_threads<kRowThreads>(), 0, stream>>>(p);
      FUSEDATTN_LAUNCH_CHECK();
    }
  });
  return true;
}

}  // namespace layernorm_rows
}  // namespace fusedattn
