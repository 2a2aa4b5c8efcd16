// Shapes of the register-resident row kernels (softmax_rows.cuh, layernorm_rows.cuh): a row of
// `vecs` 16-byte vectors goes to a warp (4 rows per 128-thread block) with 1, 2 or 4 vectors
// per lane, or to a block of 128, 256 or 512 threads with 2 to 8 vectors per thread: the
// smallest shape that holds it, so a thread holds at most 8 vectors (32 registers raw).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/cuda_check.h"
#include "common/reduce.cuh"

namespace fusedattn {
namespace rows {

constexpr int kWarpRowsPerBlock = 4;
constexpr int kMaxRowThreads = 512, kMaxVecs = 8;

template <int kRowThreads>
constexpr int block_threads() {
  return kRowThreads == kWarpSize ? kWarpRowsPerBlock * kWarpSize : kRowThreads;
}

// The row this thread works on and its index within the row's threads; false past the end
// (uniform per warp with a warp per row; a block per row never passes it).
template <int kRowThreads>
__device__ __forceinline__ bool my_row(int64_t rows, int64_t& row, int& t) {
  if (kRowThreads == kWarpSize) {
    row = static_cast<int64_t>(blockIdx.x) * kWarpRowsPerBlock + threadIdx.x / kWarpSize;
    t = threadIdx.x % kWarpSize;
  } else {
    row = blockIdx.x;
    t = threadIdx.x;
  }
  return row < rows;
}

template <int kRowThreads>
__device__ __forceinline__ float row_sum(float v, float* scratch) {
  return kRowThreads == kWarpSize ? warp_sum(v) : block_sum(v, scratch);
}

// The grid of a row kernel that gives each row its warp or block.
template <int kRowThreads>
dim3 grid_for(int64_t rows, const char* op) {
  const int64_t blocks =
      kRowThreads == kWarpSize ? (rows + kWarpRowsPerBlock - 1) / kWarpRowsPerBlock : rows;
  if (blocks > 0x7fffffff)
    throw std::invalid_argument(std::string(op) + ": more rows than a grid holds");
  return dim3(static_cast<unsigned>(blocks));
}

// Launches a row kernel with kRowThreads threads per row over num_rows rows.
template <int kRowThreads, typename Params>
void launch(void (*kernel)(Params), int64_t num_rows, const char* op, const Params& p,
            cudaStream_t stream) {
  kernel<<<grid_for<kRowThreads>(num_rows, op), block_threads<kRowThreads>(), 0, stream>>>(p);
  FUSEDATTN_LAUNCH_CHECK();
}

template <int kValue>
using Int = std::integral_constant<int, kValue>;

// Calls fn(Int<kRowThreads>(), Int<kVecs>()) with the shape for a row of `vecs` vectors
// (at most kMaxRowThreads * kMaxVecs).
template <typename Fn>
void with_shape(int64_t vecs, Fn&& fn) {
  if (vecs <= 32) {
    fn(Int<32>(), Int<1>());
  } else if (vecs <= 64) {
    fn(Int<32>(), Int<2>());
  } else if (vecs <= 128) {
    fn(Int<32>(), Int<4>());
  } else if (vecs <= 256) {
    fn(Int<128>(), Int<2>());
  } else if (vecs <= 512) {
    fn(Int<128>(), Int<4>());
  } else if (vecs <= 1024) {
    fn(Int<256>(), Int<4>());
  } else if (vecs <= 2048) {
    fn(Int<512>(), Int<4>());
  } else {
    fn(Int<512>(), Int<8>());
  }
}

}  // namespace rows
}  // namespace fusedattn
