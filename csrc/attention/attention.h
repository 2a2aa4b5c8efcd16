// Flash attention in CUDA C++: the params struct the binding fills and the two entry points.
// No torch headers: kernel translation units include this and stay fast to compile.
//
// Layouts (element strides, unit last stride, every stride and pointer 16-byte aligned):
// q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv), out (B, H, Tq, Dv); q head h reads
// kv head h / (H / Hkv) (GQA). Masks: an optional attn_mask read through (b, h, q, k) strides
// (0 = broadcast; bool keeps where true, float32 is added to the scaled scores), an optional
// key padding mask (B, Tk) (true = padding), causal top-left (key j for query i when j <= i).
// A query that sees no key gives 0 output, 0 gradients and lse = -inf.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/static_switch.h"

namespace fusedattn {

struct AttentionParams {
  // forward inputs and outputs
  const void* q;
  const void* k;
  const void* v;
  void* out;
  float* lse;           // (B, H, Tq) contiguous, natural log
  int64_t q_stride[3];  // batch, head, row (elements)
  int64_t k_stride[3];
  int64_t v_stride[3];
  int64_t out_stride[3];

  // optional masks
  const void* mask;  // nullptr, bool (1 byte) or float32
  bool mask_is_bool;
  int64_t mask_stride[4];      // batch, head, query, key; 0 where broadcast
  const uint8_t* key_padding;  // nullptr or (B, Tk) bool, true = padding
  int64_t key_padding_stride;  // batch stride; the key stride is 1

  // dropout: keep a probability with chance 1 - dropout_p, Philox stream from *seed
  float dropout_p;
  const int64_t* seed;  // device pointer (read by the kernels), nullptr without dropout

  // backward only
  const void* dout;
  void* dq;
  void* dk;
  void* dv;
  int64_t dout_stride[3];
  int64_t dq_stride[3];
  int64_t dk_stride[3];
  int64_t dv_stride[3];
  float* delta;         // (B, H, Tq) scratch: rowsum(dout * out)
  float* dscores;       // nullptr or dense (B, H, Tq, Tk) fp32: gradient of the scaled scores
  int backward_kernel;  // a BackwardKernel
  // The fused backward's dQ accumulators, fp32 (dq_splits, B * H * Tq, head_dim), when
  // attention_backward_dq_splits(p) > 0 (the caller allocates them; no zeroing needed).
  float* dq_accum;
  int dq_splits;

  int batch, heads, kv_heads, seqlen_q, seqlen_k, head_dim, head_dim_v;
  float scale;  // on q.k before the softmax
  bool is_causal;
  DType dtype;  // float16 or bfloat16
};

// Which backward runs. kSplit: delta, then dQ by query block and dK/dV by key block (S and dP
// computed twice). kFused: delta, then one pass per key block writing dK, dV and per-split fp32
// dQ partials, then a kernel summing the splits (deterministic); only where it applies (no
// attn_mask or dropout, padded head dim 64 or 128, the shared memory, enough blocks to fill
// the GPU), else kSplit. kAuto: the launch policy's choice.
enum class BackwardKernel : int { kAuto = 0, kSplit = 1, kFused = 2 };

// The number of dQ accumulators the backward of p needs (p.backward_kernel set): 0 unless it
// runs the fused kernel. The caller sets p.dq_accum and p.dq_splits to match.
int attention_backward_dq_splits(const AttentionParams& p);

// Both throw std::invalid_argument / std::runtime_error on bad input or a failed launch.
void attention_forward(const AttentionParams& p, cudaStream_t stream);
void attention_backward(const AttentionParams& p, cudaStream_t stream);

// Launchers, instantiated per (element type, padded head dim) in attention_{fwd,bwd}_hdim*.cu.
template <typename T, int kHeadDim>
void run_attention_forward(const AttentionParams& p, cudaStream_t stream);
template <typename T, int kHeadDim>
void run_attention_backward(const AttentionParams& p, cudaStream_t stream);
template <typename T, int kHeadDim>
int fused_backward_dq_splits(const AttentionParams& p);

}  // namespace fusedattn
