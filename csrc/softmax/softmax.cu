// Softmax forward and backward over the last axis of a strided (A, B, C, N) view. One row
// per warp up to kWarpRowMax elements, one row per block beyond. The forward keeps a
// per-thread running (max, sum) in one read, combines them across the row, then writes
// exp(x - max) / sum in a second read; a row with nothing kept gives 0. Loads are scalar and
// coalesced when the N stride is 1; rows along other axes are read through their stride.
//
// Tile choices are a starting point, not yet measured on a GPU (issue #6). Unit-stride aligned
// rows without masks take the register-resident fast path of softmax_rows.cuh instead.

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/cuda_check.h"
#include "common/dtype.cuh"
#include "common/reduce.cuh"
#include "softmax/softmax.h"
#include "softmax/softmax_rows.cuh"

namespace fusedattn {
namespace {

constexpr int kWarpRowMax = 1024;
constexpr int kWarpsPerBlock = 4;
constexpr int kBlockThreads = 512;

struct Row {
  int64_t index;  // flat row over A * B * C
  int64_t c;      // position along C: the query, for causal masking
  int first;
  int stride;
};

template <bool kWarpPerRow>
__device__ __forceinline__ Row row_of_thread(const SoftmaxParams& p) {
  Row r;
  if (kWarpPerRow) {
    r.index = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize;
    r.first = threadIdx.x % kWarpSize;
    r.stride = kWarpSize;
  } else {
    r.index = blockIdx.x;
    r.first = threadIdx.x;
    r.stride = blockDim.x;
  }
  r.c = r.index % p.sizes[2];
  return r;
}

__device__ __forceinline__ int64_t offset(const int64_t* stride, const int64_t* sizes,
                                          int64_t row) {
  const int64_t c = row % sizes[2];
  const int64_t b = (row / sizes[2]) % sizes[1];
  const int64_t a = row / (sizes[1] * sizes[2]);
  return a * stride[0] + b * stride[1] + c * stride[2];
}

// x * scale with masking applied: -inf where a key is not kept.
template <typename T>
__device__ __forceinline__ float score(const SoftmaxParams& p, const T* x, int64_t mask_off,
                                       int64_t c, int64_t n) {
  float s = to_float(x[n * p.x_stride[3]]) * p.scale;
  if (p.keep && p.keep[mask_off + n * p.mask_stride[3]] == 0) return -INFINITY;
  if (p.bias) s += p.bias[mask_off + n * p.mask_stride[3]];
  if (p.causal && n > c) return -INFINITY;
  return s;
}

template <bool kWarpPerRow>
__device__ __forceinline__ float row_max(float v, float* scratch) {
  return kWarpPerRow ? warp_max(v) : block_max(v, scratch);
}

template <bool kWarpPerRow>
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  return kWarpPerRow ? warp_sum(v) : block_sum(v, scratch);
}

template <typename T, bool kWarpPerRow>
__global__ void softmax_fwd_kernel(SoftmaxParams p) {
  __shared__ float scratch[kWarpSize];
  const Row r = row_of_thread<kWarpPerRow>(p);
  if (r.index >= p.sizes[0] * p.sizes[1] * p.sizes[2]) return;
  const T* x = static_cast<const T*>(p.x) + offset(p.x_stride, p.sizes, r.index);
  T* y = static_cast<T*>(p.out) + offset(p.out_stride, p.sizes, r.index);
  const int64_t mask_off = offset(p.mask_stride, p.sizes, r.index);
  const int64_t N = p.sizes[3];

  float m = -INFINITY, s = 0.f;  // this thread's running max and sum of exp(x - m)
  for (int64_t n = r.first; n < N; n += r.stride) {
    const float v = score(p, x, mask_off, r.c, n);
    if (v == -INFINITY) continue;
    const float m_new = fmaxf(m, v);
    s = s * expf(m - m_new) + expf(v - m_new);
    m = m_new;
  }
  const float row_m = row_max<kWarpPerRow>(m, scratch);
  const float mine = m == -INFINITY ? 0.f : s * expf(m - row_m);
  const float total = row_sum<kWarpPerRow>(mine, scratch);
  const float inv = total > 0.f ? 1.f / total : 0.f;  // nothing kept: every output is 0
  for (int64_t n = r.first; n < N; n += r.stride) {
    const float v = score(p, x, mask_off, r.c, n);
    const float e = v == -INFINITY ? 0.f : expf(v - row_m);
    y[n * p.out_stride[3]] = from_float<T>(e * inv);
  }
}

template <typename T, bool kWarpPerRow>
__global__ void softmax_bwd_kernel(SoftmaxParams p) {
  __shared__ float scratch[kWarpSize];
  const Row r = row_of_thread<kWarpPerRow>(p);
  if (r.index >= p.sizes[0] * p.sizes[1] * p.sizes[2]) return;
  const T* y = static_cast<const T*>(p.x) + offset(p.x_stride, p.sizes, r.index);
  const T* dy = static_cast<const T*>(p.dy) + offset(p.dy_stride, p.sizes, r.index);
  T* dx = static_cast<T*>(p.out) + offset(p.out_stride, p.sizes, r.index);
  const int64_t N = p.sizes[3];
  float dot = 0.f;
  for (int64_t n = r.first; n < N; n += r.stride) {
    dot += to_float(y[n * p.x_stride[3]]) * to_float(dy[n * p.dy_stride[3]]);
  }
  dot = row_sum<kWarpPerRow>(dot, scratch);
  for (int64_t n = r.first; n < N; n += r.stride) {
    const float yv = to_float(y[n * p.x_stride[3]]);
    dx[n * p.out_stride[3]] =
        from_float<T>(p.scale * yv * (to_float(dy[n * p.dy_stride[3]]) - dot));
  }
}

template <typename T, bool kWarpPerRow>
void launch(void (*kernel)(SoftmaxParams), const SoftmaxParams& p, cudaStream_t stream) {
  const int64_t rows = p.sizes[0] * p.sizes[1] * p.sizes[2];
  if (kWarpPerRow) {
    const int64_t blocks = (rows + kWarpsPerBlock - 1) / kWarpsPerBlock;
    kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * kWarpSize, 0, stream>>>(p);
  } else {
    kernel<<<static_cast<unsigned>(rows), kBlockThreads, 0, stream>>>(p);
  }
  FUSEDATTN_LAUNCH_CHECK();
}

}  // namespace

void softmax_forward(const SoftmaxParams& p, cudaStream_t stream) {
  if (p.sizes[0] * p.sizes[1] * p.sizes[2] * p.sizes[3] == 0) return;
  FLOATING_SWITCH(p.dtype, T, [&] {
    if (softmax_rows::run<T>(false, p, stream)) return;
    BOOL_SWITCH(p.sizes[3] <= kWarpRowMax, kWarpPerRow,
                [&] { launch<T, kWarpPerRow>(softmax_fwd_kernel<T, kWarpPerRow>, p, stream); });
  });
}

void softmax_backward(const SoftmaxParams& p, cudaStream_t stream) {
  if (p.sizes[0] * p.sizes[1] * p.sizes[2] * p.sizes[3] == 0) return;
  FLOATING_SWITCH(p.dtype, T, [&] {
    if (softmax_rows::run<T>(true, p, stream)) return;
    BOOL_SWITCH(p.sizes[3] <= kWarpRowMax, kWarpPerRow,
                [&] { launch<T, kWarpPerRow>(softmax_bwd_kernel<T, kWarpPerRow>, p, stream); });
  });
}

}  // namespace fusedattn
