// The one binding file: converts torch tensors to the kernels' params structs and declares
// what fusedattn._C exposes. Kernel files never include torch headers.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include <torch/version.h>

#include "common/build_info.h"
#include "common/tensor_checks.h"
#include "layernorm/layernorm.h"
#include "softmax/softmax.h"

namespace {

fusedattn::DType dtype_of(const torch::Tensor& t) {
  switch (t.scalar_type()) {
    case torch::kFloat16:
      return fusedattn::DType::kFloat16;
    case torch::kBFloat16:
      return fusedattn::DType::kBFloat16;
    case torch::kFloat32:
      return fusedattn::DType::kFloat32;
    default:
      TORCH_CHECK(false, "expected a float16, bfloat16 or float32 tensor, got ", t.scalar_type());
  }
}

const float* optional_fp32(const c10::optional<torch::Tensor>& t, int64_t n) {
  if (!t.has_value()) return nullptr;
  FUSEDATTN_CHECK_CUDA(*t);
  TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous() && t->numel() == n,
              "weight/bias must be contiguous float32 of ", n, " elements");
  return t->data_ptr<float>();
}

// ---- LayerNorm ------------------------------------------------------------------------------

std::vector<torch::Tensor> layer_norm_fwd(const torch::Tensor& x,
                                          const c10::optional<torch::Tensor>& weight,
                                          const c10::optional<torch::Tensor>& bias, double eps) {
  FUSEDATTN_CHECK_CUDA(x);
  TORCH_CHECK(x.dim() == 2 && (x.stride(1) == 1 || x.size(0) == 0), "x must be (M, N) rows");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), N = x.size(1);
  auto y = torch::empty({M, N}, x.options());
  auto mean = torch::empty({M}, x.options().dtype(torch::kFloat32));
  auto rstd = torch::empty({M}, x.options().dtype(torch::kFloat32));
  fusedattn::LayerNormParams p{};
  p.x = x.data_ptr();
  p.y = y.data_ptr();
  p.weight = optional_fp32(weight, N);
  p.bias = optional_fp32(bias, N);
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.rows = M;
  p.n = N;
  p.x_row_stride = x.stride(0);
  p.eps = static_cast<float>(eps);
  p.dtype = dtype_of(x);
  fusedattn::layer_norm_forward(p, c10::cuda::getCurrentCUDAStream());
  return {y, mean, rstd};
}

std::vector<torch::Tensor> layer_norm_bwd(const torch::Tensor& dy, const torch::Tensor& x,
                                          const c10::optional<torch::Tensor>& weight,
                                          const torch::Tensor& mean, const torch::Tensor& rstd,
                                          bool param_grads, int64_t groups) {
  FUSEDATTN_CHECK_CUDA(x);
  FUSEDATTN_CHECK_CUDA(dy);
  TORCH_CHECK(x.dim() == 2 && dy.sizes() == x.sizes(), "x and dy must be (M, N) rows");
  TORCH_CHECK(x.size(0) == 0 || (x.stride(1) == 1 && dy.stride(1) == 1),
              "x and dy need a unit column stride");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), N = x.size(1);
  groups = std::max<int64_t>(1, std::min<int64_t>(groups, std::max<int64_t>(M, 1)));
  auto dx = torch::empty({M, N}, x.options());
  auto fp32 = x.options().dtype(torch::kFloat32);
  auto partial_w = param_grads ? torch::zeros({groups, N}, fp32) : torch::empty({0}, fp32);
  auto partial_b = param_grads ? torch::zeros({groups, N}, fp32) : torch::empty({0}, fp32);
  fusedattn::LayerNormParams p{};
  p.x = x.data_ptr();
  p.dy = dy.data_ptr();
  p.dx = dx.data_ptr();
  p.weight = optional_fp32(weight, N);
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.dweight_partial = param_grads ? partial_w.data_ptr<float>() : nullptr;
  p.dbias_partial = param_grads ? partial_b.data_ptr<float>() : nullptr;
  p.rows = M;
  p.n = N;
  p.x_row_stride = x.stride(0);
  p.dy_row_stride = dy.stride(0);
  p.groups = groups;
  p.dtype = dtype_of(x);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  fusedattn::layer_norm_backward(p, stream);
  if (!param_grads) return {dx, partial_w, partial_b};
  auto dw = torch::empty({N}, fp32);
  auto db = torch::empty({N}, fp32);
  fusedattn::layer_norm_reduce_partials(partial_w.data_ptr<float>(), dw.data_ptr<float>(), groups,
                                        N, stream);
  fusedattn::layer_norm_reduce_partials(partial_b.data_ptr<float>(), db.data_ptr<float>(), groups,
                                        N, stream);
  return {dx, dw, db};
}

