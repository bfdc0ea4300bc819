// flashcute — small CuTe helpers shared by the kernels: error checks, register-layout
// views of MMA accumulators, quad reductions, predicated tile copies, smem-fed GEMMs.
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <stdexcept>
#include <string>

#include "params.h"

#define FLASHCUTE_CUDA_CHECK(expr)                                                          \
  do {                                                                                     \
    const cudaError_t _err = (expr);                                                       \
    if (_err != cudaSuccess) {                                                             \
      throw std::runtime_error(std::string("flashcute: CUDA error ") + cudaGetErrorName(_err) + \
                               " (" + cudaGetErrorString(_err) + ") at " + __FILE__ + ":" +   \
                               std::to_string(__LINE__) + ": " #expr);                       \
    }                                                                                      \
  } while (0)

// Block-sparse blocks must be whole multiples of the kernel's tiles (the op checks this for the
// user; this guards every launcher).
inline void check_sparse_tiles(const flashcute::BlockSparse& sparse, int tile_m, int tile_n) {
  if (sparse.enabled() && (sparse.block_m % tile_m != 0 || sparse.block_n % tile_n != 0)) {
    throw std::invalid_argument("flashcute: block-sparse block size (" + std::to_string(sparse.block_m) + ", " +
                                std::to_string(sparse.block_n) + ") is not a multiple of the kernel tile (" +
                                std::to_string(tile_m) + ", " + std::to_string(tile_n) + ")");
  }
}

namespace flashcute {

using namespace cute;

// ---- Global tensors ---------------------------------------------------------------------
// One (batch, head) of a (batch, seqlen, heads, headdim) tensor as (seqlen, kHeadDim) with a unit
// last stride; columns past the real headdim are never read or written (see copy_tile).
template <typename Element, int kHeadDim>
CUTE_DEVICE auto head_tensor(const void* base, Strides s, int batch, int head, int seqlen) {
  auto ptr = static_cast<Element*>(const_cast<void*>(base)) + batch * s.batch + head * s.head;
  return make_tensor(make_gmem_ptr(ptr), make_shape(seqlen, Int<kHeadDim>{}), make_stride(s.row, _1{}));
}

// ---- Register-layout views of an SM80 m16n8k16 accumulator ---------------------------
// An accumulator fragment is (MMA = (2 cols, 2 rows), MMA_M, MMA_N). As (rows, cols):
//   rows = (2, MMA_M), cols = (2, MMA_N), so that row i of the view is one row of S.
template <typename Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout acc) {
  static_assert(decltype(size<0>(acc))::value == 4, "an SM80 m16n8 accumulator holds 4 values");
  auto l = logical_divide(acc, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)), make_layout(get<0, 0>(l), get<2>(l)));
}

// The same accumulator read as the A operand of the next m16n8k16 MMA (P in O += P V):
// (4, MMA_M, MMA_N) -> ((4, 2), MMA_M, MMA_N / 2), two 8-column atoms per 16-wide k step.
template <typename Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_A(Layout acc) {
  auto l = logical_divide(acc, Shape<Underscore, Underscore, _2>{});  // (4, MMA_M, (2, MMA_N / 2))
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

// Element-wise conversion of a register fragment (vectorised through CUTLASS converters).
template <typename To, typename Engine, typename Layout>
CUTE_DEVICE auto convert_fragment(Tensor<Engine, Layout> const& src) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(size(src))::value;
  cutlass::NumericArrayConverter<To, From, N> convert;
  Tensor dst = make_tensor<To>(src.layout());
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, N>*>(src.data()));
  return dst;
}

// ---- Reductions over the 4 threads (a quad) that share one row of an MMA tile ----------
struct MaxOp {
  CUTE_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  CUTE_DEVICE float operator()(float a, float b) const { return a + b; }
};
template <typename Op>
CUTE_DEVICE float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
  return x;
}

// ---- Atomics ------------------------------------------------------------------------------
// dst[0..3] += (a, b, c, d), dst 16-byte aligned: one vector reduction on sm90, four before.
CUTE_DEVICE void atomic_add4(float* dst, float a, float b, float c, float d) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  atomicAdd(reinterpret_cast<float4*>(dst), make_float4(a, b, c, d));
#else
  atomicAdd(dst, a);
  atomicAdd(dst + 1, b);
  atomicAdd(dst + 2, c);
  atomicAdd(dst + 3, d);
