// Flash attention backward, deterministic (no atomics): delta = rowsum(dO * O), then dQ by
// query block and dK/dV by key block, each recomputing P = exp(S - lse) from the saved lse.
// A kv head's dK/dV sums its GQA group's q heads in a fixed order inside one block.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/attention.h"
#include "attention/masking.cuh"
#include "attention/warp_mma.cuh"
#include "common/dtype.cuh"

namespace fusedattn {
namespace attn {

constexpr int kDeltaRowsPerBlock = 8;  // one warp per row

// delta[bh, q] = sum_d dO * O in fp32; one warp per row, 8 elements (16 bytes) per lane.
template <typename T>
__global__ void __launch_bounds__(kDeltaRowsPerBlock* kWarpSize)
    attention_bwd_delta_kernel(const AttentionParams p) {
  const int lane = threadIdx.x % kWarpSize;
  const int64_t row =
      static_cast<int64_t>(blockIdx.x) * kDeltaRowsPerBlock + threadIdx.x / kWarpSize;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.seqlen_q;
  if (row >= rows) return;
  const int64_t bh = row / p.seqlen_q, q = row % p.seqlen_q;
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const T* o = static_cast<const T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1] +
               q * p.out_stride[2];
  const T* d = static_cast<const T*>(p.dout) + b * p.dout_stride[0] + h * p.dout_stride[1] +
               q * p.dout_stride[2];
  float acc = 0.f;
  for (int col = lane * 8; col < p.head_dim_v; col += kWarpSize * 8) {
    const uint4 ov = *reinterpret_cast<const uint4*>(o + col);
    const uint4 dv = *reinterpret_cast<const uint4*>(d + col);
    const T* oe = reinterpret_cast<const T*>(&ov);
    const T* de = reinterpret_cast<const T*>(&dv);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc += to_float(oe[i]) * to_float(de[i]);
  }
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  }
  if (lane == 0) p.delta[row] = acc;
}

// lse in the log2 domain, +inf for a row that saw no key (its probabilities become 0).
__device__ __forceinline__ float lse_log2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

