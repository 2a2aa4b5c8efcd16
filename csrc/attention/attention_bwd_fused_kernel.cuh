// Flash attention backward in one pass per key block (issue #13), deterministic: a block owns
// one split of a (batch, kv head)'s key blocks (tiling.h: fused_backward_splits) and, per key
// block, sweeps every query tile of the GQA group once: S^T = K Q^T and dP^T = V dO^T, then
// dV += P^T dO, dK += dS^T Q from registers and dQ += dS K from dS^T staged in shared memory.
// dQ goes to the split's own fp32 accumulator (the first key block of the split stores, the
// others add: one thread per element, in key-block order), and attention_bwd_dq_sum_kernel adds
// the splits in split order. 5 GEMM-equivalents per tile against the two-kernel backward's 7
// (its dQ kernel recomputes S and dP), for the price of writing fp32 dQ partials once per
// (key block, query tile) and reading them back once per split.
//
// The fast variant only (no attn_mask, no dropout): key padding and causal masks, as the
// two-kernel path's fast kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/attention.h"
#include "attention/attention_bwd_kernel.cuh"
#include "attention/masking.cuh"
#include "attention/warp_mma.cuh"
#include "common/dtype.cuh"

namespace fusedattn {
namespace attn {

// Two adjacent fp32 dQ partials into an accumulator (8-byte aligned): stored by the split's first
// key block, added by the others. A reduction (no value returned), vectorized on sm_90. Only
// this thread writes these two elements of this split's accumulator, and two operations of one
// thread on one address keep program order: the sum's order is fixed.
__device__ __forceinline__ void accumulate_pair(float* dst, float lo, float hi, bool store) {
  if (store) {
    *reinterpret_cast<float2*>(dst) = make_float2(lo, hi);
    return;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("red.global.add.v2.f32 [%0], {%1, %2};\n" ::"l"(dst), "f"(lo), "f"(hi) : "memory");
#else
  atomicAdd(dst, lo);
  atomicAdd(dst + 1, hi);
#endif
}

// A += dS K for one warp: A is this warp's 16 query rows (m-tile `m_tile` of the query tile) by
// kNTiles * 8 head-dim columns starting at `col0`, summed over the kKSteps * 16 keys of the
// block. dS comes from dS^T (keys x queries, row-major, pitch kDSPitch) through ldmatrix.trans,
// whose "B operand" lane pattern (tiling.h) is the A fragment of the transpose; K (keys x head
// dim, pitch kPitch) as in gemm_regs_smem.
template <typename T, int kKSteps, int kNTiles, int kDSPitch, int kPitch>
__device__ __forceinline__ void gemm_dq(float (&acc)[1][kNTiles][4], uint32_t sdst_lane,
                                        uint32_t sk_lane) {
  static_assert(kNTiles % 2 == 0, "tiles come in pairs of 8 columns");
  constexpr int kElem = sizeof(T);
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
    uint32_t a[4];
    ldmatrix_x4_trans(a, sdst_lane + ks * 16 * kDSPitch * kElem);
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, sk_lane + (ks * 16 * kPitch + nt * 8) * kElem);
      mma_16816<T>(acc[0][nt], a, bf[0], bf[1]);
      mma_16816<T>(acc[0][nt + 1], a, bf[2], bf[3]);
    }
  }
}

