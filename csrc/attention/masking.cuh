// Score masking and dropout of the attention kernels, element by element on C fragments.
// Only tiles that need it pay for it: the kernels call these when a tile crosses a sequence
// end or the causal diagonal, or when a mask / dropout is present.
#pragma once

#include <cstdint>

#include "attention/attention.h"
#include "attention/warp_mma.cuh"

namespace fusedattn {
namespace attn {

// A compile-time flag for the kernels' generic lambdas: key_tile(nb, Flag<true>()) compiles the
// masked loop body, Flag<false>() the unmasked one.
template <bool kValue>
struct Flag {
  static constexpr bool value = kValue;
};

// Whether key `k` of batch b is hidden from every query: past the sequence end, or padding.
// Both kernel variants read the key padding mask: once per key and tile, it is cheap.
__device__ __forceinline__ bool key_hidden(const AttentionParams& p, int64_t b, int k) {
  if (k >= p.seqlen_k) return true;
  return p.key_padding && p.key_padding[b * p.key_padding_stride + k];
}

// Batch b's row of the key padding mask, indexed by key (TileCopy::load's `skip` rows: padded
// keys' K and V rows are zero-filled), or nullptr without key padding.
__device__ __forceinline__ const uint8_t* key_padding_row(const AttentionParams& p, int64_t b) {
  return p.key_padding ? p.key_padding + b * p.key_padding_stride : nullptr;
}

// Which of a thread's key columns in a C-fragment tile starting at key n0 are hidden:
// hidden(nt, j) for key n0 + 8 * nt + 2 * (lane % 4) + j. Each lane reads one key per 32 (a
// coalesced byte per lane), a warp ballot shares the words, and a lane keeps them shifted to
// its own columns. The whole warp must call it. Reading the 16 keys of a thread one by one
// kept 16 loads in flight across the S GEMM in the forward's masked loop, and spilled.
template <int kNTiles>
struct HiddenKeys {
  static_assert(kNTiles % 4 == 0, "whole 32-key words");
  uint32_t word[kNTiles / 4] = {};  // bit 8 * (nt % 4) + j of word[nt / 4]

  HiddenKeys() = default;  // nothing hidden

  __device__ __forceinline__ HiddenKeys(const AttentionParams& p, int64_t b, int n0, int lane) {
#pragma unroll
    for (int w = 0; w < kNTiles / 4; ++w) {
      const uint32_t all = __ballot_sync(0xffffffffu, key_hidden(p, b, n0 + 32 * w + lane));
      word[w] = all >> (2 * (lane & 3));
    }
  }
  __device__ __forceinline__ bool operator()(int nt, int j) const {
    return (word[nt / 4] >> (8 * (nt % 4) + j)) & 1u;
  }
};

// Scaled score in the log2 domain (s2 = q.k * scale * log2 e) of query `q`, key `k` of head
// (b, h) with every mask applied: -inf where the key is hidden (`hidden`: see key_hidden) or
// right of the causal diagonal; plus the float mask (times log2 e). Queries past seqlen_q are
// not masked (their rows are zeros, never written, and have lse = +inf in the backward); the
// mask is not read for them. kUserMasks: the general variant, which reads attn_mask.
template <bool kUserMasks>
__device__ __forceinline__ float masked_score(const AttentionParams& p, int64_t b, int64_t h, int q,
                                              int k, bool hidden, float s2) {
  if (hidden || (p.is_causal && k > q)) return -INFINITY;
  if (kUserMasks && p.mask && q < p.seqlen_q) {
    const int64_t off = b * p.mask_stride[0] + h * p.mask_stride[1] +
                        static_cast<int64_t>(q) * p.mask_stride[2] +
                        static_cast<int64_t>(k) * p.mask_stride[3];
    if (p.mask_is_bool) {
      if (!static_cast<const uint8_t*>(p.mask)[off]) return -INFINITY;
    } else {
      s2 += static_cast<const float*>(p.mask)[off] * kLog2e;
    }
  }
  return s2;
}

// Whether a call needs the kernels' general variant: an attn_mask (read per element) or dropout
// (a Philox draw per element). Key padding alone takes the fast variant of all three kernels:
// on the H200 the general variant ran B=4 H=16 T=4096 D=128 with key padding at 89 TFLOP/s
// forward against 275 without a mask. (The dK/dV kernel joined them when its loop stopped
// spilling, issue #13: it reads a thread's two keys' padding once per block.)
inline bool needs_general_variant(const AttentionParams& p) {
  return p.mask != nullptr || p.dropout_p > 0.f;
}

// Philox-4x32-10, first output word, for counter (offset_lo, offset_hi, 0, 0) and key (seed_lo,
// seed_hi): the same stream as triton.language.rand(seed, offset) with a 64-bit offset, so
// the CUDA and Triton backends drop the same elements for the same seed.
__device__ __forceinline__ uint32_t philox_first_word(uint64_t seed, uint64_t offset) {
  uint32_t c0 = static_cast<uint32_t>(offset), c1 = static_cast<uint32_t>(offset >> 32);
  uint32_t c2 = 0, c3 = 0;
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    const uint32_t old_c0 = c0, old_c2 = c2;
    c0 = __umulhi(0xCD9E8D57u, old_c2) ^ c1 ^ k0;
    c2 = __umulhi(0xD2511F53u, old_c0) ^ c3 ^ k1;
    c1 = 0xCD9E8D57u * old_c2;
    c3 = 0xD2511F53u * old_c0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// Uniform in [0, 1) from a random word, as Triton converts it (int32, folded to >= 0).
__device__ __forceinline__ float uniform_from_word(uint32_t word) {
  int32_t x = static_cast<int32_t>(word);
  if (x < 0) x = ~x;  // -x - 1 without overflow
  return __int2float_rn(x) * 4.6566127342e-10f;
}

// 1 / (1 - p) where the element (bh, q, k) is kept, 0 where it is dropped.
__device__ __forceinline__ float dropout_factor(uint64_t seed, int64_t bh, int q, int k,
                                                int seqlen_q, int seqlen_k, float p,
                                                float inv_keep) {
  const int64_t offset = (bh * seqlen_q + q) * static_cast<int64_t>(seqlen_k) + k;
  const float u = uniform_from_word(philox_first_word(seed, static_cast<uint64_t>(offset)));
  return u >= p ? inv_keep : 0.f;
}

}  // namespace attn
}  // namespace fusedattn