template <typename T, typename Traits, bool kGeneral>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocks)
    attention_bwd_dq_kernel(const AttentionParams p, const int num_m_blocks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kPitch = Traits::kPitch, kNTiles = kBlockN / 8, kDTiles = kD / 8;
  constexpr int kThreads = Traits::kNThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  constexpr uint32_t kTileBytes = kBlockN * kPitch * sizeof(T);
  const uint32_t sQ_addr = smem_addr(sQ);
  const uint32_t sdO_addr = sQ_addr + kBlockM * kPitch * sizeof(T);
  const uint32_t sK0_addr = sdO_addr + kBlockM * kPitch * sizeof(T);  // [2][kBlockN][kPitch]
  const uint32_t sV0_addr = sK0_addr + 2 * kTileBytes;

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int g = lane >> 2, t = lane & 3;
  const int64_t bh = blockIdx.x / num_m_blocks;
  int m_block = blockIdx.x % num_m_blocks;
  if (p.is_causal) m_block = num_m_blocks - 1 - m_block;  // longest rows first
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const int64_t hk = h / (p.heads / p.kv_heads);
  const int m0 = m_block * kBlockM;
  const int Tq = p.seqlen_q, Tk = p.seqlen_k;

  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
  const T* dout = static_cast<const T*>(p.dout) + b * p.dout_stride[0] + h * p.dout_stride[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];

  const int n_end = p.is_causal ? min(Tk, m0 + kBlockM) : Tk;
  const int n_blocks = (n_end + kBlockN - 1) / kBlockN;
  const bool any_mask = p.key_padding != nullptr || (kGeneral && p.mask != nullptr);
  const bool dropout = kGeneral && p.dropout_p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*p.seed) : 0;
  const float inv_keep = dropout ? 1.f / (1.f - p.dropout_p) : 1.f;
  const float scale_log2 = p.scale * kLog2e;

  // Built per copy, not kept across the loop: at head dim 256 the kept state spilled.
  auto k_copy = [&] { return TileCopy<kBlockN, kD, kThreads, T>(k, p.k_stride[2], p.head_dim); };
  auto v_copy = [&] { return TileCopy<kBlockN, kD, kThreads, T>(v, p.v_stride[2], p.head_dim_v); };
  TileCopy<kBlockM, kD, kThreads, T>(q, p.q_stride[2], p.head_dim).load(sQ_addr, m0, Tq);
  TileCopy<kBlockM, kD, kThreads, T>(dout, p.dout_stride[2], p.head_dim_v).load(sdO_addr, m0, Tq);
  if (n_blocks > 0) {  // padded keys' K and V rows: zeros (TileCopy::load)
    k_copy().load_in_loop(sK0_addr, 0, Tk, key_padding_row(p, b));
    v_copy().load_in_loop(sV0_addr, 0, Tk, key_padding_row(p, b));
  }
  cp_async_commit();
  const uint32_t q_frag =
      sQ_addr + warp * 16 * kPitch * sizeof(T) + ldmatrix_lane_offset<T, kPitch, true>(lane);
  const uint32_t do_frag =
      sdO_addr + warp * 16 * kPitch * sizeof(T) + ldmatrix_lane_offset<T, kPitch, true>(lane);
  const uint32_t kv_nt_offset = ldmatrix_lane_offset<T, kPitch, false>(lane);
  const uint32_t k_trans_offset = ldmatrix_lane_offset<T, kPitch, true>(lane);

  float lse2[2], delta[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = m0 + warp * 16 + g + 8 * half;
    lse2[half] = row < Tq ? lse_log2(p.lse[bh * Tq + row]) : INFINITY;
    delta[half] = row < Tq ? p.delta[bh * Tq + row] : 0.f;
  }

  // With a float-mask gradient (dscores), delta is first summed exactly as rowsum(P * dP) over
  // every key tile (a first pass) instead of rowsum(dO * O) with O rounded to its dtype: the
  // mask's gradient is dS itself summed over its broadcast dims, and the rounded O cost it up to
  // 6x the bf16 baseline's error (seen on the H200). The pass also rewrites delta for the dK/dV
  // kernel that runs next. It doubles S and dP, for these calls only.
  const bool exact_delta = kGeneral && p.dscores != nullptr;
  const int steps = (exact_delta ? 2 : 1) * n_blocks;
  // Key tiles [0, n_unmasked) of each pass need no mask (tiling.h); the exact-delta pass
  // masks them all.
  const int n_unmasked =
      min(n_blocks, unmasked_key_tiles(m0, Tk, p.is_causal, any_mask || exact_delta, kBlockN));
  float delta_acc[2] = {0.f, 0.f};
  float acc_dq[1][kDTiles][4];
  zero(acc_dq);

  // One key tile; kMasked: compiled with the masks (the unmasked loop runs none of it and
  // folds the scale into exp2's FFMA).
  auto key_step = [&](const int step, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const int nb = step % n_blocks;
    const bool delta_pass = kMasked && exact_delta && step < n_blocks;
    const int n0 = nb * kBlockN;
    const uint32_t sK = sK0_addr + (step & 1) * kTileBytes;
    const uint32_t sV = sV0_addr + (step & 1) * kTileBytes;
    if (step + 1 < steps) {  // prefetch the next tile into the other buffer
      const int next_n0 = ((step + 1) % n_blocks) * kBlockN;
      const uint32_t next = ((step + 1) & 1) * kTileBytes;
      // Key padding makes every tile masked: the unmasked steps compile no padding check.
      const uint8_t* skip = kMasked ? key_padding_row(p, b) : nullptr;
      k_copy().load_in_loop(sK0_addr + next, next_n0, Tk, skip);
      v_copy().load_in_loop(sV0_addr + next, next_n0, Tk, skip);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();

    float acc_s[1][kNTiles][4], acc_dp[1][kNTiles][4];
    zero(acc_s);
    zero(acc_dp);
    gemm_smem_nt<T, 1, kNTiles, kD, kPitch>(acc_s, q_frag, sK + kv_nt_offset);
    gemm_smem_nt<T, 1, kNTiles, kD, kPitch>(acc_dp, do_frag, sV + kv_nt_offset);

    // Rows past seqlen_q need no mask: lse2 = +inf makes their probabilities 0.
    const HiddenKeys<kNTiles> hidden =
        kMasked ? HiddenKeys<kNTiles>(p, b, n0, lane) : HiddenKeys<kNTiles>();
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = m0 + warp * 16 + g + 8 * (i >> 1);
        const int col = n0 + nt * 8 + 2 * t + (i & 1);
        float pr;
        if (kMasked) {
          const float s2 = masked_score<kGeneral>(p, b, h, row, col, hidden(nt, i & 1),
                                                  acc_s[0][nt][i] * scale_log2);
          pr = ex2(s2 - lse2[i >> 1]);
        } else {
          pr = ex2(fmaf(acc_s[0][nt][i], scale_log2, -lse2[i >> 1]));
        }
        float dp = acc_dp[0][nt][i];
        if (dropout) dp *= dropout_factor(seed, bh, row, col, Tq, Tk, p.dropout_p, inv_keep);
        if (delta_pass) {
          delta_acc[i >> 1] += pr * dp;
          continue;
        }
        const float ds = pr * (dp - delta[i >> 1]);
        acc_s[0][nt][i] = ds;
        if (kGeneral && p.dscores != nullptr && row < Tq && col < Tk) {
          p.dscores[(bh * Tq + row) * static_cast<int64_t>(Tk) + col] = ds;
        }
      }
    }
    if (delta_pass) {
      if (step == n_blocks - 1) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          delta[half] = quad_sum(delta_acc[half]);
          const int row = m0 + warp * 16 + g + 8 * half;
          if (t == 0 && row < Tq) p.delta[bh * Tq + row] = delta[half];
        }
      }
      __syncthreads();  // every warp is done with this buffer before it is refilled
      return;
    }
    uint32_t a_ds[1][kNTiles / 2][4];
    to_a_fragments<T, 1, kNTiles>(a_ds, acc_s);
    gemm_regs_smem<T, 1, kNTiles / 2, kDTiles, kPitch>(acc_dq, a_ds, sK + k_trans_offset);
    __syncthreads();  // every warp is done with this buffer before it is refilled
  };

  for (int pass = 0; pass < steps; pass += n_blocks) {
    int nb = 0;
    for (; nb < n_unmasked; ++nb) key_step(pass + nb, Flag<false>());
    for (; nb < n_blocks; ++nb) key_step(pass + nb, Flag<true>());
  }

  cp_async_wait<0>();
  __syncthreads();  // every thread's copies landed before this warp stages dQ in its Q rows
  T* dq = static_cast<T*>(p.dq) + b * p.dq_stride[0] + h * p.dq_stride[1];
  store_warp_rows<T, 1, kDTiles, kPitch>(acc_dq, p.scale, sQ + warp * 16 * kPitch, dq,
                                         p.dq_stride[2], m0 + warp * 16, Tq, p.head_dim, lane);
