// LayerNorm and RMSNorm forward and backward (RMSNorm: p.rms, the mean pass skipped and the
// mean taken as 0; the backward drops the mean term). One row per warp for rows up to kWarpRowMax
// elements (four rows per 128-thread block: no shared memory, no __syncthreads), one row per block
// beyond. Statistics are fp32 and two-pass (mean, then centred variance: no cancellation). Loads
// are 16-byte vectors when the row length and alignment allow, scalar otherwise. The backward
// writes dx per row and fp32 partial dweight/dbias per row group, reduced by a second kernel
// in group order: deterministic, no atomics. Aligned rows up to 32768 elements take the fast
// path of layernorm_rows.cuh instead (the row read once, held in registers) for the forward
// and the backward's dx, and up to 8192 for a backward that also writes the partials in the
// same pass; these kernels keep the rest (unaligned or longer rows).

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "layernorm/layernorm.h"
#include "layernorm/layernorm_rows.cuh"

namespace fusedattn {
namespace {

constexpr int kWarpRowMax = 1024;  // rows up to this length: one warp each
constexpr int kWarpsPerBlock = 4;  // warp-per-row blocks: 4 rows
constexpr int kBlockThreadsMin = 128, kBlockThreadsMax = 512;  // block-per-row threads
constexpr int kParamThreads = 256;  // columns per block in the parameter reduction

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// The row index, this thread's first element and stride, for either mapping.
template <bool kWarpPerRow>
struct RowMap {
  int64_t row;
  int first;
  int stride;
  __device__ RowMap() {
    if (kWarpPerRow) {
      row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
      first = threadIdx.x % kWarpSize;
      stride = kWarpSize;
    } else {
      row = blockIdx.x;
      first = threadIdx.x;
      stride = blockDim.x;
    }
  }
};

template <bool kWarpPerRow>
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  return kWarpPerRow ? warp_sum(v) : block_sum(v, scratch);
}

// Calls fn(i, value) for every element of a row, VEC elements per load.
template <typename T, int VEC, typename Fn>
__device__ __forceinline__ void for_row(const T* row, int64_t n, int first, int stride, Fn fn) {
  for (int64_t i = static_cast<int64_t>(first) * VEC; i < n;
       i += static_cast<int64_t>(stride) * VEC) {
    const Pack<T, VEC> p = *reinterpret_cast<const Pack<T, VEC>*>(row + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) fn(i + j, to_float(p.v[j]));
  }
}

template <typename T, int VEC, bool kWarpPerRow>
__global__ void layer_norm_fwd_kernel(LayerNormParams p) {
  __shared__ float scratch[kWarpSize];
  const RowMap<kWarpPerRow> m;
  if (m.row >= p.rows) return;  // whole warps (warp-per-row) or whole blocks leave together
  const T* x = static_cast<const T*>(p.x) + m.row * p.x_row_stride;
  T* y = static_cast<T*>(p.y) + m.row * p.n;

  float mean = 0.f;
  if (!p.rms) {
    float sum = 0.f;
    for_row<T, VEC>(x, p.n, m.first, m.stride, [&](int64_t, float v) { sum += v; });
    mean = row_sum<kWarpPerRow>(sum, scratch) / p.n;
  }
  float sq = 0.f;
  for_row<T, VEC>(x, p.n, m.first, m.stride,
                  [&](int64_t, float v) { sq += (v - mean) * (v - mean); });
  const float rstd = 1.f / sqrtf(row_sum<kWarpPerRow>(sq, scratch) / p.n + p.eps);

  for (int64_t i = static_cast<int64_t>(m.first) * VEC; i < p.n;
       i += static_cast<int64_t>(m.stride) * VEC) {
    const Pack<T, VEC> in = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
    Pack<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float v = (to_float(in.v[j]) - mean) * rstd;
      if (p.weight) v *= p.weight[i + j];
      if (p.bias) v += p.bias[i + j];
      out.v[j] = from_float<T>(v);
    }
    *reinterpret_cast<Pack<T, VEC>*>(y + i) = out;
  }
  if (m.first == 0) {
    p.mean[m.row] = mean;
    p.rstd[m.row] = rstd;
  }
}

