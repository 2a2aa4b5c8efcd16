// Scaled, masked, causal softmax over the last axis of an (A, B, C, N) strided view:
// launchers callable without torch headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/static_switch.h"

namespace fusedattn {

struct SoftmaxParams {
  const void* x;        // forward input (or y in the backward)
  const void* dy;       // backward: incoming gradient (never written)
  void* out;            // forward y, backward dx
  const uint8_t* keep;  // bool mask (nonzero keeps) or nullptr
  const float* bias;    // additive fp32 mask or nullptr
  int64_t x_stride[4];  // strides of the (A, B, C, N) view of x (y in the backward)
  int64_t dy_stride[4];
  int64_t out_stride[4];
  int64_t mask_stride[4];  // broadcast strides (0 where the mask broadcasts)
  int64_t sizes[4];        // A, B, C, N
  float scale;
  bool causal;  // keep key n for query c only when n <= c (top-left)
  DType dtype;
};

void softmax_forward(const SoftmaxParams& params, cudaStream_t stream);
// dx = scale * y * (dy - sum(dy * y)) along N.
void softmax_backward(const SoftmaxParams& params, cudaStream_t stream);

}  // namespace fusedattn
