// Tile shapes of the attention kernels. Every warp owns whole 16-row MMA tiles of the block's
// rows and the full (padded) head dim, so softmax statistics never leave a warp's registers.
#pragma once

namespace fusedattn {
namespace attn {

// Forward: a block of kBlockM queries (kNWarps warps x kMTiles x 16 rows) sweeps key tiles of
// kBlockN. Shared memory: Q, one K tile and one V tile (the V load overlaps S = Q K^T, the
// next K load overlaps O += P V), rows padded by 8 elements.
// kMinBlocks: blocks per SM asked of the register allocator (__launch_bounds__); 1 lets a
// thread use all 255 registers.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kMinBlocks_ = 1>
struct ForwardTraits {
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kWarpRows = kBlockM / kNWarps;
  static constexpr int kMTiles = kWarpRows / 16;
  static constexpr int kPitch = kHeadDim + 8;
  static constexpr int kSmemElems = (kBlockM + 2 * kBlockN) * kPitch;
  static_assert(kWarpRows % 16 == 0 && kBlockN % 16 == 0 && kHeadDim % 16 == 0, "MMA tiles");
};

// Backward, dK/dV kernel: a block of kBlockN keys (16 per warp) sweeps query tiles of kBlockM
// of every q head of its GQA group. Shared memory: K, V, and double-buffered Q, dO, lse, delta.
// kSplitPasses (head dim 256): dV and dK accumulators (2 x 128 fp32 per thread) do not fit in
// registers together, so the kernel runs twice, once per gradient.
template <int kHeadDim_, int kBlockM_, int kNWarps_, bool kSplitPasses_>
struct BackwardKVTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kBlockN = 16 * kNWarps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr bool kSplitPasses = kSplitPasses_;
  static constexpr int kPitch = kHeadDim + 8;
  static constexpr int kSmemElems = (2 * kBlockN + 4 * kBlockM) * kPitch;
  static constexpr int kSmemBytes = kSmemElems * 2 + 4 * kBlockM * 4;  // + lse, delta x 2
  static_assert(kBlockM % 16 == 0 && kHeadDim % 16 == 0, "MMA tiles");
};

// Backward, dQ kernel: a block of kBlockM queries (16 per warp) sweeps key tiles of kBlockN.
// Shared memory: Q, dO, and double-buffered K, V (K is read twice per tile: S and dQ += dS K).
template <int kHeadDim_, int kBlockN_, int kNWarps_, int kMinBlocks_ = 1>
struct BackwardQTraits {
  static constexpr int kMinBlocks = kMinBlocks_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kBlockM = 16 * kNWarps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kPitch = kHeadDim + 8;
  static constexpr int kSmemElems = (2 * kBlockM + 4 * kBlockN) * kPitch;
  static_assert(kBlockN % 16 == 0 && kHeadDim % 16 == 0, "MMA tiles");
};

// Backward in one pass per key block (attention_bwd_fused_kernel.cuh): a block of kBlockN keys
// (16 per warp, as BackwardKVTraits) sweeps query tiles of kBlockM. For dQ = dS K the warps tile
// the kBlockM x head-dim output: kBlockM / 16 m-tiles by kDQSlices column slices of kDQCols.
// Shared memory: K, V, double-buffered Q, dO, lse, delta, and dS^T (kBlockN x kBlockM, rows
// padded by 8: a 144-byte pitch at kBlockM = 64 keeps ldmatrix conflict-free).
template <int kHeadDim_, int kBlockM_, int kNWarps_>
struct BackwardFusedTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kBlockN = 16 * kNWarps;
  static constexpr int kNThreads = kNWarps * 32;
  static constexpr int kPitch = kHeadDim + 8;
  static constexpr int kDSPitch = kBlockM + 8;
  static constexpr int kDQSlices = kNWarps / (kBlockM / 16);
  static constexpr int kDQCols = kHeadDim / kDQSlices;
  static constexpr int kSmemBytes =
      ((2 * kBlockN + 4 * kBlockM) * kPitch + kBlockN * kDSPitch) * 2 + 4 * kBlockM * 4;
  static_assert(kBlockM % 16 == 0 && kHeadDim % 16 == 0, "MMA tiles");
  static_assert(kNWarps % (kBlockM / 16) == 0 && kDQCols % 16 == 0, "whole dQ slices per warp");
};

}  // namespace attn
}  // namespace fusedattn
