// Launch policy of the attention kernels: tile shapes per head dim, grid shapes, shared-memory
// opt-in, and a launch check after every kernel. Included by the per-head-dim instantiation
// files (attention_{fwd,bwd}_hdim*.cu), so each head dim compiles in its own translation unit.
//
// Tiles, chosen from the register budget (255 per thread) and shared memory, then measured on
// the H200 (bf16, B=4 H=16 T=4096 D=128; benchmarks/results/h200/tune_attention.csv):
//   forward   D <= 128: 128 queries x 64 keys, 4 warps of 2 m-tiles (each K/V fragment read
//             from shared memory feeds two MMAs). 267 TFLOP/s; the variants were slower:
//             128x32 (no register spills) 249, 64x64 with 3 blocks/SM 235, 128x64 on 8 warps 184.
//             D = 256: 128 x 64 on 8 warps of 1 m-tile (O alone is 128 registers).
//             The general variant (attn_mask, dropout) takes 32-key tiles: its per-element mask
//             and Philox code would spill at 64.
//   backward  dK/dV: 64 keys (4 warps x 16) x 64-query tiles; D = 256: 32-query tiles and two
//             passes (dV, then dK), since dK + dV alone would take 256 registers.
//             dQ: 64 queries (4 warps x 16) x 64-key tiles (32 at D = 256).
//             Backward 188 TFLOP/s; 32-query dK/dV tiles 167, 128-key blocks 179; dQ with
//             32-key tiles and 3 blocks/SM 193 (within noise, not taken).
// ncu (forward): 8 warps per SM, tensor pipe 41 % busy, the top stall a fixed-latency
// dependency: latency-bound at this occupancy, which tile shapes alone did not fix.
// Shared memory at D = 256 is 135 KB per block: within sm_80's 163 KB and sm_90's 227 KB.
//
// Static screen for sm_90a (issue #13; scripts/static_cuda_attention.py, nvcc 13.0, bf16; SASS
// instructions per key-loop iteration per warp, benchmarks/results/sm90-static/). The timings
// above predate these changes, which target the issue-bound profile:
//   forward D=128  before: one loop with a run-time mask branch, 1983 (862 integer), 32 B
//                  spills. Now: copy offsets derived once per copy (TileCopy), ldmatrix
//                  addresses as a register plus an immediate, tiles walked from the last one
//                  down with the masked ones in their own loop, the scale folded into exp2's
//                  FFMA, the next K copy issued before the softmax: unmasked loop 926 (76
//                  integer; FA2 with the same tile: 908), masked 1330. Spills 128 B, ~10 local
//                  loads/stores per unmasked iteration: the tile sits at 255 registers (O is 128
//                  fp32 per thread, S 64); tuning variants 1 and 3 do not spill.
//            D=64  1748 -> unmasked 623, masked 982, no spills.  D=256: 1580 -> 783 / 1063.
//   dK/dV  D=128   1520 -> unmasked 891, masked 1040; key padding now on this fast path (a
//                  thread's two keys read once per block); lse/delta loads of the next tile
//                  overlap this tile's compute.
//   dQ     D=128   1406 -> unmasked 692, masked 906, no spills.  D=256: 1161 -> 636 / 731.
//   The general variants (attn_mask, dropout) run every tile through the masked body in the
//   backward; forward D=128 general 4623 -> 2420 unmasked / 3922 masked.
//   Fused backward (BackwardFused, 64-query tiles x 128 keys, 8 warps; not the default until
//   timed): per query tile per warp 16 keys x 64 queries, 5 GEMMs (320 HMMA at D=128): D=128
//   unmasked 1100 instructions (204 integer, 184 LDSM), masked 1249, 255 registers, 52 B of
//   spills outside the loop; D=64 692 / 838, 32 B. Per score element that is 1.07 at D=128
//   and 0.68 at D=64, against the two kernels' 0.87 + 0.68 = 1.55 and 0.59 + 0.45 = 1.03
//   (FA2's backward, per the issue: 0.85). What it adds: one fp32 dQ partial per (key block,
//   query tile) written to L2 (st / red.global.add.v2.f32), 32 KB per tile pair at D=128 as
//   FlashAttention-2's atomicAdd path, and a summing pass over the splits' accumulators.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "attention/attention.h"
#include "attention/attention_bwd_fused_kernel.cuh"
#include "attention/attention_bwd_kernel.cuh"
#include "attention/attention_fwd_kernel.cuh"
#include "attention/kernel_traits.h"
#include "common/cuda_check.h"
#include "common/static_switch.h"

