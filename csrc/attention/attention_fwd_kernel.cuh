// Flash attention forward: one block per (batch*head, query block), online softmax over key
// tiles in registers, O(T) memory; writes out (B, H, Tq, Dv) and lse (B, H, Tq).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/attention.h"
#include "attention/masking.cuh"
#include "attention/warp_mma.cuh"

namespace fusedattn {
namespace attn {

// The key loop walks the tiles from the last one down, in two parts compiled for their case:
// the masked tiles first (causal diagonal, sequence end; every tile with key padding, attn_mask
// or a negative scale), then the unmasked ones, which run no mask code and no branch for it
// (unmasked_key_tiles in tiling.h). Walking down, every K tile but the first is whole.
template <typename T, typename Traits, bool kGeneral>
__global__ void __launch_bounds__(Traits::kNThreads, Traits::kMinBlocks)
    attention_fwd_kernel(const AttentionParams p, const int num_m_blocks) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  constexpr int kBlockM = Traits::kBlockM, kBlockN = Traits::kBlockN, kD = Traits::kHeadDim;
  constexpr int kMTiles = Traits::kMTiles, kPitch = Traits::kPitch;
  constexpr int kNTiles = kBlockN / 8, kDTiles = kD / 8, kThreads = Traits::kNThreads;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  T* sQ = reinterpret_cast<T*>(smem_raw);
  const uint32_t sQ_addr = smem_addr(sQ);
  const uint32_t sK_addr = sQ_addr + kBlockM * kPitch * sizeof(T);
  const uint32_t sV_addr = sK_addr + kBlockN * kPitch * sizeof(T);

  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int64_t bh = blockIdx.x / num_m_blocks;
  int m_block = blockIdx.x % num_m_blocks;
  // Causal: the longest rows first, so the short ones fill the last wave.
  if (p.is_causal) m_block = num_m_blocks - 1 - m_block;
  const int64_t b = bh / p.heads, h = bh % p.heads;
  const int64_t hk = h / (p.heads / p.kv_heads);
  const int m0 = m_block * kBlockM;
  const int Tq = p.seqlen_q, Tk = p.seqlen_k;

  const T* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[1];
  const T* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[1];
  const T* v = static_cast<const T*>(p.v) + b * p.v_stride[0] + hk * p.v_stride[1];
  // Built per copy, not kept across the key loop (registers; see attention_bwd_kernel.cuh).
  auto k_copy = [&] { return TileCopy<kBlockN, kD, kThreads, T>(k, p.k_stride[2], p.head_dim); };
  auto v_copy = [&] { return TileCopy<kBlockN, kD, kThreads, T>(v, p.v_stride[2], p.head_dim_v); };

  // Causal: key tiles right of this block's last query are never visited.
  const int n_end = p.is_causal ? min(Tk, m0 + kBlockM) : Tk;
  const int n_blocks = (n_end + kBlockN - 1) / kBlockN;
  const bool any_mask = p.key_padding != nullptr || (kGeneral && p.mask != nullptr);
  // A negative scale sends every tile down the masked path: the unmasked one takes the row
  // max of the raw scores (see key_tile).
  const int n_unmasked =
      min(n_blocks, unmasked_key_tiles(m0, Tk, p.is_causal, any_mask || p.scale < 0.f, kBlockN));
  const bool dropout = kGeneral && p.dropout_p > 0.f;
  const uint64_t seed = dropout ? static_cast<uint64_t>(*p.seed) : 0;
  const float inv_keep = dropout ? 1.f / (1.f - p.dropout_p) : 1.f;
  const float scale_log2 = p.scale * kLog2e;

  TileCopy<kBlockM, kD, kThreads, T>(q, p.q_stride[2], p.head_dim).load(sQ_addr, m0, Tq);
  if (n_blocks > 0) k_copy().load(sK_addr, (n_blocks - 1) * kBlockN, Tk);
  cp_async_commit();

  float acc_o[kMTiles][kDTiles][4];
  zero(acc_o);
  float row_max[kMTiles][2], row_sum[kMTiles][2];
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  const int warp_row0 = warp * Traits::kWarpRows;  // within the block
  const int g = lane >> 2, t = lane & 3;
  // This lane's ldmatrix addresses: its warp's Q rows, the K tile, the V tile.
  const uint32_t q_frag =
      sQ_addr + warp_row0 * kPitch * sizeof(T) + ldmatrix_lane_offset<T, kPitch, true>(lane);
  const uint32_t k_frag = sK_addr + ldmatrix_lane_offset<T, kPitch, false>(lane);
  const uint32_t v_frag = sV_addr + ldmatrix_lane_offset<T, kPitch, true>(lane);