template <typename T, int VEC, bool kWarpPerRow>
__global__ void layer_norm_bwd_dx_kernel(LayerNormParams p) {
  __shared__ float scratch[kWarpSize];
  const RowMap<kWarpPerRow> m;
  if (m.row >= p.rows) return;
  const T* x = static_cast<const T*>(p.x) + m.row * p.x_row_stride;
  const T* dy = static_cast<const T*>(p.dy) + m.row * p.dy_row_stride;
  T* dx = static_cast<T*>(p.dx) + m.row * p.n;
  const float mean = p.rms ? 0.f : p.mean[m.row];
  const float rstd = p.rstd[m.row];

  float c1 = 0.f, c2 = 0.f;  // sums of xhat * w * dy and of w * dy
  for (int64_t i = static_cast<int64_t>(m.first) * VEC; i < p.n;
       i += static_cast<int64_t>(m.stride) * VEC) {
    const Pack<T, VEC> xs = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
    const Pack<T, VEC> ds = *reinterpret_cast<const Pack<T, VEC>*>(dy + i);
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float wdy = to_float(ds.v[j]) * (p.weight ? p.weight[i + j] : 1.f);
      c1 += (to_float(xs.v[j]) - mean) * rstd * wdy;
      c2 += wdy;
    }
  }
  c1 = row_sum<kWarpPerRow>(c1, scratch) / p.n;
  c2 = p.rms ? 0.f : row_sum<kWarpPerRow>(c2, scratch) / p.n;

  for (int64_t i = static_cast<int64_t>(m.first) * VEC; i < p.n;
       i += static_cast<int64_t>(m.stride) * VEC) {
    const Pack<T, VEC> xs = *reinterpret_cast<const Pack<T, VEC>*>(x + i);
    const Pack<T, VEC> ds = *reinterpret_cast<const Pack<T, VEC>*>(dy + i);
    Pack<T, VEC> out;
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      const float wdy = to_float(ds.v[j]) * (p.weight ? p.weight[i + j] : 1.f);
      const float xhat = (to_float(xs.v[j]) - mean) * rstd;
      out.v[j] = from_float<T>((wdy - (xhat * c1 + c2)) * rstd);
    }
    *reinterpret_cast<Pack<T, VEC>*>(dx + i) = out;
  }
}

// Partial dweight/dbias: one thread per column, one grid row per group of rows; coalesced
// across the threads of a block.
template <typename T>
__global__ void layer_norm_bwd_params_kernel(LayerNormParams p) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= p.n) return;
  const int64_t per_group = (p.rows + p.groups - 1) / p.groups;
  const int64_t first = blockIdx.y * per_group;
  const int64_t last = first + per_group < p.rows ? first + per_group : p.rows;
  float dw = 0.f, db = 0.f;
  for (int64_t r = first; r < last; ++r) {
    const float g = to_float(static_cast<const T*>(p.dy)[r * p.dy_row_stride + col]);
    const float v = to_float(static_cast<const T*>(p.x)[r * p.x_row_stride + col]);
    dw += g * (v - (p.rms ? 0.f : p.mean[r])) * p.rstd[r];
    db += g;
  }
  p.dweight_partial[blockIdx.y * p.n + col] = dw;
  p.dbias_partial[blockIdx.y * p.n + col] = db;
}

// Sums the groups' partials of each column in group order, in fp64: the fused backward runs one
// wave of row groups (resident blocks x rows per block), and an fp32 running sum over them
// drifted 14 ulp from the float64 truth on the H100 (fp32, N=1024, 3000 rows: dweight off by
// 2.1e-4 at -135, 5.8x the fp32 baseline's error, past the k-times rule). One fp64 add per
// 4-byte partial read (not timed yet).
__global__ void reduce_partials_kernel(const float* partial, float* out, int64_t groups,
                                       int64_t n) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= n) return;
  double acc = 0.0;
  for (int64_t g = 0; g < groups; ++g) acc += partial[g * n + col];
  out[col] = static_cast<float>(acc);
}

