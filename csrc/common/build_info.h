// Facts fixed when fusedattn._C was compiled, reported by `python -m fusedattn.info`.
#pragma once

#include <string>
#include <vector>

namespace fusedattn {

// CUDART_VERSION of the toolkit the extension was compiled with, e.g. 13000.
int compiled_cuda_version();
// Version of the CUDA runtime loaded now (cudaRuntimeGetVersion); needs no GPU.
int runtime_cuda_version();
// Device archs nvcc generated code for, from __CUDA_ARCH_LIST__, e.g. {800, 900}.
std::vector<int> compiled_archs();
// Head dims the attention kernels are instantiated for (see HEADDIM_SWITCH).
std::vector<int> instantiated_head_dims();

}  // namespace fusedattn
