// The one binding file: converts torch tensors to the kernels' params structs and declares
// what fusedattn._C exposes. Kernel files never include torch headers.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>
#include <torch/version.h>

#include "attention/attention.h"
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

// rms: RMSNorm through the same kernels (mean 0, no bias; the saved mean is written as 0).
std::vector<torch::Tensor> layer_norm_fwd(const torch::Tensor& x,
                                          const c10::optional<torch::Tensor>& weight,
                                          const c10::optional<torch::Tensor>& bias, double eps,
                                          bool rms) {
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
  p.rms = rms;
  p.dtype = dtype_of(x);
  fusedattn::layer_norm_forward(p, c10::cuda::getCurrentCUDAStream());
  return {y, mean, rstd};
}

std::vector<torch::Tensor> layer_norm_bwd(const torch::Tensor& dy, const torch::Tensor& x,
                                          const c10::optional<torch::Tensor>& weight,
                                          const torch::Tensor& mean, const torch::Tensor& rstd,
                                          bool param_grads, int64_t groups, bool rms) {
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
  fusedattn::LayerNormParams p{};
  p.x = x.data_ptr();
  p.dy = dy.data_ptr();
  p.dx = dx.data_ptr();
  p.weight = optional_fp32(weight, N);
  p.mean = mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.rows = M;
  p.n = N;
  p.x_row_stride = x.stride(0);
  p.dy_row_stride = dy.stride(0);
  p.rms = rms;  // mean is then never read (RMSNorm passes rstd in its place)
  p.dtype = dtype_of(x);
  // The fused backward (dx and the partials in one pass) sizes its own row groups.
  if (param_grads) groups = fusedattn::layer_norm_backward_groups(p, groups);
  // With rows, every (group, column) is written by the kernel that fills them (the fused
  // backward's groups write zeros when they get no row; the params kernel's grid covers every
  // group and column), so no memset (fused, N=1024 bf16: ~1600 groups, 13 MB, ~2 % of what
  // the backward moves). Without rows no kernel runs: zeros.
  const auto partials = [&] {
    if (!param_grads) return torch::empty({0}, fp32);
    return M > 0 ? torch::empty({groups, N}, fp32) : torch::zeros({groups, N}, fp32);
  };
  auto partial_w = partials();
  auto partial_b = partials();
  p.dweight_partial = param_grads ? partial_w.data_ptr<float>() : nullptr;
  p.dbias_partial = param_grads ? partial_b.data_ptr<float>() : nullptr;
  p.groups = groups;
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

// ---- attention ------------------------------------------------------------------------------

// (B, H, T, D) with a unit last stride, 16-byte aligned rows: the kernels copy 16 bytes at a
// time. Strides of size-1 dims are never used for addressing, so they may be anything.
void check_attention_tensor(const torch::Tensor& t, const char* name, const torch::Tensor& q) {
  TORCH_CHECK(t.is_cuda() && t.device() == q.device(), name, " must be on q's CUDA device");
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D (B, H, T, D), got ", t.dim(), " dims");
  TORCH_CHECK(t.scalar_type() == q.scalar_type(), name, " must have q's dtype");
  TORCH_CHECK(t.size(3) == 0 || t.stride(3) == 1, name, " must have a unit last stride");
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be 16-byte aligned");
  for (int i = 0; i < 3; ++i) {
    TORCH_CHECK(t.size(i) <= 1 || t.stride(i) % 8 == 0, name,
                " needs strides that are multiples of 8 elements, got ", t.strides());
  }
}

void copy_3(int64_t* dst, const torch::Tensor& t) {
  for (int i = 0; i < 3; ++i) dst[i] = t.stride(i);
}

fusedattn::AttentionParams attention_params(const torch::Tensor& q, const torch::Tensor& k,
                                            const torch::Tensor& v, const torch::Tensor& out,
                                            const torch::Tensor& lse,
                                            const c10::optional<torch::Tensor>& attn_mask,
                                            const c10::optional<torch::Tensor>& key_padding_mask,
                                            bool is_causal, double scale, double dropout_p,
                                            const c10::optional<torch::Tensor>& seed) {
  check_attention_tensor(q, "q", q);
  check_attention_tensor(k, "k", q);
  check_attention_tensor(v, "v", q);
  check_attention_tensor(out, "out", q);
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Tk = k.size(2), Dv = v.size(3);
  TORCH_CHECK(
      k.size(0) == B && v.size(0) == B && v.size(1) == Hkv && v.size(2) == Tk && k.size(3) == D,
      "q, k, v shapes disagree: ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  TORCH_CHECK(out.sizes() == torch::IntArrayRef({B, H, Tq, Dv}), "out must be (B, H, Tq, Dv)");
  TORCH_CHECK(lse.is_cuda() && lse.scalar_type() == torch::kFloat32 && lse.is_contiguous() &&
                  lse.sizes() == torch::IntArrayRef({B, H, Tq}),
              "lse must be contiguous float32 (B, H, Tq)");
  TORCH_CHECK(Tq < (int64_t{1} << 31) && Tk < (int64_t{1} << 31) && B * H < (int64_t{1} << 31),
              "sequence lengths and B*H must fit in 31 bits");
  fusedattn::AttentionParams p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.out = out.data_ptr();
  p.lse = lse.data_ptr<float>();
  copy_3(p.q_stride, q);
  copy_3(p.k_stride, k);
  copy_3(p.v_stride, v);
  copy_3(p.out_stride, out);
  if (attn_mask.has_value()) {
    const auto& m = *attn_mask;
    TORCH_CHECK(m.is_cuda() && m.sizes() == torch::IntArrayRef({B, H, Tq, Tk}),
                "attn_mask must be a CUDA (B, H, Tq, Tk) view (expanded: strides 0)");
    TORCH_CHECK(m.scalar_type() == torch::kBool || m.scalar_type() == torch::kFloat32,
                "attn_mask must be bool or float32");
    p.mask = m.data_ptr();
    p.mask_is_bool = m.scalar_type() == torch::kBool;
    for (int i = 0; i < 4; ++i) p.mask_stride[i] = m.stride(i);
  }
  if (key_padding_mask.has_value()) {
    const auto& m = *key_padding_mask;
    TORCH_CHECK(m.is_cuda() && m.scalar_type() == torch::kBool &&
                    m.sizes() == torch::IntArrayRef({B, Tk}) && (Tk <= 1 || m.stride(1) == 1),
                "key_padding_mask must be a CUDA bool (B, Tk) tensor with a unit key stride");
    p.key_padding = reinterpret_cast<const uint8_t*>(m.data_ptr<bool>());
    p.key_padding_stride = m.stride(0);
  }
  p.dropout_p = static_cast<float>(dropout_p);
  if (dropout_p > 0.0) {
    TORCH_CHECK(seed.has_value() && seed->is_cuda() && seed->scalar_type() == torch::kInt64 &&
                    seed->numel() == 1,
                "dropout needs a one-element int64 CUDA seed tensor");
    p.seed = seed->data_ptr<int64_t>();
  }
  p.batch = static_cast<int>(B);
  p.heads = static_cast<int>(H);
  p.kv_heads = static_cast<int>(Hkv);
  p.seqlen_q = static_cast<int>(Tq);
  p.seqlen_k = static_cast<int>(Tk);
  p.head_dim = static_cast<int>(D);
  p.head_dim_v = static_cast<int>(Dv);
  p.scale = static_cast<float>(scale);
  p.is_causal = is_causal;
  p.dtype = dtype_of(q);
  return p;
}

void attention_fwd(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                   torch::Tensor& out, torch::Tensor& lse,
                   const c10::optional<torch::Tensor>& attn_mask,
                   const c10::optional<torch::Tensor>& key_padding_mask, bool is_causal,
                   double scale, double dropout_p, const c10::optional<torch::Tensor>& seed) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto p = attention_params(q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale,
                                  dropout_p, seed);
  fusedattn::attention_forward(p, c10::cuda::getCurrentCUDAStream());
}

void attention_bwd(const torch::Tensor& dout, const torch::Tensor& q, const torch::Tensor& k,
                   const torch::Tensor& v, const torch::Tensor& out, const torch::Tensor& lse,
                   torch::Tensor& dq, torch::Tensor& dk, torch::Tensor& dv, torch::Tensor& delta,
                   const c10::optional<torch::Tensor>& dscores,
                   const c10::optional<torch::Tensor>& attn_mask,
                   const c10::optional<torch::Tensor>& key_padding_mask, bool is_causal,
                   double scale, double dropout_p, const c10::optional<torch::Tensor>& seed,
                   int64_t backward_kernel) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto p = attention_params(q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale,
                            dropout_p, seed);
  check_attention_tensor(dout, "dout", q);
  check_attention_tensor(dq, "dq", q);
  check_attention_tensor(dk, "dk", q);
  check_attention_tensor(dv, "dv", q);
  TORCH_CHECK(dout.sizes() == out.sizes() && dq.sizes() == q.sizes() && dk.sizes() == k.sizes() &&
                  dv.sizes() == v.sizes(),
              "gradients must match their inputs' shapes");
  TORCH_CHECK(delta.is_cuda() && delta.scalar_type() == torch::kFloat32 && delta.is_contiguous() &&
                  delta.sizes() == lse.sizes(),
              "delta must be contiguous float32 (B, H, Tq)");
  p.dout = dout.data_ptr();
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  copy_3(p.dout_stride, dout);
  copy_3(p.dq_stride, dq);
  copy_3(p.dk_stride, dk);
  copy_3(p.dv_stride, dv);
  p.delta = delta.data_ptr<float>();
  if (dscores.has_value()) {
    TORCH_CHECK(p.mask != nullptr && !p.mask_is_bool, "dscores needs a float attn_mask");
    TORCH_CHECK(
        dscores->is_cuda() && dscores->scalar_type() == torch::kFloat32 &&
            dscores->is_contiguous() &&
            dscores->sizes() == torch::IntArrayRef({q.size(0), q.size(1), q.size(2), k.size(2)}),
        "dscores must be contiguous float32 (B, H, Tq, Tk)");
    p.dscores = dscores->data_ptr<float>();
  }
  TORCH_CHECK(backward_kernel >= 0 && backward_kernel <= 2, "backward_kernel must be 0 (auto), ",
              "1 (split) or 2 (fused), got ", backward_kernel);
  p.backward_kernel = static_cast<int>(backward_kernel);
  // The fused backward's per-split fp32 dQ partials: written before they are read, so empty.
  p.dq_splits = fusedattn::attention_backward_dq_splits(p);
  torch::Tensor dq_accum;
  if (p.dq_splits > 0) {
    dq_accum = torch::empty({p.dq_splits, q.size(0) * q.size(1) * q.size(2), q.size(3)},
                            q.options().dtype(torch::kFloat32));
    p.dq_accum = dq_accum.data_ptr<float>();
  }
  fusedattn::attention_backward(p, c10::cuda::getCurrentCUDAStream());
}