template <typename T>
int vector_width(const LayerNormParams& p) {
  // 16-byte packs when every row start is 16-byte aligned and the row splits into packs.
  constexpr int kVec = 16 / sizeof(T);
  const bool aligned = reinterpret_cast<uintptr_t>(p.x) % 16 == 0 &&
                       (p.dy == nullptr || reinterpret_cast<uintptr_t>(p.dy) % 16 == 0) &&
                       p.n % kVec == 0 && p.x_row_stride % kVec == 0 &&
                       (p.dy == nullptr || p.dy_row_stride % kVec == 0);
  return aligned ? kVec : 1;
}

// Block-per-row threads: about four packs per thread, 128 to 512. What a row costs besides its
// elements (two or three block reductions, their barriers, the row setup) is paid once per
// warp: 512 threads on a 4096-element bf16 row issue ~2.1 warp-instructions per element in the
// forward (sm_90a SASS: ~380 per warp outside the loops, 152 per loop iteration of 8
// elements), 128 threads ~1.0, against a budget of ~1.0 at the copy rate.
inline int row_threads(int64_t n, int vec) {
  int threads = kBlockThreadsMin;
  while (threads < kBlockThreadsMax && int64_t{threads} * vec * 4 < n) threads *= 2;
  return threads;
}

template <typename T, int VEC, bool kWarpPerRow>
void launch_row_kernel(void (*kernel)(LayerNormParams), const LayerNormParams& p,
                       cudaStream_t stream) {
  if (kWarpPerRow) {
    const int64_t blocks = (p.rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * kWarpSize, 0, stream>>>(p);
  } else {
    kernel<<<static_cast<unsigned>(p.rows), row_threads(p.n, VEC), 0, stream>>>(p);
  }
  FUSEDATTN_LAUNCH_CHECK();
}

}  // namespace

void layer_norm_forward(const LayerNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  FLOATING_SWITCH(p.dtype, T, [&] {
    if (layernorm_rows::run<T>(false, p, stream)) return;
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = vector_width<T>(p) == kVec;
    BOOL_SWITCH(p.n <= kWarpRowMax, kWarpPerRow, [&] {
      if (vec) {
        launch_row_kernel<T, kVec, kWarpPerRow>(layer_norm_fwd_kernel<T, kVec, kWarpPerRow>, p,
                                                stream);
      } else {
        launch_row_kernel<T, 1, kWarpPerRow>(layer_norm_fwd_kernel<T, 1, kWarpPerRow>, p, stream);
      }
    });
  });
}

int64_t layer_norm_backward_groups(const LayerNormParams& p, int64_t fallback) {
  if (p.rows == 0) return fallback;
  return FLOATING_SWITCH(p.dtype, T, [&] {
    const int64_t fused = layernorm_rows::fused_groups<T>(p);
    return fused > 0 ? fused : fallback;
  });
}

void layer_norm_backward(const LayerNormParams& p, cudaStream_t stream) {
  if (p.rows == 0) return;
  FLOATING_SWITCH(p.dtype, T, [&] {
    if (layernorm_rows::run_fused<T>(p, stream)) return;  // dx and the partials in one pass
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = vector_width<T>(p) == kVec;
    if (!layernorm_rows::run<T>(true, p, stream)) {
      BOOL_SWITCH(p.n <= kWarpRowMax, kWarpPerRow, [&] {
        if (vec) {
          launch_row_kernel<T, kVec, kWarpPerRow>(layer_norm_bwd_dx_kernel<T, kVec, kWarpPerRow>, p,
                                                  stream);
        } else {
          launch_row_kernel<T, 1, kWarpPerRow>(layer_norm_bwd_dx_kernel<T, 1, kWarpPerRow>, p,
                                               stream);
        }
      });
    }
    if (p.dweight_partial != nullptr) {
      const dim3 grid(static_cast<unsigned>((p.n + kParamThreads - 1) / kParamThreads),
                      static_cast<unsigned>(p.groups));
      layer_norm_bwd_params_kernel<T><<<grid, kParamThreads, 0, stream>>>(p);
      FUSEDATTN_LAUNCH_CHECK();
    }
  });
}

void layer_norm_reduce_partials(const float* partial, float* out, int64_t groups, int64_t n,
                                cudaStream_t stream) {
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kParamThreads - 1) / kParamThreads);
  reduce_partials_kernel<<<blocks, kParamThreads, 0, stream>>>(partial, out, groups, n);
  FUSEDATTN_LAUNCH_CHECK();
}

}  // namespace fusedattn