// ---- softmax --------------------------------------------------------------------------------

void copy_4d(const torch::Tensor& t, int64_t* strides) {
  TORCH_CHECK(t.dim() == 4, "expected an (A, B, C, N) view");
  for (int i = 0; i < 4; ++i) strides[i] = t.stride(i);
}

void softmax_fwd(const torch::Tensor& x, torch::Tensor& out,
                 const c10::optional<torch::Tensor>& keep, const c10::optional<torch::Tensor>& bias,
                 double scale, bool causal) {
  FUSEDATTN_CHECK_CUDA(x);
  FUSEDATTN_CHECK_CUDA(out);
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(), "out must match x");
  const c10::cuda::CUDAGuard guard(x.device());
  fusedattn::SoftmaxParams p{};
  p.x = x.data_ptr();
  p.out = out.data_ptr();
  copy_4d(x, p.x_stride);
  copy_4d(out, p.out_stride);
  for (int i = 0; i < 4; ++i) p.sizes[i] = x.size(i);
  if (keep.has_value()) {
    TORCH_CHECK(keep->scalar_type() == torch::kBool && keep->sizes() == x.sizes(),
                "keep must be a bool view of x's shape");
    p.keep = reinterpret_cast<const uint8_t*>(keep->data_ptr<bool>());
    copy_4d(*keep, p.mask_stride);
  } else if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->sizes() == x.sizes(),
                "bias must be a float32 view of x's shape");
    p.bias = bias->data_ptr<float>();
    copy_4d(*bias, p.mask_stride);
  }
  p.scale = static_cast<float>(scale);
  p.causal = causal;
  p.dtype = dtype_of(x);
  fusedattn::softmax_forward(p, c10::cuda::getCurrentCUDAStream());
}

void softmax_bwd(const torch::Tensor& y, const torch::Tensor& dy, torch::Tensor& dx, double scale) {
  FUSEDATTN_CHECK_CUDA(y);
  TORCH_CHECK(dy.sizes() == y.sizes() && dx.sizes() == y.sizes(), "y, dy and dx must match");
  TORCH_CHECK(dy.scalar_type() == y.scalar_type() && dx.scalar_type() == y.scalar_type(),
              "y, dy and dx must share a dtype");
  const c10::cuda::CUDAGuard guard(y.device());
  fusedattn::SoftmaxParams p{};
  p.x = y.data_ptr();
  p.dy = dy.data_ptr();
  p.out = dx.data_ptr();
  copy_4d(y, p.x_stride);
  copy_4d(dy, p.dy_stride);
  copy_4d(dx, p.out_stride);
  for (int i = 0; i < 4; ++i) p.sizes[i] = y.size(i);
  p.scale = static_cast<float>(scale);
  p.dtype = dtype_of(y);
  fusedattn::softmax_backward(p, c10::cuda::getCurrentCUDAStream());
}

pybind11::dict build_info() {
  pybind11::dict info;
  info["cuda_compiled"] = fusedattn::compiled_cuda_version();
  info["cuda_runtime"] = fusedattn::runtime_cuda_version();
  info["archs"] = fusedattn::compiled_archs();
  info["attention_head_dims"] = fusedattn::instantiated_head_dims();
  info["torch_compiled"] = std::to_string(TORCH_VERSION_MAJOR) + "." +
                           std::to_string(TORCH_VERSION_MINOR) + "." +
                           std::to_string(TORCH_VERSION_PATCH);
  info["ops"] = std::vector<std::string>{"layer_norm", "softmax"};
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fusedattn CUDA C++ kernels";
  m.def("build_info", &build_info,
        "What this extension was compiled with: CUDA versions, archs, instantiated head dims, "
        "and the ops it provides.");
  m.def("layer_norm_fwd", &layer_norm_fwd, "LayerNorm of (M, N) rows -> (y, mean, rstd)");
  m.def("layer_norm_bwd", &layer_norm_bwd,
        "LayerNorm backward -> (dx, dweight fp32, dbias fp32), deterministic");
  m.def("softmax_fwd", &softmax_fwd, "softmax over the last axis of an (A, B, C, N) view");
  m.def("softmax_bwd", &softmax_bwd, "softmax backward into dx (dy is never written)");
}
