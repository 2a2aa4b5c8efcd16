// Host-side check of the CUDA attention kernels' index arithmetic (csrc/attention/tiling.h),
// built and run by tests/test_cuda_tiling.py with the host C++ compiler: no GPU, no nvcc.
// Prints one line per failure and exits non-zero if there was any.
#include <cstdio>
#include <vector>

#include "attention/tiling.h"

using namespace fusedattn::attn;

static int failures = 0;

#define CHECK(cond, ...)                 \
  do {                                   \
    if (!(cond)) {                       \
      ++failures;                        \
      if (failures <= 20) {              \
        std::printf("FAIL %s: ", #cond); \
        std::printf(__VA_ARGS__);        \
        std::printf("\n");               \
      }                                  \
    }                                    \
  } while (0)

// Every 16-byte chunk of a kRows x kCols tile is copied exactly once, to shared offset
// row * kPitch + col, by the thread and step the layout says.
template <int kRows, int kCols, int kThreads>
static void check_copy_layout() {
  using L = CopyLayout<kRows, kCols, kThreads>;
  std::vector<int> hits(kRows * L::kChunksPerRow, 0);
  if (L::kFixedColumn) {
    CHECK(L::kSteps * kThreads == kRows * L::kChunksPerRow, "%dx%d/%d", kRows, kCols, kThreads);
    for (int tid = 0; tid < kThreads; ++tid) {
      const int col = L::col(tid);
      CHECK(col % 8 == 0 && col < kCols, "col %d of tid %d", col, tid);
      for (int s = 0; s < L::kSteps; ++s) {
        const int row = L::row(tid) + s * L::kRowsPerStep;
        CHECK(row < kRows, "%dx%d/%d: tid %d step %d row %d", kRows, kCols, kThreads, tid, s, row);
        if (row < kRows) ++hits[row * L::kChunksPerRow + col / 8];
      }
    }
  } else {
    for (int c = 0; c < kRows * L::kChunksPerRow; ++c) ++hits[c];
  }
  for (size_t i = 0; i < hits.size(); ++i) {
    CHECK(hits[i] == 1, "%dx%d/%d: chunk %zu copied %d times", kRows, kCols, kThreads, i, hits[i]);
  }
}

template <int kCols>
static void check_copy_layouts_for_cols() {
  check_copy_layout<32, kCols, 128>();
  check_copy_layout<64, kCols, 128>();
  check_copy_layout<128, kCols, 128>();
  check_copy_layout<32, kCols, 256>();
  check_copy_layout<64, kCols, 256>();
  check_copy_layout<128, kCols, 256>();
}

// The ldmatrix.x4 row addresses: lanes 8i..8i+7 give rows 0..7 of 8x8 matrix i, and matrix i
// must be the one the mma.m16n8k16 fragment expects in register i (PTX ISA fragment layouts).
static void check_ldmatrix_patterns() {
  for (int lane = 0; lane < 32; ++lane) {
    const int matrix = lane / 8, r = lane % 8;
    // A fragment a0..a3: (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (8-15, 8-15)
    CHECK(ldmatrix_row<true>(lane) == (matrix % 2) * 8 + r, "A row of lane %d", lane);
    CHECK(ldmatrix_col<true>(lane) == (matrix / 2) * 8, "A col of lane %d", lane);
    // B operands of two n-tiles: b0, b1 of n 0-7 (k 0-7, k 8-15), then b0, b1 of n 8-15
    CHECK(ldmatrix_row<false>(lane) == (matrix / 2) * 8 + r, "B row of lane %d", lane);
    CHECK(ldmatrix_col<false>(lane) == (matrix % 2) * 8, "B col of lane %d", lane);
  }
}

// unmasked_key_tiles is sound (every key of every tile it calls unmasked is inside seqlen_k and,
// when causal, at or left of every query of the block) and tight (the next tile is not).
static void check_unmasked_key_tiles() {
  for (int block_n : {32, 64}) {
    for (int block_m : {64, 128}) {
      for (int seqlen_k = 0; seqlen_k <= 300; ++seqlen_k) {
        for (int m0 = 0; m0 <= 400; m0 += block_m) {
          for (int causal = 0; causal < 2; ++causal) {
            CHECK(unmasked_key_tiles(m0, seqlen_k, causal, true, block_n) == 0, "any_mask");
            const int n = unmasked_key_tiles(m0, seqlen_k, causal, false, block_n);
            auto tile_unmasked = [&](int nb) {
              for (int key = nb * block_n; key < (nb + 1) * block_n; ++key) {
                if (key >= seqlen_k || (causal && key > m0)) return false;
              }
              return true;
            };
            for (int nb = 0; nb < n; ++nb) {
              CHECK(tile_unmasked(nb), "tile %d of Tk=%d m0=%d causal=%d bn=%d", nb, seqlen_k, m0,
                    causal, block_n);
            }
            CHECK(!tile_unmasked(n), "tile %d after the unmasked ones, Tk=%d m0=%d causal=%d bn=%d",
                  n, seqlen_k, m0, causal, block_n);
          }
        }
      }
    }
  }
}

// masked_query_tiles: the dK/dV kernel's query tiles that need masks are exactly a leading run
// of the given length, per the kernel's own condition for a tile.
static void check_masked_query_tiles() {
  for (int block_n : {32, 64, 128}) {
    for (int block_m : {32, 64}) {
      for (int n0 = 0; n0 <= 320; n0 += block_n) {
        for (int seqlen_k = n0 + 1; seqlen_k <= n0 + block_n + 1; ++seqlen_k) {
          for (int seqlen_q = 1; seqlen_q <= 330; seqlen_q += 7) {
            for (int causal = 0; causal < 2; ++causal) {
              for (int any_mask = 0; any_mask < 2; ++any_mask) {
                const int num_m = (seqlen_q + block_m - 1) / block_m;
                const int m_begin = causal ? n0 / block_m : 0;
                const int count = masked_query_tiles(n0, seqlen_k, num_m, m_begin, causal, any_mask,
                                                     block_m, block_n);
                for (int m = m_begin; m < num_m; ++m) {
                  const bool masked = any_mask || n0 + block_n > seqlen_k ||
                                      (causal && n0 + block_n - 1 > m * block_m);
                  CHECK(masked == (m - m_begin < count),
                        "n0=%d Tk=%d Tq=%d causal=%d any=%d bm=%d bn=%d: tile %d", n0, seqlen_k,
                        seqlen_q, causal, any_mask, block_m, block_n, m);
                }
                CHECK(count >= 0 && count <= (num_m > m_begin ? num_m - m_begin : 0), "range");
              }
            }
          }
        }
      }
    }
  }
}

// The fused backward's schedule, simulated: every key block runs in exactly one split; in each
// split the first key block reaching a query tile is the split's first block (it stores, the
// rest add); split_wrote_row names exactly the rows some block of the split wrote.
static void check_fused_backward_schedule() {
  for (int block_n : {64, 128}) {
    for (int block_m : {64}) {
      for (int seqlen_k = 1; seqlen_k <= 700; seqlen_k += 37) {
        for (int seqlen_q = 1; seqlen_q <= 700; seqlen_q += 41) {
          for (int causal = 0; causal < 2; ++causal) {
            const int num_n = (seqlen_k + block_n - 1) / block_n;
            const int num_m = (seqlen_q + block_m - 1) / block_m;
            for (int splits = 1; splits <= 4 && splits <= num_n; ++splits) {
              std::vector<int> runs(num_n, 0);
              for (int split = 0; split < splits; ++split) {
                std::vector<int> first_writer(num_m, -1);
                for (int nb = split; nb < num_n; nb += splits) {
                  ++runs[nb];
                  for (int m = first_query_tile(nb * block_n, causal, block_m); m < num_m; ++m) {
                    if (first_writer[m] < 0) first_writer[m] = nb;
                  }
                }
                for (int m = 0; m < num_m; ++m) {
                  CHECK(first_writer[m] < 0 || first_writer[m] == split,
                        "split %d of %d: tile %d first written by key block %d (Tq=%d Tk=%d "
                        "causal=%d)",
                        split, splits, m, first_writer[m], seqlen_q, seqlen_k, causal);
                }
                for (int row = 0; row < seqlen_q; ++row) {
                  CHECK(split_wrote_row(row, split, causal, block_m, block_n) ==
                            (first_writer[row / block_m] >= 0),
                        "split %d of %d, row %d (Tq=%d Tk=%d causal=%d bn=%d)", split, splits, row,
                        seqlen_q, seqlen_k, causal, block_n);
                }
              }
              for (int nb = 0; nb < num_n; ++nb)
                CHECK(runs[nb] == 1, "key block %d ran %d", nb, runs[nb]);
            }
          }
        }
      }
    }
  }
}

// fused_backward_splits: within [1, min(max_splits, num_n_blocks)], at least one wave, the
// best last-wave fill (fewest splits on a tie); 0 exactly when no count reaches a wave.
static void check_fused_backward_splits() {
  for (int wave : {1, 7, 108, 132, 264}) {
    for (int64_t kv = 0; kv <= 300; ++kv) {
      for (int num_n = 0; num_n <= 6; ++num_n) {
        const int got = fused_backward_splits(kv, num_n, wave, 4);
        const int most = num_n < 4 ? num_n : 4;
        if (kv == 0 || num_n == 0 || kv * most < wave) {
          CHECK(got == 0, "kv=%lld num_n=%d wave=%d: got %d", (long long)kv, num_n, wave, got);
          continue;
        }
        CHECK(got >= 1 && got <= most && kv * got >= wave, "kv=%lld num_n=%d wave=%d: got %d",
              (long long)kv, num_n, wave, got);
        auto fill = [&](int s) {
          const double blocks = static_cast<double>(kv * s);
          return blocks / (static_cast<double>((kv * s + wave - 1) / wave) * wave);
        };
        for (int s = 1; s <= most; ++s) {
          if (kv * s < wave) continue;
          CHECK(fill(s) <= fill(got) + 1e-12 && (fill(s) < fill(got) - 1e-12 || s >= got),
                "kv=%lld num_n=%d wave=%d: %d splits fill %.4f, chose %d at %.4f", (long long)kv,
                num_n, wave, s, fill(s), got, fill(got));
        }
      }
    }
  }
  CHECK(fused_backward_splits(64, 32, 132, 4) == 4, "B*Hkv=64 on 132 SMs");
  CHECK(fused_backward_splits(5, 32, 132, 4) == 0, "too few kv heads");
}

// splits_within_memory: never past max_splits, never past max_bytes together, and the most
// that fit; 0 exactly when one split alone is over the cap.
static void check_splits_within_memory() {
  for (int64_t per = 1; per <= 40; ++per) {
    for (int64_t cap = 0; cap <= 200; ++cap) {
      const int got = splits_within_memory(per, cap, 4);
      CHECK(got >= 0 && got <= 4 && got * per <= cap, "per=%lld cap=%lld: got %d", (long long)per,
            (long long)cap, got);
      CHECK(got == 4 || (got + 1) * per > cap, "per=%lld cap=%lld: %d is not the most",
            (long long)per, (long long)cap, got);
    }
  }
  const int64_t gib = int64_t{1} << 30, mib = int64_t{1} << 20;
  CHECK(splits_within_memory(128 * mib, gib, 4) == 4, "B=4 H=16 T=4096 D=128 keeps 4 splits");
  CHECK(splits_within_memory(2 * gib, gib, 4) == 0, "T=128K H=32 D=128: the two kernels");
}

int main() {
  check_copy_layouts_for_cols<32>();
  check_copy_layouts_for_cols<64>();
  check_copy_layouts_for_cols<96>();
  check_copy_layouts_for_cols<128>();
  check_copy_layouts_for_cols<256>();
  check_ldmatrix_patterns();
  check_unmasked_key_tiles();
  check_masked_query_tiles();
  check_fused_backward_schedule();
  check_fused_backward_splits();
  check_splits_within_memory();
  std::printf("%d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