#else
  __trap();
#endif
}

// The query tiles of the kernels that sweep them per key block (dK/dV here, and the fused
// backward): Q and dO of tile (q head `head` of kv head hk's GQA group, query block
// m_begin + mi) by cp.async into buffer `buf` of the two at sQ0 / sdO0; its lse and delta (one
// row per thread) into registers, for the kernel to store to shared memory (store_query_stats)
// after the current tile's compute, so the loads' latency hides behind it. (The arguments are
// the kernels' own values: computing the head and row at the call site instead cost the dK/dV
// loop 6 SASS instructions per iteration.)
struct QueryStats {
  float lse2, delta;
};

template <typename T, int kBlockM, int kD, int kThreads>
__device__ __forceinline__ QueryStats prefetch_query_tile(const AttentionParams& p, int64_t b,
                                                          int64_t hk, int group, int m_begin,
                                                          int Tq, int head, int mi, int buf,
                                                          uint32_t sQ0, uint32_t sdO0) {
  static_assert(kBlockM <= kThreads, "one lse/delta row per thread");
  constexpr uint32_t kTileBytes = kBlockM * (kD + 8) * sizeof(T);
  const int64_t h = hk * group + head;
  const int m0 = (m_begin + mi) * kBlockM;
  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
  const T* dout = static_cast<const T*>(p.dout) + b * p.dout_stride[0] + h * p.dout_stride[1];
  TileCopy<kBlockM, kD, kThreads, T>(q, p.q_stride[2], p.head_dim)
      .load(sQ0 + buf * kTileBytes, m0, Tq);
  TileCopy<kBlockM, kD, kThreads, T>(dout, p.dout_stride[2], p.head_dim_v)
      .load(sdO0 + buf * kTileBytes, m0, Tq);
  cp_async_commit();
  const int row = m0 + static_cast<int>(threadIdx.x);
  const int64_t stats = (b * p.heads + h) * Tq + row;
  const bool real = threadIdx.x < kBlockM && row < Tq;
  return {real ? lse_log2(p.lse[stats]) : INFINITY, real ? p.delta[stats] : 0.f};
}

