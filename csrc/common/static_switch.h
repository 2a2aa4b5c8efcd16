// Runtime -> compile-time switches, so each kernel is instantiated for a small, explicit matrix
// (dtype x a few head dims x flags). Build time is a feature users feel: add a case here only
// with a benchmark that needs it.
//
// Usage:
//   BOOL_SWITCH(params.is_causal, kIsCausal, [&] { launch<kIsCausal>(params, stream); });
//   HEADDIM_SWITCH(params.head_dim, kHeadDim, [&] { launch<kHeadDim>(params, stream); });
#pragma once

#include <stdexcept>
#include <string>

#define BOOL_SWITCH(COND, CONST_NAME, ...)      \
  [&] {                                         \
    if (COND) {                                 \
      constexpr static bool CONST_NAME = true;  \
      return __VA_ARGS__();                     \
    } else {                                    \
      constexpr static bool CONST_NAME = false; \
      return __VA_ARGS__();                     \
    }                                           \
  }()

// Head dims are rounded up to the next instantiated size; the padded lanes are masked in the
// kernel. 32/64/96/128/256 cover the models we target (40 -> 64, 80 -> 96, 160 -> 256). A build
// may leave some out (FUSEDATTN_CUDA_HEAD_DIMS, python/fusedattn/_build/toolkit.py defines
// FUSEDATTN_HDIM<D>=0 for them): their cases are discarded (`if constexpr`, so nothing
// references their translation units) and a smaller head dim rounds up to the next one built.
#ifndef FUSEDATTN_HDIM32
#define FUSEDATTN_HDIM32 1
#endif
#ifndef FUSEDATTN_HDIM64
#define FUSEDATTN_HDIM64 1
#endif
#ifndef FUSEDATTN_HDIM96
#define FUSEDATTN_HDIM96 1
#endif
#ifndef FUSEDATTN_HDIM128
#define FUSEDATTN_HDIM128 1
#endif
#ifndef FUSEDATTN_HDIM256
#define FUSEDATTN_HDIM256 1
#endif

#define FUSEDATTN_HEADDIM_CASE(HEADDIM, DIM, CONST_NAME, ...) \
  if constexpr (FUSEDATTN_HDIM##DIM) {                        \
    if ((HEADDIM) <= DIM) {                                   \
      constexpr static int CONST_NAME = DIM;                  \
      return __VA_ARGS__();                                   \
    }                                                         \
  }

#define HEADDIM_SWITCH(HEADDIM, CONST_NAME, ...)                                        \
  [&] {                                                                                 \
    FUSEDATTN_HEADDIM_CASE(HEADDIM, 32, CONST_NAME, __VA_ARGS__)                        \
    FUSEDATTN_HEADDIM_CASE(HEADDIM, 64, CONST_NAME, __VA_ARGS__)                        \
    FUSEDATTN_HEADDIM_CASE(HEADDIM, 96, CONST_NAME, __VA_ARGS__)                        \
    FUSEDATTN_HEADDIM_CASE(HEADDIM, 128, CONST_NAME, __VA_ARGS__)                       \
    FUSEDATTN_HEADDIM_CASE(HEADDIM, 256, CONST_NAME, __VA_ARGS__)                       \
    throw std::invalid_argument("head dim " + std::to_string(HEADDIM) +                 \
                                " is larger than the largest this build instantiated"); \
  }()

// Element types by a runtime tag; kernels see cuda_fp16 / cuda_bf16 types, never torch's.
namespace fusedattn {
enum class DType : int { kFloat16 = 0, kBFloat16 = 1, kFloat32 = 2 };
}  // namespace fusedattn

// Element types the kernels take (fp32 included; a kernel that refuses fp32 does so in Python).
#define FLOATING_SWITCH(DTYPE, TYPE_NAME, ...)                                       \
  [&] {                                                                              \
    if ((DTYPE) == ::fusedattn::DType::kFloat32) {                                   \
      using TYPE_NAME = float;                                                       \
      return __VA_ARGS__();                                                          \
    } else if ((DTYPE) == ::fusedattn::DType::kFloat16) {                            \
      using TYPE_NAME = __half;                                                      \
      return __VA_ARGS__();                                                          \
    } else if ((DTYPE) == ::fusedattn::DType::kBFloat16) {                           \
      using TYPE_NAME = __nv_bfloat16;                                               \
      return __VA_ARGS__();                                                          \
    } else {                                                                         \
      throw std::invalid_argument("expected a float16, bfloat16 or float32 tensor"); \
    }                                                                                \
  }()