template <typename T, typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    attention_bwd_fused_kernel(const AttentionParams p, const int num_n_blocks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kPitch = Traits::kPitch, kDSPitch = Traits::kDSPitch;
  constexpr int kQTiles = kBlockM / 8, kDTiles = kD / 8;
  constexpr int kDQCols = Traits::kDQCols, kDQTiles = kDQCols / 8;
  constexpr int kThreads = Traits::kNThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sK = reinterpret_cast<T*>(smem_raw);
  T* sV = sK + kBlockN * kPitch;
  T* sQ0 = sV + kBlockN * kPitch;         // [2][kBlockM][kPitch]
  T* sdO0 = sQ0 + 2 * kBlockM * kPitch;   // [2][kBlockM][kPitch]
  T* sdSt = sdO0 + 2 * kBlockM * kPitch;  // [kBlockN][kDSPitch]: dS^T of the current tile
  constexpr uint32_t kTileBytes = kBlockM * kPitch * sizeof(T);
  const uint32_t sK_addr = smem_addr(sK), sV_addr = smem_addr(sV);
  const uint32_t sQ0_addr = smem_addr(sQ0), sdO0_addr = smem_addr(sdO0);
  const uint32_t sdSt_addr = smem_addr(sdSt);
  float* sLse0 = reinterpret_cast<float*>(sdSt + kBlockN * kDSPitch);  // [2][kBlockM]
  float* sDelta0 = sLse0 + 2 * kBlockM;                                // [2][kBlockM]

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int g = lane >> 2, t = lane & 3;
  // Splits of one (batch, kv head) are adjacent blocks: they read the same Q and dO.
  const int split = blockIdx.x % p.dq_splits;
  const int64_t bhk = blockIdx.x / p.dq_splits;
  const int64_t b = bhk / p.kv_heads, hk = bhk % p.kv_heads;
  const int group = p.heads / p.kv_heads;
  const int Tq = p.seqlen_q, Tk = p.seqlen_k;
  const int num_m = (Tq + kBlockM - 1) / kBlockM;
  const bool any_mask = p.key_padding != nullptr;
  const float scale_log2 = p.scale * kLog2e;

  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
  T* dk = static_cast<T*>(p.dk) + b * p.dk_stride[0] + hk * p.dk_stride[1];
  T* dv = static_cast<T*>(p.dv) + b * p.dv_stride[0] + hk * p.dv_stride[1];
  float* dq_split = p.dq_accum + static_cast<int64_t>(split) * p.batch * p.heads * Tq * p.head_dim;

  // This warp's share of the dQ tile: m-tile dq_mt of the query tile, columns [dq_col0,
  // dq_col0 + kDQCols). The lane addresses of its two operands (gemm_dq).
  const int dq_mt = warp % (kBlockM / 16);
  const int dq_col0 = warp / (kBlockM / 16) * kDQCols;
  const uint32_t dq_dst_lane =
      sdSt_addr + dq_mt * 16 * sizeof(T) + ldmatrix_lane_offset<T, kDSPitch, false>(lane);
  const uint32_t dq_k_lane =
      sK_addr + dq_col0 * sizeof(T) + ldmatrix_lane_offset<T, kPitch, true>(lane);
  const uint32_t k_frag =
      sK_addr + warp * 16 * kPitch * sizeof(T) + ldmatrix_lane_offset<T, kPitch, true>(lane);
  const uint32_t v_frag =
      sV_addr + warp * 16 * kPitch * sizeof(T) + ldmatrix_lane_offset<T, kPitch, true>(lane);
  const uint32_t qdo_nt_offset = ldmatrix_lane_offset<T, kPitch, false>(lane);
  const uint32_t qdo_trans_offset = ldmatrix_lane_offset<T, kPitch, true>(lane);

  for (int nb = split; nb < num_n_blocks; nb += p.dq_splits) {
    const int n0 = nb * kBlockN;
    const bool first_of_split = nb == split;  // stores its dQ partials; later blocks add
    // Padded keys' K and V rows: zeros (TileCopy::load), for dQ = dS K as well.
    const uint8_t* key_pad = key_padding_row(p, b);
    TileCopy<kBlockN, kD, kThreads, T>(k, p.k_stride[2], p.head_dim).load(sK_addr, n0, Tk, key_pad);
    TileCopy<kBlockN, kD, kThreads, T>(v, p.v_stride[2], p.head_dim_v)
        .load(sV_addr, n0, Tk, key_pad);
    cp_async_commit();

    const int m_begin = first_query_tile(n0, p.is_causal, kBlockM);
    const int tiles_per_head = max(0, num_m - m_begin);
    const int tiles = group * tiles_per_head;

    auto prefetch = [&](int head, int mi, int buf) {
      return prefetch_query_tile<T, kBlockM, kD, kThreads>(p, b, hk, group, m_begin, Tq, head, mi,
                                                           buf, sQ0_addr, sdO0_addr);
    };
    if (tiles > 0) store_query_stats<kBlockM>(prefetch(0, 0, 0), 0, sLse0, sDelta0);

    float acc_dk[1][kDTiles][4], acc_dv[1][kDTiles][4];
    zero(acc_dk);
    zero(acc_dv);
    const int key_row0 = n0 + warp * 16;
    const bool key_hidden_row[2] = {key_hidden(p, b, key_row0 + g),
                                    key_hidden(p, b, key_row0 + g + 8)};

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
      zero(acc_dpt);
      gemm_smem_nt<T, 1, kQTiles, kD, kPitch>(acc_st, k_frag, sQ + qdo_nt_offset);
      gemm_smem_nt<T, 1, kQTiles, kD, kPitch>(acc_dpt, v_frag, sdO + qdo_nt_offset);
      transposed_probabilities<kMasked, false, true>(acc_st, acc_dpt, p, b, h, m0, key_row0, g, t,
                                                     key_hidden_row, sLse, sDelta, scale_log2,
                                                     false, 0, 1.f);
      uint32_t a[1][kQTiles / 2][4];
      to_a_fragments<T, 1, kQTiles>(a, acc_st);
      gemm_regs_smem<T, 1, kQTiles / 2, kDTiles, kPitch>(acc_dv, a, sdO + qdo_trans_offset);
      to_a_fragments<T, 1, kQTiles>(a, acc_dpt);
      // dS^T to shared memory for dQ: the A fragments hold this warp's rows g and g + 8 at
      // query columns 16 ks + 2t (+1) and 16 ks + 8 + 2t (+1), as packed pairs.
      {
        T* row_g = sdSt + (warp * 16 + g) * kDSPitch + 2 * t;
#pragma unroll
        for (int ks = 0; ks < kQTiles / 2; ++ks) {
          *reinterpret_cast<uint32_t*>(row_g + 16 * ks) = a[0][ks][0];
          *reinterpret_cast<uint32_t*>(row_g + 8 * kDSPitch + 16 * ks) = a[0][ks][1];
          *reinterpret_cast<uint32_t*>(row_g + 16 * ks + 8) = a[0][ks][2];
          *reinterpret_cast<uint32_t*>(row_g + 8 * kDSPitch + 16 * ks + 8) = a[0][ks][3];
        }
      }
      gemm_regs_smem<T, 1, kQTiles / 2, kDTiles, kPitch>(acc_dk, a, sQ + qdo_trans_offset);
      __syncthreads();  // dS^T of every warp's keys is in shared memory

      float acc_dq[1][kDQTiles][4];
      zero(acc_dq);
      gemm_dq<T, kBlockN / 16, kDQTiles, kDSPitch, kPitch>(acc_dq, dq_dst_lane, dq_k_lane);
      float* dq_rows = dq_split + ((b * p.heads + h) * Tq) * p.head_dim;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = m0 + dq_mt * 16 + g + 8 * half;
        if (row >= Tq) continue;
        float* dst = dq_rows + static_cast<int64_t>(row) * p.head_dim + dq_col0 + 2 * t;
#pragma unroll
        for (int nt = 0; nt < kDQTiles; ++nt) {
          if (dq_col0 + nt * 8 < p.head_dim) {  // head_dim is a multiple of 8
            accumulate_pair(dst + nt * 8, acc_dq[0][nt][2 * half], acc_dq[0][nt][2 * half + 1],
                            first_of_split);
          }
        }
      }
      if (tile + 1 < tiles)
        store_query_stats<kBlockM>(next, buf ^ 1, sLse0, sDelta0);  // read after the next barrier
      __syncthreads();  // every warp is done with Q, dO and dS^T before they are refilled
    };

    const int masked_per_head =
        masked_query_tiles(n0, Tk, num_m, m_begin, p.is_causal, any_mask, kBlockM, kBlockN);
    for (int head = 0, tile = 0; head < group && tiles_per_head > 0; ++head) {
      int mi = 0;
      for (; mi < masked_per_head; ++mi, ++tile) query_tile(tile, head, mi, Flag<true>());
      for (; mi < tiles_per_head; ++mi, ++tile) query_tile(tile, head, mi, Flag<false>());
    }

    // dK and dV through this warp's own K and V rows, after every thread's copies landed (a key
    // block no query sees ran no tile: see the dK/dV kernel) and every warp's dQ GEMM is done
    // with K (the last tile's barrier).
    cp_async_wait<0>();
    __syncthreads();
    store_warp_rows<T, 1, kDTiles, kPitch>(acc_dk, p.scale, sK + warp * 16 * kPitch, dk,
                                           p.dk_stride[2], key_row0, Tk, p.head_dim, lane);
    store_warp_rows<T, 1, kDTiles, kPitch>(acc_dv, 1.f, sV + warp * 16 * kPitch, dv, p.dv_stride[2],
                                           key_row0, Tk, p.head_dim_v, lane);
    __syncthreads();  // K and V are free for the next key block
  }
