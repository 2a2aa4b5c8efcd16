// Entry points: validate the params (the binding has checked tensors; these are the kernel's
// own preconditions) and dispatch to the (element type, padded head dim) instantiation.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "attention/attention.h"
#include "common/cuda_check.h"
#include "common/static_switch.h"

namespace fusedattn {
namespace {

void check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("attention (cuda backend): " + what);
}

void check_params(const AttentionParams& p) {
  check(p.dtype == DType::kFloat16 || p.dtype == DType::kBFloat16,
        "takes float16 and bfloat16 inputs");
  check(p.head_dim > 0 && p.head_dim_v > 0 && p.head_dim % 8 == 0 && p.head_dim_v % 8 == 0,
        "head dims must be positive multiples of 8, got D=" + std::to_string(p.head_dim) +
            ", Dv=" + std::to_string(p.head_dim_v));
  check(p.kv_heads > 0 && p.heads % p.kv_heads == 0,
        "q heads must be a multiple of kv heads, got " + std::to_string(p.heads) + " and " +
            std::to_string(p.kv_heads));
  check(p.dropout_p >= 0.f && p.dropout_p < 1.f, "dropout_p must be in [0, 1)");
  check(p.dropout_p == 0.f || p.seed != nullptr, "dropout needs a seed");
  int device = 0, major = 0;
  FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  FUSEDATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  check(major >= 8, "needs a GPU of compute capability 8.0 or newer (mma.sync bf16, cp.async)");
}

}  // namespace

void attention_forward(const AttentionParams& p, cudaStream_t stream) {
  check_params(p);
  if (p.batch == 0 || p.heads == 0 || p.seqlen_q == 0) return;
  HEADDIM_SWITCH(std::max(p.head_dim, p.head_dim_v), kHeadDim, [&] {
    if (p.dtype == DType::kFloat16) {
      run_attention_forward<__half, kHeadDim>(p, stream);
    } else {
      run_attention_forward<__nv_bfloat16, kHeadDim>(p, stream);
    }
  });
}

int attention_backward_dq_splits(const AttentionParams& p) {
  check_params(p);
  check(p.backward_kernel >= 0 && p.backward_kernel <= 2,
        "unknown backward kernel " + std::to_string(p.backward_kernel));
  if (p.batch == 0 || p.heads == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) return 0;
  return HEADDIM_SWITCH(std::max(p.head_dim, p.head_dim_v), kHeadDim, [&] {
    return p.dtype == DType::kFloat16 ? fused_backward_dq_splits<__half, kHeadDim>(p)
                                      : fused_backward_dq_splits<__nv_bfloat16, kHeadDim>(p);
  });
}

void attention_backward(const AttentionParams& p, cudaStream_t stream) {
  check_params(p);
  if (p.batch == 0 || p.heads == 0 || p.seqlen_q == 0 || p.seqlen_k == 0) return;  // caller zeroes
  const int splits = attention_backward_dq_splits(p);
  check(p.dq_splits == splits && (splits == 0 || p.dq_accum != nullptr),
        "the backward needs " + std::to_string(splits) + " dQ accumulators, was given " +
            std::to_string(p.dq_accum ? p.dq_splits : 0));
  HEADDIM_SWITCH(std::max(p.head_dim, p.head_dim_v), kHeadDim, [&] {
    if (p.dtype == DType::kFloat16) {
      run_attention_backward<__half, kHeadDim>(p, stream);
    } else {
      run_attention_backward<__nv_bfloat16, kHeadDim>(p, stream);
    }
  });
}

}  // namespace fusedattn