// A query tile's lse and delta (prefetch_query_tile) into buffer `buf` of the kernel's shared
// [2][kBlockM] arrays.
template <int kBlockM>
__device__ __forceinline__ void store_query_stats(const QueryStats& st, int buf, float* sLse0,
                                                  float* sDelta0) {
  if (threadIdx.x < kBlockM) {
    sLse0[buf * kBlockM + threadIdx.x] = st.lse2;
    sDelta0[buf * kBlockM + threadIdx.x] = st.delta;
  }
}

// From transposed scores S^T (acc_st) and dP^T (acc_dpt, kDoDK) of a warp's 16 keys (rows g
// and g + 8 from key_row0; lane = 4 g + t) by a tile's kQTiles * 8 queries from m0: P^T times the
// dropout factor (what the forward multiplied V by) into acc_st and dS^T = P^T (dP^T keep - delta)
// into acc_dpt. kMasked: the masks applied (kGeneral: attn_mask too); otherwise the scale folds
// into exp2's FFMA. Rows past seqlen_q need no mask: their lse2 = +inf makes P 0.
template <bool kMasked, bool kGeneral, bool kDoDK, int kQTiles>
__device__ __forceinline__ void transposed_probabilities(
    float (&acc_st)[1][kQTiles][4], float (&acc_dpt)[1][kQTiles][4], const AttentionParams& p,
    int64_t b, int64_t h, int m0, int key_row0, int g, int t, const bool (&key_hidden_row)[2],
    const float* sLse, const float* sDelta, float scale_log2, bool dropout, uint64_t seed,
    float inv_keep) {
#pragma unroll
  for (int nt = 0; nt < kQTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = key_row0 + g + 8 * (i >> 1);
      const int qi = nt * 8 + 2 * t + (i & 1);
      float pr;
      if (kMasked) {
        const float s2 = masked_score<kGeneral>(p, b, h, m0 + qi, key, key_hidden_row[i >> 1],
                                                acc_st[0][nt][i] * scale_log2);
        pr = ex2(s2 - sLse[qi]);
      } else {
        pr = ex2(fmaf(acc_st[0][nt][i], scale_log2, -sLse[qi]));
      }
      const float keep = dropout ? dropout_factor(seed, b * p.heads + h, m0 + qi, key, p.seqlen_q,
                                                  p.seqlen_k, p.dropout_p, inv_keep)
                                 : 1.f;
      acc_st[0][nt][i] = pr * keep;
      if (kDoDK) acc_dpt[0][nt][i] = pr * (acc_dpt[0][nt][i] * keep - sDelta[qi]);
    }
  }
}

