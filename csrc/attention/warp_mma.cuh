// Warp-level building blocks of the attention kernels (sm_80 and later): cp.async copies into
// shared memory, ldmatrix loads, mma.sync m16n8k16 on fp16/bf16 with fp32 accumulation, and
// the warp GEMMs built from them.
//
// Fragment layouts of mma.m16n8k16 (PTX ISA), lane = 4 * g + t:
//   A (16x16, row major), 4 regs of 2 elements: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..),
//     a3 (g+8, 2t+8..);  B (16x8, "col": k contiguous per n), 2 regs: b0 (k 2t.., n g),
//     b1 (k 2t+8.., n g);  C (16x8 fp32), 4 floats: c0,c1 (g, 2t..2t+1), c2,c3 (g+8, 2t..).
// Two adjacent C tiles (16 x 16) hold exactly an A fragment's elements, which is how the
// probabilities P go from the first GEMM's accumulators to the second GEMM's A operand
// without shared memory.
//
// Shared-memory tiles are row-major with rows padded by 8 elements (16 bytes): the 8 row
// addresses of one ldmatrix then fall into 8 different bank groups for every head dim we
// instantiate (row pitch / 16 B = D/8 + 1 is odd), so loads are conflict-free without swizzle.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "attention/tiling.h"
#include "common/fast_math.cuh"