#endif
}

// ---- Predicated global -> shared tile copies --------------------------------------------
// src/dst are a thread's partition (CPY, CPY_M, CPY_K); coord is the same partition of an
// identity tensor; col_ok(k) says whether column chunk k lies inside headdim. The copy atom
// is a zero-filling cp.async: chunks in rows at or past max_rows (when kCheckRows) or past
// headdim are written as zeros, without a branch, so the GEMMs see exact zeros there.
template <bool kCheckRows, typename TiledCopy, typename TS, typename TD, typename TC, typename TP>
CUTE_DEVICE void copy_tile(TiledCopy const& tiled_copy, TS const& src, TD&& dst, TC const& coord,
                           TP const& col_ok, int max_rows) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    const bool row_ok = !kCheckRows || get<0>(coord(0, m, 0)) < max_rows;
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src); ++k) {
      copy(tiled_copy.with(row_ok && col_ok(k)), src(_, m, k), dst(_, m, k));
    }
  }
}

// Store to global memory: only rows < max_rows and columns inside headdim are written.
template <typename TiledCopy, typename TS, typename TD, typename TC, typename TP>
CUTE_DEVICE void store_tile(TiledCopy const& tiled_copy, TS const& src, TD&& dst, TC const& coord,
                            TP const& col_ok, int max_rows) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < max_rows) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) {
        if (col_ok(k)) copy(tiled_copy, src(_, m, k), dst(_, m, k));
      }
    }
  }
}

// A tile in shared memory to global memory with 16-byte accesses, through registers; only rows
// < max_rows and columns inside headdim are written (coord, col_ok: as for store_tile, from the
// same thread layout).
template <typename TiledCopy, typename SS, typename GG, typename TC, typename TP>
CUTE_DEVICE void store_smem_tile(TiledCopy const& tiled_copy, int tidx, SS const& s_tile, GG const& g_tile,
                                 TC const& coord, TP const& col_ok, int max_rows) {
  auto thr = tiled_copy.get_thread_slice(tidx);
  Tensor tS = thr.partition_S(s_tile);
  Tensor tG = thr.partition_D(g_tile);
  Tensor tR = make_tensor<typename decltype(tG)::value_type>(shape(tG));
  copy(tiled_copy, tS, tR);
  store_tile(tiled_copy, tR, tG, coord, col_ok, max_rows);
}

// ---- GEMMs fed from shared memory through ldmatrix ---------------------------------------
// acc += A B^T with A and B in shared memory; the k-slices are loaded one step ahead of
// the MMAs that use them.
template <typename TiledMma, typename Acc, typename RA, typename RB, typename SA, typename SB,
          typename CopyA, typename CopyB, typename ThrCopyA, typename ThrCopyB>
CUTE_DEVICE void gemm_ss(TiledMma& mma, Acc& acc, RA& rA, RB& rB, SA const& sA, SB const& sB,
                         CopyA const& copy_a, CopyB const& copy_b, ThrCopyA const& thr_a,
                         ThrCopyB const& thr_b) {
  auto rA_view = thr_a.retile_D(rA);
  auto rB_view = thr_b.retile_D(rB);
  copy(copy_a, sA(_, _, 0), rA_view(_, _, 0));
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) {
      copy(copy_a, sA(_, _, k + 1), rA_view(_, _, k + 1));
      copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    }
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

// acc += A B^T with A already in registers (P) and B in shared memory.
template <typename TiledMma, typename Acc, typename RA, typename RB, typename SB, typename CopyB,
          typename ThrCopyB>
CUTE_DEVICE void gemm_rs(TiledMma& mma, Acc& acc, RA const& rA, RB& rB, SB const& sB, CopyB const& copy_b,
                         ThrCopyB const& thr_b) {
  auto rB_view = thr_b.retile_D(rB);
  copy(copy_b, sB(_, _, 0), rB_view(_, _, 0));
  CUTE_UNROLL
  for (int k = 0; k < size<2>(rA); ++k) {
    if (k + 1 < size<2>(rA)) copy(copy_b, sB(_, _, k + 1), rB_view(_, _, k + 1));
    cute::gemm(mma, rA(_, _, k), rB(_, _, k), acc);
  }
}

}  // namespace flashcute
