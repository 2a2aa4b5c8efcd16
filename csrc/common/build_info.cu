// Compiled by nvcc, so a broken toolchain or a broken shared header fails the build (and CI).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "common/build_info.h"
#include "common/cuda_check.h"
#include "common/static_switch.h"

namespace fusedattn {

int compiled_cuda_version() { return CUDART_VERSION; }

int runtime_cuda_version() {
  int version = 0;
  FUSEDATTN_CUDA_CHECK(cudaRuntimeGetVersion(&version));
  return version;
}

std::vector<int> compiled_archs() {
#ifdef __CUDA_ARCH_LIST__
  // nvcc defines it (since CUDA 11.5) as the comma-separated list of -gencode compute archs.
  return std::vector<int>{__CUDA_ARCH_LIST__};
#else
  return {};
#endif
}

std::vector<int> instantiated_head_dims() {
  std::vector<int> dims;
  for (int requested : {32, 64, 96, 128, 256}) {
    try {  // a head dim left out of the build rounds up to the next built one, or throws
      HEADDIM_SWITCH(requested, kHeadDim, [&] {
        if (dims.empty() || dims.back() != kHeadDim) dims.push_back(kHeadDim);
      });
    } catch (const std::invalid_argument&) {
    }
  }
  return dims;
}

}  // namespace fusedattn