namespace fusedattn {
namespace attn {

constexpr int kWarpSize = 32;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte global -> shared copy to a shared-space address; src_bytes = 0 reads nothing and
// writes zeros (rows/columns out of range), so `src` may then point anywhere.
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// ldmatrix on shared-space addresses: the kernels compute a lane's address once and pass
// base + a compile-time offset, which ptxas folds into the instruction's immediate.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// A lane's byte offset into a padded row-major tile for an ldmatrix.x4 (see tiling.h).
template <typename T, int kPitch, bool kFragA>
__device__ __forceinline__ uint32_t ldmatrix_lane_offset(int lane) {
  return static_cast<uint32_t>((ldmatrix_row<kFragA>(lane) * kPitch + ldmatrix_col<kFragA>(lane)) *
                               sizeof(T));
}

template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1);
template <>
__device__ __forceinline__ void mma_16816<__half>(float (&d)[4], const uint32_t (&a)[4],
                                                  uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_16816<__nv_bfloat16>(float (&d)[4], const uint32_t (&a)[4],
                                                         uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats -> one register of two 16-bit elements (the lower column in the low half).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__half>(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// Reductions over the 4 lanes (one quad) that share a row of a C fragment.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Copies kRows x kCols tiles of a row-major global tensor into padded shared memory with
// cp.async, 16 bytes per thread and step; rows >= row_end and columns >= col_end (a multiple
// of 8) are zero-filled. What depends on the thread alone (its row and column in the tile, its
// shared-memory offset, its global pointer, whether its column is in range) is derived from
// threadIdx at construction: loop-invariant, so ptxas keeps it or recomputes it as registers
// allow (the kernels build one per copy: keeping the K and V copies' state live across the
// forward's key loop cost ~10 registers and spills at head dim 128, and 72 B of spills in the
// head-dim-256 dQ kernel). A tile costs one 64-bit offset, and per step a 64-bit add and a
// shared offset folded into the instruction; rows are checked only for a tile that crosses
// row_end (kCheckRows). Before this, every 16-byte chunk of every tile recomputed a 64-bit
// address and a row-and-column predicate (issue #13).
//
// The thread-to-chunk layout is CopyLayout's (tiling.h).
template <typename Copy>
__device__ __noinline__ void load_skipping_rows(const Copy& copy, uint32_t tile, int row0,
                                                int row_end, const uint8_t* skip);

template <int kRows, int kCols, int kThreads, typename T>
struct TileCopy {
  using Layout = CopyLayout<kRows, kCols, kThreads>;
  static constexpr int kChunksPerRow = Layout::kChunksPerRow;
  static constexpr int kPitch = Layout::kPitch;
  static constexpr bool kFixedColumn = Layout::kFixedColumn;
  static constexpr int kRowsPerStep = Layout::kRowsPerStep;
  static constexpr int kSteps = Layout::kSteps;

  const T* gmem;  // kFixedColumn: row 0 of the tensor at this thread's column; else row 0
  int64_t row_stride;
  uint32_t smem_offset;  // bytes from the tile's start to this thread's first chunk
  int row;               // this thread's row in the tile at step 0
  int src_bytes;         // kFixedColumn: 16, or 0 where this thread's column is past col_end;
                         // otherwise col_end itself

  __device__ __forceinline__ TileCopy(const T* gmem_, int64_t row_stride_, int col_end)
      : row_stride(row_stride_) {
    const int col = Layout::col(threadIdx.x);
    row = Layout::row(threadIdx.x);
    gmem = kFixedColumn ? gmem_ + col : gmem_;
    smem_offset = static_cast<uint32_t>((row * kPitch + col) * sizeof(T));
    src_bytes = kFixedColumn ? (col < col_end ? 16 : 0) : col_end;
  }

  // Rows [row0, row0 + kRows) into the tile at shared address `tile`. kSkipRows: a row r whose
  // byte skip[r] is nonzero is zero-filled too (key padding: see load() with `skip` below).
  template <bool kCheckRows, bool kSkipRows = false>
  __device__ __forceinline__ void load(uint32_t tile, int row0, int row_end,
                                       const uint8_t* skip = nullptr) const {
    if constexpr (kFixedColumn) {
      const T* src = gmem + static_cast<int64_t>(row0 + row) * row_stride;
      const uint32_t dst = tile + smem_offset;
#pragma unroll
      for (int s = 0; s < kSteps; ++s) {
        const int r = row0 + row + s * kRowsPerStep;
        bool in_rows = !kCheckRows || r < row_end;
        if constexpr (kSkipRows) in_rows = in_rows && !skip[r];
        cp_async_16(dst + s * kRowsPerStep * kPitch * sizeof(T), src, in_rows ? src_bytes : 0);
        src += row_stride * kRowsPerStep;
      }
    } else {
      const int col_end = src_bytes;
#pragma unroll
      for (int c = threadIdx.x; c < kRows * kChunksPerRow; c += kThreads) {
        const int r = c / kChunksPerRow;
        const int col = (c % kChunksPerRow) * 8;
        bool valid = (!kCheckRows || row0 + r < row_end) && col < col_end;
        if constexpr (kSkipRows) valid = valid && !skip[row0 + r];
        const T* src = gmem + static_cast<int64_t>(row0 + r) * row_stride + col;
        cp_async_16(tile + (r * kPitch + col) * sizeof(T), valid ? src : gmem, valid ? 16 : 0);
      }
    }
  }
  // Checks rows only for a tile that crosses row_end (one uniform branch).
  __device__ __forceinline__ void load(uint32_t tile, int row0, int row_end) const {
    if (row0 + kRows <= row_end) {
      load<false>(tile, row0, row_end);
    } else {
      load<true>(tile, row0, row_end);
    }
  }
  // K and V tiles under key padding: rows whose key is padding (skip[r] nonzero; skip = the
  // batch's key_padding_mask row, nullptr for none) are zero-filled, not copied. The scores
  // mask those keys (P = 0), but P = 0 times a NaN or inf stored at a padded position is NaN
  // in the MMA: zero rows keep the output and every gradient what they are with finite
  // padding. One byte load per row and step, only for calls with key padding.
  __device__ __forceinline__ void load(uint32_t tile, int row0, int row_end,
                                       const uint8_t* skip) const {
    if (skip == nullptr) {
      load(tile, row0, row_end);
    } else {
      load<true, true>(tile, row0, row_end, skip);
    }
  }
  // The same with the skipping copy out of line (load_skipping_rows), for the key loops of the
  // forward and dQ kernels: inlined into the forward's masked loop it changed the register
  // allocation of its unmasked loop too (sm_90a, D=128: 926 -> 955 SASS instructions per
  // iteration; 926 as a call). Loads outside the hot loops (dK/dV, fused backward) inline it:
  // there the call cost the fused kernel's query loop 46 instructions.
  __device__ __forceinline__ void load_in_loop(uint32_t tile, int row0, int row_end,
                                               const uint8_t* skip) const {
    if (skip == nullptr) {
      load(tile, row0, row_end);
    } else {
      load_skipping_rows(*this, tile, row0, row_end, skip);
    }
  }
};

// TileCopy::load with `skip`, out of line (see load_in_loop).
template <typename Copy>
__device__ __noinline__ void load_skipping_rows(const Copy& copy, uint32_t tile, int row0,
                                                int row_end, const uint8_t* skip) {
  copy.template load<true, true>(tile, row0, row_end, skip);
}

// acc[mt][nt] += A[rows of m-tile mt] * B^T[cols of n-tile nt] over kK: A (16*kMTiles x kK)
// and B (8*kNTiles x kK) both row-major in padded shared memory (S = Q K^T, dP = dO V^T).
// a, b: the tiles' shared addresses plus ldmatrix_lane_offset<.., true> (a) and <.., false> (b).
template <typename T, int kMTiles, int kNTiles, int kK, int kPitch>
__device__ __forceinline__ void gemm_smem_nt(float (&acc)[kMTiles][kNTiles][4], uint32_t a,
                                             uint32_t b) {
  static_assert(kNTiles % 2 == 0 && kK % 16 == 0, "tiles come in pairs of 8 columns");
  constexpr int kElem = sizeof(T);
#pragma unroll
  for (int ks = 0; ks < kK / 16; ++ks) {
    uint32_t af[kMTiles][4];
#pragma unroll
    for (int mt = 0; mt < kMTiles; ++mt) {
      ldmatrix_x4(af[mt], a + (mt * 16 * kPitch + ks * 16) * kElem);
    }
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t bf[4];
      ldmatrix_x4(bf, b + (nt * 8 * kPitch + ks * 16) * kElem);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16816<T>(acc[mt][nt], af[mt], bf[0], bf[1]);
        mma_16816<T>(acc[mt][nt + 1], af[mt], bf[2], bf[3]);
      }
    }
  }
}

// acc[mt][nt] += A * B with A in registers (A fragments over kKSteps steps of 16) and B
// (16*kKSteps x 8*kNTiles) row-major in padded shared memory: O += P V, dQ += dS K, ...
// b: the tile's shared address plus ldmatrix_lane_offset<.., true>.
template <typename T, int kMTiles, int kKSteps, int kNTiles, int kPitch>
__device__ __forceinline__ void gemm_regs_smem(float (&acc)[kMTiles][kNTiles][4],
                                               const uint32_t (&a)[kMTiles][kKSteps][4],
                                               uint32_t b) {
  static_assert(kNTiles % 2 == 0, "tiles come in pairs of 8 columns");
  constexpr int kElem = sizeof(T);
#pragma unroll
  for (int ks = 0; ks < kKSteps; ++ks) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; nt += 2) {
      uint32_t bf[4];
      ldmatrix_x4_trans(bf, b + (ks * 16 * kPitch + nt * 8) * kElem);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        mma_16816<T>(acc[mt][nt], a[mt][ks], bf[0], bf[1]);
        mma_16816<T>(acc[mt][nt + 1], a[mt][ks], bf[2], bf[3]);
      }
    }
  }
}