namespace fusedattn {
namespace attn {

// kGeneral: the variant that reads user masks and applies dropout (more registers live).
// BackwardFused: the one-pass backward (fast variant only), instantiated where kFusedBackward
// says: head dims 64 and 128, the ones models use most (each instantiation is build time).
template <int kHeadDim, bool kGeneral>
struct Policy {
  using Forward = ForwardTraits<kHeadDim, 128, kGeneral ? 32 : 64, 4>;
  using BackwardKV = BackwardKVTraits<kHeadDim, 64, 4, false>;
  using BackwardQ = BackwardQTraits<kHeadDim, 64, 4>;
  static constexpr bool kFusedBackward = !kGeneral && (kHeadDim == 64 || kHeadDim == 128);
  using BackwardFused = BackwardFusedTraits<kHeadDim, 64, 8>;
};
template <bool kGeneral>
struct Policy<256, kGeneral> {
  using Forward = ForwardTraits<256, 128, kGeneral ? 32 : 64, 8>;
  using BackwardKV = BackwardKVTraits<256, 32, 4, true>;
  using BackwardQ = BackwardQTraits<256, 32, 4>;
  static constexpr bool kFusedBackward = false;  // dK + dV alone fill the registers
  using BackwardFused = void;
};

// Whether BackwardKernel::kAuto runs the fused backward where it applies. Timed against the
// two kernels on the H100 (benchmarks/results/h100/tune_cuda_backward.csv: bf16, T=1024 and
// 4096, head dims 64 and 128): without causal masking fused won 7 of 8 cases (head dim 64 by
// 6-25 %, 128 by up to 7 % with key padding; 1 % slower at 128 T=4096 unpadded), and at head
// dim 64 causal with key padding by 10 %. Causal otherwise the two kernels won (128: 4-9 %,
// 64: 1-2 %): the fused kernel's query tiles above the diagonal start each key block's pass.
inline bool fused_backward_by_default(const AttentionParams& p) {
  return !p.is_causal || (p.key_padding != nullptr && p.head_dim <= 64);
}
// At most this many fp32 dQ accumulators (each B * H * Tq * head_dim * 4 bytes); a call that
// would need more to fill the GPU runs the two-kernel backward.
constexpr int kMaxDqSplits = 4;
// ... and at most this many bytes of them together: 4 splits of B=4 H=16 T=4096 D=128 take
// 512 MiB, but at T=128K one split of one 32-head sequence takes 2 GiB, memory the two-kernel
// backward does not need. A call past the cap runs fewer splits, or the two kernels.
constexpr int64_t kMaxDqAccumBytes = int64_t{1} << 30;

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#ifdef FUSEDATTN_TUNING
// Tuning builds only (FUSEDATTN_TUNING=1 at build time; scripts/tune_attention.py): extra tile
// variants of the bf16 D=128 kernels and the D=64 forward, picked per call by an environment
// variable (0 = policy). sm_90a screen of the D=64 forward variants (unmasked loop, per warp):
// policy 128x64/4 warps 623 instructions per 32x64 scores, no spills; variant 6, 128x128/8
// warps, 597 per 16x128, no spills, one block per SM; variant 5, 128x128/4 warps, 1115 per
// 32x128, 12 B spills.
inline int tuning_variant(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::atoi(value) : 0;
}
#endif

// Blocks ride grid axis x (2^31 - 1): B*H*blocks, so neither B*H nor Tq is capped at 65535.
inline unsigned grid_size(int64_t blocks, const char* kernel) {
  if (blocks > 0x7fffffff) {
    throw std::invalid_argument(std::string("attention: ") + kernel + " needs " +
                                std::to_string(blocks) + " blocks, more than a grid holds");
  }
  return static_cast<unsigned>(blocks);
}

// Kernels past 48 KB of dynamic shared memory must opt in; a device with less than the
// kernel needs gets a clear error rather than a failed launch.
template <typename Kernel>
void set_smem(Kernel kernel, int bytes) {
  int device = 0, optin = 0;
  FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
  FUSEDATTN_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (bytes > optin) {
    throw std::invalid_argument("attention: this head dim needs " + std::to_string(bytes) +
                                " bytes of shared memory per block; the device allows " +
                                std::to_string(optin));
  }
  FUSEDATTN_CUDA_CHECK(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

}  // namespace attn

template <typename T, typename Traits, bool kGeneral>
void launch_forward(const AttentionParams& p, cudaStream_t stream) {
  const int num_m_blocks = static_cast<int>(attn::ceil_div(p.seqlen_q, Traits::kBlockM));
  const unsigned grid =
      attn::grid_size(static_cast<int64_t>(p.batch) * p.heads * num_m_blocks, "the forward kernel");
  const int smem = Traits::kSmemElems * static_cast<int>(sizeof(T));
  auto kernel = attn::attention_fwd_kernel<T, Traits, kGeneral>;
  attn::set_smem(kernel, smem);
  kernel<<<grid, Traits::kNThreads, smem, stream>>>(p, num_m_blocks);
  FUSEDATTN_LAUNCH_CHECK();
}

template <typename T, int kHeadDim, bool kGeneral>
void launch_forward(const AttentionParams& p, cudaStream_t stream) {
#ifdef FUSEDATTN_TUNING
  if constexpr (kHeadDim == 128 && !kGeneral && std::is_same_v<T, __nv_bfloat16>) {
    switch (attn::tuning_variant("FUSEDATTN_TUNE_FWD")) {
      case 1:
        return launch_forward<T, attn::ForwardTraits<128, 128, 32, 4>, false>(p, stream);
      case 2:
        return launch_forward<T, attn::ForwardTraits<128, 64, 64, 4>, false>(p, stream);
      case 3:
        return launch_forward<T, attn::ForwardTraits<128, 128, 64, 8>, false>(p, stream);
      case 4:
        return launch_forward<T, attn::ForwardTraits<128, 64, 64, 4, 3>, false>(p, stream);
      default:
        break;
    }
  }
  if constexpr (kHeadDim == 64 && !kGeneral && std::is_same_v<T, __nv_bfloat16>) {
    switch (attn::tuning_variant("FUSEDATTN_TUNE_FWD")) {
      case 5:
        return launch_forward<T, attn::ForwardTraits<64, 128, 128, 4>, false>(p, stream);
      case 6:
        return launch_forward<T, attn::ForwardTraits<64, 128, 128, 8>, false>(p, stream);
      default:
        break;
    }
  }
#endif
  launch_forward<T, typename attn::Policy<kHeadDim, kGeneral>::Forward, kGeneral>(p, stream);
}

template <typename T, int kHeadDim>
void run_attention_forward(const AttentionParams& p, cudaStream_t stream) {
  if (p.seqlen_q == 0) return;
  BOOL_SWITCH(attn::needs_general_variant(p), kGeneral,
              [&] { launch_forward<T, kHeadDim, kGeneral>(p, stream); });
}

template <typename T, typename Traits, int kPass, bool kGeneral>
void launch_dkdv(const AttentionParams& p, cudaStream_t stream) {
  const int num_n_blocks = static_cast<int>(attn::ceil_div(p.seqlen_k, Traits::kBlockN));
  const unsigned grid = attn::grid_size(static_cast<int64_t>(p.batch) * p.kv_heads * num_n_blocks,
                                        "the dK/dV kernel");
  auto kernel = attn::attention_bwd_dkdv_kernel<T, Traits, kPass, kGeneral>;
  attn::set_smem(kernel, Traits::kSmemBytes);
  kernel<<<grid, Traits::kNThreads, Traits::kSmemBytes, stream>>>(p, num_n_blocks);
  FUSEDATTN_LAUNCH_CHECK();
}

template <typename T, typename Q, bool kGeneral>
void launch_dq(const AttentionParams& p, cudaStream_t stream) {
  const int num_m_blocks = static_cast<int>(attn::ceil_div(p.seqlen_q, Q::kBlockM));
  const unsigned grid =
      attn::grid_size(static_cast<int64_t>(p.batch) * p.heads * num_m_blocks, "the dQ kernel");
  const int smem = Q::kSmemElems * static_cast<int>(sizeof(T));
  auto kernel = attn::attention_bwd_dq_kernel<T, Q, kGeneral>;
  attn::set_smem(kernel, smem);
  kernel<<<grid, Q::kNThreads, smem, stream>>>(p, num_m_blocks);
  FUSEDATTN_LAUNCH_CHECK();
}

template <typename T, typename KV, bool kGeneral>
void launch_dkdv_passes(const AttentionParams& p, cudaStream_t stream) {
  if constexpr (KV::kSplitPasses) {
    launch_dkdv<T, KV, 1, kGeneral>(p, stream);
    launch_dkdv<T, KV, 2, kGeneral>(p, stream);
  } else {
    launch_dkdv<T, KV, 0, kGeneral>(p, stream);
  }
}

template <typename T, int kHeadDim, bool kGeneral>
void launch_dq_policy(const AttentionParams& p, cudaStream_t stream) {
#ifdef FUSEDATTN_TUNING
  if constexpr (kHeadDim == 128 && !kGeneral && std::is_same_v<T, __nv_bfloat16>) {
    switch (attn::tuning_variant("FUSEDATTN_TUNE_DQ")) {
      case 1:
        return launch_dq<T, attn::BackwardQTraits<128, 32, 4>, false>(p, stream);
      case 2:
        return launch_dq<T, attn::BackwardQTraits<128, 64, 8>, false>(p, stream);
      case 3:
        return launch_dq<T, attn::BackwardQTraits<128, 32, 4, 3>, false>(p, stream);
      default:
        break;
    }
  }
#endif
  launch_dq<T, typename attn::Policy<kHeadDim, kGeneral>::BackwardQ, kGeneral>(p, stream);
}

template <typename T, int kHeadDim, bool kGeneral>
void launch_dkdv_policy(const AttentionParams& p, cudaStream_t stream) {
#ifdef FUSEDATTN_TUNING
  if constexpr (kHeadDim == 128 && !kGeneral && std::is_same_v<T, __nv_bfloat16>) {
    switch (attn::tuning_variant("FUSEDATTN_TUNE_DKDV")) {
      case 1:
        return launch_dkdv_passes<T, attn::BackwardKVTraits<128, 32, 4, false>, false>(p, stream);
      case 2:
        return launch_dkdv_passes<T, attn::BackwardKVTraits<128, 64, 8, false>, false>(p, stream);
      default:
        break;
    }
  }
#endif
  launch_dkdv_passes<T, typename attn::Policy<kHeadDim, kGeneral>::BackwardKV, kGeneral>(p, stream);
}

template <typename T, int kHeadDim>
int fused_backward_dq_splits(const AttentionParams& p) {
  using Pol = attn::Policy<kHeadDim, false>;
  if constexpr (!Pol::kFusedBackward) {
    return 0;
  } else {
    using F = typename Pol::BackwardFused;
    const auto kind = static_cast<BackwardKernel>(p.backward_kernel);
    const bool wanted = kind == BackwardKernel::kFused ||
                        (kind == BackwardKernel::kAuto && attn::fused_backward_by_default(p));
    if (!wanted || attn::needs_general_variant(p) || p.dscores != nullptr) return 0;
    if (p.seqlen_q == 0 || p.seqlen_k == 0) return 0;
    // Resident blocks of this kernel on the whole device (0: its shared memory does not fit,
    // as on sm_86/89's 99 KB at head dim 128), once per device: the binding and the launch
    // both ask, on every backward. (Two threads may both fill an entry, with the same value.)
    constexpr int kMaxDevices = 64;
    static std::atomic<int> wave_of[kMaxDevices];  // resident blocks + 1; 0 = not asked yet
    int device = 0;
    FUSEDATTN_CUDA_CHECK(cudaGetDevice(&device));
    int wave = device < kMaxDevices ? wave_of[device].load(std::memory_order_relaxed) - 1 : -1;
    if (wave < 0) {
      int optin = 0, sms = 0, resident = 0;
      FUSEDATTN_CUDA_CHECK(
          cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
      if (F::kSmemBytes <= optin) {
        FUSEDATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
        auto kernel = attn::attention_bwd_fused_kernel<T, F>;
        attn::set_smem(kernel, F::kSmemBytes);
        FUSEDATTN_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &resident, kernel, F::kNThreads, F::kSmemBytes));
      }
      wave = sms * resident;
      if (device < kMaxDevices) wave_of[device].store(wave + 1, std::memory_order_relaxed);
    }
    const int num_n_blocks = static_cast<int>(attn::ceil_div(p.seqlen_k, F::kBlockN));
    const int64_t accum_bytes =  // one split's accumulator, as the binding allocates it
        static_cast<int64_t>(p.batch) * p.heads * p.seqlen_q * p.head_dim * sizeof(float);
    const int max_splits =
        attn::splits_within_memory(accum_bytes, attn::kMaxDqAccumBytes, attn::kMaxDqSplits);
    if (max_splits == 0) return 0;
    return attn::fused_backward_splits(static_cast<int64_t>(p.batch) * p.kv_heads, num_n_blocks,
                                       wave, max_splits);
  }
}

template <typename T, int kHeadDim>
void launch_fused_backward(const AttentionParams& p, cudaStream_t stream) {
  using Pol = attn::Policy<kHeadDim, false>;
  if constexpr (Pol::kFusedBackward) {
    using F = typename Pol::BackwardFused;
    const int num_n_blocks = static_cast<int>(attn::ceil_div(p.seqlen_k, F::kBlockN));
    auto kernel = attn::attention_bwd_fused_kernel<T, F>;
    attn::set_smem(kernel, F::kSmemBytes);
    kernel<<<attn::grid_size(static_cast<int64_t>(p.batch) * p.kv_heads * p.dq_splits,
                             "the fused backward kernel"),
             F::kNThreads, F::kSmemBytes, stream>>>(p, num_n_blocks);
    FUSEDATTN_LAUNCH_CHECK();
    const int64_t chunks = static_cast<int64_t>(p.batch) * p.heads * p.seqlen_q * (p.head_dim / 8);
    attn::attention_bwd_dq_sum_kernel<T, F::kBlockM, F::kBlockN>
        <<<attn::grid_size(attn::ceil_div(chunks, attn::kDqSumThreads), "the dQ sum kernel"),
           attn::kDqSumThreads, 0, stream>>>(p);
    FUSEDATTN_LAUNCH_CHECK();
  } else {
    throw std::logic_error("attention: no fused backward at this head dim");
  }
}

template <typename T, int kHeadDim>
void run_attention_backward(const AttentionParams& p, cudaStream_t stream) {
  if (p.seqlen_q == 0 || p.seqlen_k == 0) return;  // the caller returns zero gradients
  // delta, then dQ, then dK/dV: the dQ kernel may rewrite delta (exact_delta) before dK/dV
  // reads it (one stream: in order). Or delta, then the fused kernel and the dQ sum.
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.seqlen_q;
  attn::attention_bwd_delta_kernel<T>
      <<<attn::grid_size(attn::ceil_div(rows, attn::kDeltaRowsPerBlock), "the delta kernel"),
         attn::kDeltaRowsPerBlock * attn::kWarpSize, 0, stream>>>(p);
  FUSEDATTN_LAUNCH_CHECK();
  if (p.dq_splits > 0) {
    launch_fused_backward<T, kHeadDim>(p, stream);
    return;
  }
  BOOL_SWITCH(attn::needs_general_variant(p), kGeneral,
              [&] { launch_dq_policy<T, kHeadDim, kGeneral>(p, stream); });
  BOOL_SWITCH(attn::needs_general_variant(p), kGeneral,
              [&] { launch_dkdv_policy<T, kHeadDim, kGeneral>(p, stream); });
}

}  // namespace fusedattn
