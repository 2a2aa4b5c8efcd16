// Index arithmetic of the attention kernels that does not touch a GPU: which thread copies
// which 16-byte chunk of a tile, which rows a lane hands to ldmatrix, and which key tiles need
// no mask. Plain C++ (host and device), so tests/test_cuda_tiling.py compiles it with the host
// compiler and checks it on every shape the kernels instantiate: on a machine without a GPU
// this is the part of the kernels that can be run.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FUSEDATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FUSEDATTN_HOST_DEVICE inline
#endif

namespace fusedattn {
namespace attn {

// A block of kThreads copies a kRows x kCols tile (row-major, rows padded to kCols + 8
// elements in shared memory) in 16-byte chunks of 8 elements. kFixedColumn: the threads cover
// whole rows (kCols / 8 divides kThreads), so thread `tid` keeps column col(tid) and copies
// rows row(tid) + s * kRowsPerStep for s < kSteps. Otherwise (head dim 96: 12 chunks per row
// over 128 threads) chunk c = tid + s * kThreads sits at row c / kChunksPerRow.
template <int kRows, int kCols, int kThreads>
struct CopyLayout {
  static constexpr int kChunksPerRow = kCols / 8;
  static constexpr int kPitch = kCols + 8;
  static constexpr bool kFixedColumn =
      kThreads % kChunksPerRow == 0 && kRows % (kThreads / kChunksPerRow) == 0;
  static constexpr int kRowsPerStep = kFixedColumn ? kThreads / kChunksPerRow : 1;
  static constexpr int kSteps = kFixedColumn ? kRows / kRowsPerStep : 0;
  static_assert(kCols % 8 == 0, "16-byte chunks");

  static FUSEDATTN_HOST_DEVICE int row(int tid) { return tid / kChunksPerRow; }
  static FUSEDATTN_HOST_DEVICE int col(int tid) { return (tid % kChunksPerRow) * 8; }
};

// The row and column (elements) of a padded row-major tile whose address lane `lane` hands to
// an ldmatrix.x4, for the two patterns the GEMMs use (PTX ISA: lanes 8i..8i+7 give the row
// addresses of 8x8 matrix i, which lands in register i).
//   kFragA: a 16x16 block as an mma A fragment, a0..a3 = rows 0-7 / 8-15 at k 0, then rows
//     0-7 / 8-15 at k 8; with .trans the same addresses give a 16(k) x 16(n) block of B.
//   otherwise: two n8 x k16 B operands (rows = n): b0, b1 of n rows 0-7 at k 0 and k 8, then
//     b0, b1 of n rows 8-15.
template <bool kFragA>
FUSEDATTN_HOST_DEVICE int ldmatrix_row(int lane) {
  return kFragA ? (lane & 15) : (lane & 7) + ((lane >> 4) << 3);
}
template <bool kFragA>
FUSEDATTN_HOST_DEVICE int ldmatrix_col(int lane) {
  return kFragA ? (lane >> 4) * 8 : ((lane >> 3) & 1) * 8;
}

// Forward key tiles [0, n) that need no mask for the query block starting at m0: tiles wholly
// inside seqlen_k and, when causal (key j visible to query i iff j <= i), wholly at or left of
// the block's first query; none when any mask is given. Rows past seqlen_q are not masked:
// their Q rows are zeros, their scores finite, and nothing of them is written.
FUSEDATTN_HOST_DEVICE int unmasked_key_tiles(int m0, int seqlen_k, bool is_causal, bool any_mask,
                                             int block_n) {
  if (any_mask) return 0;
  const int whole = seqlen_k / block_n;
  const int left_of_diagonal = (m0 + 1) / block_n;
  return is_causal && left_of_diagonal < whole ? left_of_diagonal : whole;
}

// dK/dV: of the query tiles [m_begin, num_m) a key block starting at n0 sweeps per q head, how
// many leading ones need masks. A tile needs them when any mask is given, when the key block
// crosses seqlen_k, or, causal, when a key of the block is right of the tile's first query
// (n0 + block_n - 1 > m * block_m): the tiles below the diagonal come last and need none.
FUSEDATTN_HOST_DEVICE int masked_query_tiles(int n0, int seqlen_k, int num_m, int m_begin,
                                             bool is_causal, bool any_mask, int block_m,
                                             int block_n) {
  const int tiles = num_m > m_begin ? num_m - m_begin : 0;
  if (any_mask || n0 + block_n > seqlen_k) return tiles;
  if (!is_causal) return 0;
  const int diagonal_end = (n0 + block_n - 1 + block_m - 1) / block_m;  // first m with none
  const int masked = diagonal_end - m_begin;
  return masked < 0 ? 0 : (masked > tiles ? tiles : masked);
}

// The fused backward (attention_bwd_fused_kernel): one block per (batch, kv head, split) runs
// key blocks nb = split, split + splits, ... in that order; each adds its dQ partial to the
// split's fp32 accumulator, the first one storing instead of adding, and a last kernel sums
// the splits in split order. Deterministic: every accumulator element is written by one thread
// in a fixed order. The key block starting at n0 reaches query tiles from first_query_tile on
// (causal: the tiles wholly above its first key see none of it).
FUSEDATTN_HOST_DEVICE int first_query_tile(int n0, bool is_causal, int block_m) {
  return is_causal ? n0 / block_m : 0;
}

// Whether split `split` wrote query row `row` of its accumulator: its first key block reaches
// every query tile its later ones do (first_query_tile grows with n0), so this is that block's
// range. The summing kernel skips the rows a split never wrote (no memset of the accumulator).
FUSEDATTN_HOST_DEVICE bool split_wrote_row(int row, int split, bool is_causal, int block_m,
                                           int block_n) {
  return row / block_m >= first_query_tile(split * block_n, is_causal, block_m);
}

// How many splits the fused backward runs for kv_blocks = batch * kv heads: the count in
// [1, min(max_splits, num_n_blocks)] whose grid (kv_blocks * splits blocks) fills the last
// wave of `wave` resident blocks best, the fewest on a tie (each split is one more fp32 dQ).
// 0 when even max_splits leaves the GPU less than one wave: the two-kernel backward (one block
// per query block and per key block) then keeps more SMs busy.
FUSEDATTN_HOST_DEVICE int fused_backward_splits(int64_t kv_blocks, int num_n_blocks, int wave,
                                                int max_splits) {
  if (kv_blocks <= 0 || num_n_blocks <= 0 || wave <= 0) return 0;
  const int most = max_splits < num_n_blocks ? max_splits : num_n_blocks;
  int best = 0;
  int64_t best_used = 0, best_slots = 1;  // the best fill so far, best_used / best_slots
  for (int splits = 1; splits <= most; ++splits) {
    const int64_t blocks = kv_blocks * splits;
    if (blocks < wave) continue;
    const int64_t slots = (blocks + wave - 1) / wave * wave;
    if (best == 0 || blocks * best_slots > best_used * slots) {
      best = splits;
      best_used = blocks;
      best_slots = slots;
    }
  }
  return best;
}

// How many fp32 dQ accumulators of bytes_per_split each the fused backward may allocate: at
// most max_splits, and together at most max_bytes; 0 when not even one fits (the two-kernel
// backward then runs: it needs none).
FUSEDATTN_HOST_DEVICE int splits_within_memory(int64_t bytes_per_split, int64_t max_bytes,
                                               int max_splits) {
  if (bytes_per_split <= 0) return max_splits;
  const int64_t fit = max_bytes / bytes_per_split;
  return fit < max_splits ? static_cast<int>(fit) : max_splits;
}

}  // namespace attn
}  // namespace fusedattn