#else
  __trap();
#endif
}

constexpr int kDqSumThreads = 256;

// dq = scale * (sum of the splits' partials, split 0 first), one 8-column chunk per thread.
// A split contributes only to the rows it wrote (split_wrote_row): the accumulators are never
// zeroed.
template <typename T, int kBlockM, int kBlockN>
__global__ void __launch_bounds__(kDqSumThreads)
    attention_bwd_dq_sum_kernel(const AttentionParams p) {
  const int chunks_per_row = p.head_dim / 8;
  const int64_t rows = static_cast<int64_t>(p.batch) * p.heads * p.seqlen_q;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kDqSumThreads + threadIdx.x;
  if (chunk >= rows * chunks_per_row) return;
  const int64_t row = chunk / chunks_per_row;
  const int col = static_cast<int>(chunk % chunks_per_row) * 8;
  const int64_t bh = row / p.seqlen_q;
  const int q = static_cast<int>(row % p.seqlen_q);
  const int64_t split_elems = rows * p.head_dim;
  const float* src = p.dq_accum + row * p.head_dim + col;
  float sum[8] = {};
  for (int split = 0; split < p.dq_splits; ++split) {
    if (!split_wrote_row(q, split, p.is_causal, kBlockM, kBlockN)) continue;
    const float4 lo = *reinterpret_cast<const float4*>(src + split * split_elems);
    const float4 hi = *reinterpret_cast<const float4*>(src + split * split_elems + 4);
    sum[0] += lo.x, sum[1] += lo.y, sum[2] += lo.z, sum[3] += lo.w;
    sum[4] += hi.x, sum[5] += hi.y, sum[6] += hi.z, sum[7] += hi.w;
  }
  uint4 out;
  uint32_t* packed = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i) packed[i] = pack2<T>(sum[2 * i] * p.scale, sum[2 * i + 1] * p.scale);
  const int64_t b = bh / p.heads, h = bh % p.heads;
  T* dq = static_cast<T*>(p.dq) + b * p.dq_stride[0] + h * p.dq_stride[1] +
          static_cast<int64_t>(q) * p.dq_stride[2] + col;
  *reinterpret_cast<uint4*>(dq) = out;
}

}  // namespace attn
}  // namespace fusedattn
