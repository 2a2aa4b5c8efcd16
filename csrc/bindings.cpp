// The one binding file: declares what fusedattn._C exposes and nothing else.
// Kernel families add their entry points here as they land (attention, layernorm, softmax).
#include <torch/extension.h>
#include <torch/version.h>

#include "common/build_info.h"

namespace {

pybind11::dict build_info() {
  pybind11::dict info;
  info["cuda_compiled"] = fusedattn::compiled_cuda_version();
  info["cuda_runtime"] = fusedattn::runtime_cuda_version();
  info["archs"] = fusedattn::compiled_archs();
  info["attention_head_dims"] = fusedattn::instantiated_head_dims();
  info["torch_compiled"] = std::to_string(TORCH_VERSION_MAJOR) + "." +
                           std::to_string(TORCH_VERSION_MINOR) + "." +
                           std::to_string(TORCH_VERSION_PATCH);
  info["ops"] = std::vector<std::string>{};
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fusedattn CUDA C++ kernels";
  m.def("build_info", &build_info,
        "What this extension was compiled with: CUDA versions, archs, instantiated head dims, "
        "and the ops it provides.");
}
