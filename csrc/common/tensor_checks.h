// Argument checks on torch tensors, for the binding layer only (kernel files never include
// torch). The Python layer validates first with full messages; these are the last line of
// defence for direct calls into fusedattn._C.
#pragma once

#include <torch/extension.h>

#define FUSEDATTN_CHECK_CUDA(x) TORCH_CHECK((x).is_cuda(), #x " must be a CUDA tensor")
#define FUSEDATTN_CHECK_LAST_DIM_CONTIGUOUS(x) \
  TORCH_CHECK((x).stride(-1) == 1, #x " must have a unit stride in its last dimension")
#define FUSEDATTN_CHECK_SHAPE(x, ...)                           \
  TORCH_CHECK((x).sizes() == torch::IntArrayRef({__VA_ARGS__}), \
              #x " must have shape (" #__VA_ARGS__ "), got ", (x).sizes())
