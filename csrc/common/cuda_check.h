// Error checks for CUDA runtime calls and kernel launches.
// No torch headers here: kernel translation units include this and stay fast to compile.
#pragma once

#include <cuda_runtime.h>

#include <sstream>
#include <stdexcept>
#include <string>

namespace fusedattn {

[[noreturn]] inline void throw_cuda_error(cudaError_t status, const char* expr, const char* file,
                                          int line) {
  std::ostringstream msg;
  msg << "CUDA error " << cudaGetErrorName(status) << " (" << cudaGetErrorString(status)
      << ") from `" << expr << "` at " << file << ":" << line;
  throw std::runtime_error(msg.str());
}

}  // namespace fusedattn

// Wrap every CUDA runtime call: FUSEDATTN_CUDA_CHECK(cudaMemsetAsync(...));
#define FUSEDATTN_CUDA_CHECK(expr)                                                 \
  do {                                                                             \
    const cudaError_t fusedattn_status_ = (expr);                                  \
    if (fusedattn_status_ != cudaSuccess) {                                        \
      ::fusedattn::throw_cuda_error(fusedattn_status_, #expr, __FILE__, __LINE__); \
    }                                                                              \
  } while (0)

// Put after every <<<...>>> launch: catches bad launch configurations at the call site.
#define FUSEDATTN_LAUNCH_CHECK() FUSEDATTN_CUDA_CHECK(cudaGetLastError())