// How many fp32 dQ accumulators the backward of these inputs takes with this backward_kernel:
// 0 unless it runs the fused kernel (tests and benchmarks check which backward ran).
int64_t attention_bwd_dq_splits(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& out,
                                const torch::Tensor& lse,
                                const c10::optional<torch::Tensor>& attn_mask,
                                const c10::optional<torch::Tensor>& key_padding_mask,
                                bool is_causal, double scale, double dropout_p,
                                const c10::optional<torch::Tensor>& seed, int64_t backward_kernel) {
  const c10::cuda::CUDAGuard guard(q.device());
  auto p = attention_params(q, k, v, out, lse, attn_mask, key_padding_mask, is_causal, scale,
                            dropout_p, seed);
  TORCH_CHECK(backward_kernel >= 0 && backward_kernel <= 2, "backward_kernel must be 0 (auto), ",
              "1 (split) or 2 (fused), got ", backward_kernel);
  p.backward_kernel = static_cast<int>(backward_kernel);
  return fusedattn::attention_backward_dq_splits(p);
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
  info["ops"] = std::vector<std::string>{"attention", "layer_norm", "rms_norm", "softmax"};
  return info;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fusedattn CUDA C++ kernels";
  m.def("build_info", &build_info,
        "What this extension was compiled with: CUDA versions, archs, instantiated head dims, "
        "and the ops it provides.");
  m.def("layer_norm_fwd", &layer_norm_fwd,
        "LayerNorm (or RMSNorm with rms=True) of (M, N) rows -> (y, mean, rstd)");
  m.def("layer_norm_bwd", &layer_norm_bwd,
        "LayerNorm (or RMSNorm) backward -> (dx, dweight fp32, dbias fp32), deterministic");
  m.def("softmax_fwd", &softmax_fwd, "softmax over the last axis of an (A, B, C, N) view");
  m.def("softmax_bwd", &softmax_bwd, "softmax backward into dx (dy is never written)");
  m.def("attention_fwd", &attention_fwd,
        "flash attention forward into out (B, H, Tq, Dv) and lse (B, H, Tq) fp32");
  m.def("attention_bwd", &attention_bwd,
        "flash attention backward into dq, dk, dv (deterministic); delta is scratch; dscores "
        "(optional) receives the dense gradient of the scores for a float mask; "
        "backward_kernel: 0 auto, 1 split (dQ and dK/dV kernels), 2 fused where it applies");
  m.def("attention_bwd_dq_splits", &attention_bwd_dq_splits,
        "fp32 dQ accumulators the backward takes with this backward_kernel (0: not fused)");
}