  auto key_tile = [&](const int nb, auto masked) {
    constexpr bool kMasked = decltype(masked)::value;
    const int n0 = nb * kBlockN;
    cp_async_wait<0>();
    __syncthreads();  // Q and K tile nb landed; every warp is done with V tile nb-1
    if (kMasked) {
      v_copy().load_in_loop(sV_addr, n0, Tk, key_padding_row(p, b));  // padded keys' V: zeros
    } else {
      v_copy().template load<false>(sV_addr, n0, Tk);  // whole tiles
    }
    cp_async_commit();

    float acc_s[kMTiles][kNTiles][4];
    zero(acc_s);
    gemm_smem_nt<T, kMTiles, kNTiles, kD, kPitch>(acc_s, q_frag, k_frag);

    if (kMasked) {
      // Keys at or past `limit` are hidden from a row (sequence end, causal diagonal), and
      // key padding from every row; the general variant adds attn_mask per element.
      const HiddenKeys<kNTiles> hidden =
          p.key_padding ? HiddenKeys<kNTiles>(p, b, n0, lane) : HiddenKeys<kNTiles>();
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int row = m0 + warp_row0 + mt * 16 + g + 8 * (i >> 1);
          const int limit = p.is_causal ? min(row + 1, Tk) : Tk;
#pragma unroll
          for (int nt = 0; nt < kNTiles; ++nt) {
            const int col = n0 + nt * 8 + 2 * t + (i & 1);
            const bool hide = col >= limit || hidden(nt, i & 1);
            const float s2 = acc_s[mt][nt][i] * scale_log2;
            // masked_score reads attn_mask only for keys not hidden (never past seqlen_k).
            acc_s[mt][nt][i] = kGeneral ? masked_score<true>(p, b, h, row, col, hide, s2)
                                        : (hide ? -INFINITY : s2);
          }
        }
    }  // unmasked tiles keep raw scores: the scale folds into the softmax's FFMA below

    // The next K tile's copy is issued before the softmax, so it lands behind this tile's
    // softmax and P V instead of behind P V alone.
    cp_async_wait<0>();
    __syncthreads();  // V tile nb landed; every warp is done with K tile nb
    if (nb > 0) {
      k_copy().template load<false>(sK_addr, n0 - kBlockN, Tk);  // tiles before nb are whole
      cp_async_commit();
    }

    // Online softmax: rescale the running output by 2^(old max - new max).
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float tile_max = -INFINITY;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
          tile_max = fmaxf(tile_max, fmaxf(acc_s[mt][nt][2 * half], acc_s[mt][nt][2 * half + 1]));
        }
        tile_max = quad_max(tile_max);
        // Unmasked tiles: max(s * scale) = max(s) * scale, as scale >= 0 there.
        const float mx = fmaxf(row_max[mt][half], kMasked ? tile_max : tile_max * scale_log2);
        const float m_safe = mx == -INFINITY ? 0.f : mx;  // a row that has seen no key yet
        const float alpha = ex2(row_max[mt][half] - m_safe);
        row_max[mt][half] = mx;
        float sum = 0.f;
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt) {
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const float s = acc_s[mt][nt][2 * half + j];
            const float pr = ex2(kMasked ? s - m_safe : fmaf(s, scale_log2, -m_safe));
            acc_s[mt][nt][2 * half + j] = pr;
            sum += pr;
          }
        }
        row_sum[mt][half] = row_sum[mt][half] * alpha + sum;  // per-lane partial sums
#pragma unroll
        for (int dt = 0; dt < kDTiles; ++dt) {
          acc_o[mt][dt][2 * half] *= alpha;
          acc_o[mt][dt][2 * half + 1] *= alpha;
        }
      }
    }

    if (dropout) {  // after the row sums: the normaliser keeps the undropped mass
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int row = m0 + warp_row0 + mt * 16 + g + 8 * (i >> 1);
            const int col = n0 + nt * 8 + 2 * t + (i & 1);
            acc_s[mt][nt][i] *= dropout_factor(seed, bh, row, col, Tq, Tk, p.dropout_p, inv_keep);
          }
    }

    uint32_t a_p[kMTiles][kNTiles / 2][4];
    to_a_fragments<T, kMTiles, kNTiles>(a_p, acc_s);
    gemm_regs_smem<T, kMTiles, kNTiles / 2, kDTiles, kPitch>(acc_o, a_p, v_frag);
  };

  int nb = n_blocks - 1;
  for (; nb >= n_unmasked; --nb) key_tile(nb, Flag<true>());
  for (; nb >= 0; --nb) key_tile(nb, Flag<false>());

  // Normalise, write lse, and stage O through this warp's own Q rows for 16-byte stores.
  // With no key tile at all (a causal block past every key, an empty window) the Q copy may
  // still be in flight: cp.async.wait covers a thread's own copies only, and other threads
  // copied this warp's Q rows, so the block waits for all of them before O is staged there.
  cp_async_wait<0>();
  __syncthreads();
  float* lse = p.lse + bh * Tq;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const float l = quad_sum(row_sum[mt][half]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
      for (int dt = 0; dt < kDTiles; ++dt) {
        acc_o[mt][dt][2 * half] *= inv;
        acc_o[mt][dt][2 * half + 1] *= inv;
      }
      const int row = m0 + warp_row0 + mt * 16 + g + 8 * half;
      if (t == 0 && row < Tq) {
        lse[row] = l > 0.f ? (row_max[mt][half] + log2f(l)) * kLn2 : -INFINITY;
      }
    }
  }
  T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + h * p.out_stride[1];
  store_warp_rows<T, kMTiles, kDTiles, kPitch>(acc_o, 1.f, sQ + warp_row0 * kPitch, out,
                                               p.out_stride[2], m0 + warp_row0, Tq, p.head_dim_v,
                                               lane);
#else
  __trap();  // the launcher refuses devices below sm_80
#endif
}

}  // namespace attn
}  // namespace fusedattn
