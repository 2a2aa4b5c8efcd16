// LayerNorm and RMSNorm over rows of N elements: launchers callable without torch headers.
// RMSNorm (rms = true) is LayerNorm with mean 0 and no bias.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/static_switch.h"

namespace fusedattn {

struct LayerNormParams {
  const void* x;           // (M, N), unit column stride, row stride x_row_stride
  void* y;                 // (M, N) contiguous
  const float* weight;     // (N) fp32 or nullptr
  const float* bias;       // (N) fp32 or nullptr
  float* mean;             // (M) fp32
  float* rstd;             // (M) fp32
  const void* dy;          // backward: (M, N), row stride dy_row_stride
  void* dx;                // backward: (M, N) contiguous
  float* dweight_partial;  // backward: (groups, N) fp32, nullptr to skip parameter grads
  float* dbias_partial;    // backward: (groups, N) fp32
  int64_t rows;
  int64_t n;
  int64_t x_row_stride;
  int64_t dy_row_stride;
  int64_t groups;  // backward: row groups of the two-stage parameter reduction
  float eps;
  bool rms;  // RMSNorm: no centring (mean 0, written as 0), no mean term in the backward
  DType dtype;
};

void layer_norm_forward(const LayerNormParams& params, cudaStream_t stream);
// Row groups of the parameter-gradient partials for these rows: the fused backward's own count
// where it takes them (aligned rows up to 8192 elements, 4096 fp32), `fallback` otherwise.
// Allocate (groups, N) partials with it and pass it as params.groups.
int64_t layer_norm_backward_groups(const LayerNormParams& params, int64_t fallback);
void layer_norm_backward(const LayerNormParams& params, cudaStream_t stream);
// dweight/dbias = column sums of the (groups, N) partials, in group order (deterministic).
void layer_norm_reduce_partials(const float* partial, float* out, int64_t groups, int64_t n,
                                cudaStream_t stream);

}  // namespace fusedattn