// C fragments (fp32, 16 x 8*kNTiles per m-tile) -> A fragments of T over kNTiles/2 k-steps.
template <typename T, int kMTiles, int kNTiles>
__device__ __forceinline__ void to_a_fragments(uint32_t (&a)[kMTiles][kNTiles / 2][4],
                                               const float (&c)[kMTiles][kNTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int ks = 0; ks < kNTiles / 2; ++ks) {
      a[mt][ks][0] = pack2<T>(c[mt][2 * ks][0], c[mt][2 * ks][1]);
      a[mt][ks][1] = pack2<T>(c[mt][2 * ks][2], c[mt][2 * ks][3]);
      a[mt][ks][2] = pack2<T>(c[mt][2 * ks + 1][0], c[mt][2 * ks + 1][1]);
      a[mt][ks][3] = pack2<T>(c[mt][2 * ks + 1][2], c[mt][2 * ks + 1][3]);
    }
  }
}

template <int kMTiles, int kNTiles>
__device__ __forceinline__ void zero(float (&acc)[kMTiles][kNTiles][4]) {
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[mt][nt][i] = 0.f;
}

// Write a warp's C fragments (times `scale`) as T into its padded shared rows, then copy rows
// [row0, row_end) x columns [0, col_end) to global memory 16 bytes at a time. The shared rows
// must belong to this warp alone (no block barrier is taken).
template <typename T, int kMTiles, int kNTiles, int kPitch>
__device__ __forceinline__ void store_warp_rows(const float (&acc)[kMTiles][kNTiles][4],
                                                float scale, T* sRows, T* gmem, int64_t row_stride,
                                                int row0, int row_end, int col_end, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
    for (int nt = 0; nt < kNTiles; ++nt) {
      T* p = sRows + (mt * 16 + g) * kPitch + nt * 8 + 2 * t;
      *reinterpret_cast<uint32_t*>(p) = pack2<T>(acc[mt][nt][0] * scale, acc[mt][nt][1] * scale);
      *reinterpret_cast<uint32_t*>(p + 8 * kPitch) =
          pack2<T>(acc[mt][nt][2] * scale, acc[mt][nt][3] * scale);
    }
  }
  __syncwarp();
  constexpr int kChunksPerRow = kNTiles;  // 8 elements each
#pragma unroll
  for (int c = lane; c < kMTiles * 16 * kChunksPerRow; c += kWarpSize) {
    const int r = c / kChunksPerRow;
    const int col = (c % kChunksPerRow) * 8;
    if (row0 + r < row_end && col < col_end) {
      *reinterpret_cast<uint4*>(gmem + static_cast<int64_t>(row0 + r) * row_stride + col) =
          *reinterpret_cast<const uint4*>(sRows + r * kPitch + col);
    }
  }
}

}  // namespace attn
}  // namespace fusedattn