// kPass: 0 computes dK and dV, 1 only dV, 2 only dK (see BackwardKVTraits::kSplitPasses).
template <typename T, typename Traits, int kPass, bool kGeneral>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    attention_bwd_dkdv_kernel(const AttentionParams p, const int num_n_blocks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kPitch = Traits::kPitch, kQTiles = kBlockM / 8, kDTiles = kD / 8;
  constexpr int kThreads = Traits::kNThreads;
  constexpr bool kDoDV = kPass != 2, kDoDK = kPass != 1;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * kPitch;
  T* sQ0 = sV + kBlockN * kPitch;        // [2][kBlockM][kPitch]
  T* sdO0 = sQ0 + 2 * kBlockM * kPitch;  // [2][kBlockM][kPitch]
  constexpr uint32_t kTileBytes = kBlockM * kPitch * sizeof(T);
  const uint32_t sK_addr = smem_addr(sK), sV_addr = smem_addr(sV);
  const uint32_t sQ0_addr = smem_addr(sQ0), sdO0_addr = smem_addr(sdO0);
  float* sLse0 = reinterpret_cast<float*>(sdO0 + 2 * kBlockM * kPitch);  // [2][kBlockM]
  float* sDelta0 = sLse0 + 2 * kBlockM;                                  // [2][kBlockM]

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int g = lane >> 2, t = lane & 3;
  const int64_t bhk = blockIdx.x / num_n_blocks;
  const int n0 = (blockIdx.x % num_n_blocks) * kBlockN;
  const int64_t b = bhk / p.kv_heads, hk = bhk % p.kv_heads;
  const int group = p.heads / p.kv_heads;
  const int Tq = p.seqlen_q, Tk = p.seqlen_k;

  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
  // Padded keys' K and V rows: zeros (TileCopy::load), so their dK and dV rows are zeros.
  const uint8_t* key_pad = key_padding_row(p, b);
  TileCopy<kBlockN, kD, kThreads, T>(k, p.k_stride[2], p.head_dim).load(sK_addr, n0, Tk, key_pad);
  TileCopy<kBlockN, kD, kThreads, T>(v, p.v_stride[2], p.head_dim_v).load(sV_addr, n0, Tk, key_pad);
  cp_async_commit();

  // Causal: query blocks wholly above this key block's first key see none of it.
  const int m_begin = first_query_tile(n0, p.is_causal, kBlockM);
  const int num_m = (Tq + kBlockM - 1) / kBlockM;
  const int tiles_per_head = max(0, num_m - m_begin);
  const int tiles = group * tiles_per_head;
  // Key padding is read once per block (this thread's two keys), not per tile.
  const bool any_mask = p.key_padding != nullptr || (kGeneral && p.mask != nullptr);
  const bool dropout = kGeneral && p.dropout_p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*p.seed) : 0;
  const float inv_keep = dropout ? 1.f / (1.f - p.dropout_p) : 1.f;
  const float scale_log2 = p.scale * kLog2e;

  auto prefetch = [&](int head, int mi, int buf) {
    return prefetch_query_tile<T, kBlockM, kD, kThreads>(p, b, hk, group, m_begin, Tq, head, mi,
                                                         buf, sQ0_addr, sdO0_addr);
  };
  if (tiles > 0) store_query_stats<kBlockM>(prefetch(0, 0, 0), 0, sLse0, sDelta0);

  float acc_dk[1][kDTiles][4], acc_dv[1][kDTiles][4];
  zero(acc_dk);
  zero(acc_dv);
  const int key_row0 = n0 + warp * 16;
  const uint32_t k_frag =
      sK_addr + warp * 16 * kPitch * sizeof(T) + ldmatrix_lane_offset<T, kPitch, true>(lane);
  const uint32_t v_frag =
      sV_addr + warp * 16 * kPitch * sizeof(T) + ldmatrix_lane_offset<T, kPitch, true>(lane);
  const uint32_t qdo_nt_offset = ldmatrix_lane_offset<T, kPitch, false>(lane);
  const uint32_t qdo_trans_offset = ldmatrix_lane_offset<T, kPitch, true>(lane);
  // This thread's two keys (rows g and g + 8 of the warp's 16) are the same for every tile.
  const bool key_hidden_row[2] = {key_hidden(p, b, key_row0 + g),
                                  key_hidden(p, b, key_row0 + g + 8)};
  // One query tile; kMasked: compiled with the masks (the unmasked loop runs none of it and
  // folds the scale into exp2's FFMA).
  auto query_tile = [&](const int tile, const int head, const int mi, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const int buf = tile & 1;
    QueryStats next{};
    if (tile + 1 < tiles) {
      const bool same_head = mi + 1 < tiles_per_head;
      next = prefetch(same_head ? head : head + 1, same_head ? mi + 1 : 0, buf ^ 1);
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();  // this tile's Q, dO, lse, delta (and K, V) are visible to all warps
    const int64_t h = hk * group + head;
    const int m0 = (m_begin + mi) * kBlockM;
    const uint32_t sQ = sQ0_addr + buf * kTileBytes;
    const uint32_t sdO = sdO0_addr + buf * kTileBytes;
    const float* sLse = sLse0 + buf * kBlockM;
    const float* sDelta = sDelta0 + buf * kBlockM;

    // Transposed scores: rows are this warp's 16 keys, columns the tile's queries.
    float acc_st[1][kQTiles][4], acc_dpt[1][kQTiles][4];
    zero(acc_st);
    gemm_smem_nt<T, 1, kQTiles, kD, kPitch>(acc_st, k_frag, sQ + qdo_nt_offset);
    if (kDoDK) {
      zero(acc_dpt);
      gemm_smem_nt<T, 1, kQTiles, kD, kPitch>(acc_dpt, v_frag, sdO + qdo_nt_offset);
    }
    transposed_probabilities<kMasked, kGeneral, kDoDK>(acc_st, acc_dpt, p, b, h, m0, key_row0, g, t,
                                                       key_hidden_row, sLse, sDelta, scale_log2,
                                                       dropout, seed, inv_keep);
    uint32_t a[1][kQTiles / 2][4];
    if (kDoDV) {
      to_a_fragments<T, 1, kQTiles>(a, acc_st);
      gemm_regs_smem<T, 1, kQTiles / 2, kDTiles, kPitch>(acc_dv, a, sdO + qdo_trans_offset);
    }
    if (kDoDK) {
      to_a_fragments<T, 1, kQTiles>(a, acc_dpt);
      gemm_regs_smem<T, 1, kQTiles / 2, kDTiles, kPitch>(acc_dk, a, sQ + qdo_trans_offset);
    }
    if (tile + 1 < tiles)
      store_query_stats<kBlockM>(next, buf ^ 1, sLse0, sDelta0);  // read after the next barrier
    __syncthreads();  // every warp is done with this buffer before it is refilled
  };

  // Per q head of the group: its first query tiles need masks (causal diagonal; all of them
  // with key padding, attn_mask or a key block crossing seqlen_k), the rest none (tiling.h).
  // Rows past seqlen_q need no mask: their lse2 = +inf makes their probabilities 0.
  const int masked_per_head =
      masked_query_tiles(n0, Tk, num_m, m_begin, p.is_causal, any_mask, kBlockM, kBlockN);
  // The general variant runs every tile through the masked body: its per-element mask and
  // Philox code dwarf what the unmasked body saves, and the two bodies together spilled
  // (66 B at head dim 128).
  for (int head = 0, tile = 0; head < group && tiles_per_head > 0; ++head) {
    int mi = 0;
    const int masked_end = kGeneral ? tiles_per_head : masked_per_head;
    for (; mi < masked_end; ++mi, ++tile) query_tile(tile, head, mi, Flag<true>());
    if constexpr (!kGeneral) {
      for (; mi < tiles_per_head; ++mi, ++tile) query_tile(tile, head, mi, Flag<false>());
    }
  }

  // Stage through this warp's own K and V rows (no other warp reads them). A block whose keys
  // no query sees (causal, seqlen_q < seqlen_k) ran no tile: its K/V copies, issued by every
  // thread, may still be landing in this warp's rows (cp.async.wait covers a thread's own
  // copies only), so the block waits for all of them. The H100 saw K values in dK without it.
  cp_async_wait<0>();
  __syncthreads();
  if (kDoDK) {
    T* dk = static_cast<T*>(p.dk) + b * p.dk_stride[0] + hk * p.dk_stride[1];
    store_warp_rows<T, 1, kDTiles, kPitch>(acc_dk, p.scale, sK + warp * 16 * kPitch, dk,
                                           p.dk_stride[2], key_row0, Tk, p.head_dim, lane);
  }
  if (kDoDV) {
    T* dv = static_cast<T*>(p.dv) + b * p.dv_stride[0] + hk * p.dv_stride[1];
    store_warp_rows<T, 1, kDTiles, kPitch>(acc_dv, 1.f, sV + warp * 16 * kPitch, dv, p.dv_stride[2],
                                           key_row0, Tk, p.head_dim_v, lane);
  }
#else
  __trap();
#endif
}

}  // namespace attn
}  // namespace fusedattn
