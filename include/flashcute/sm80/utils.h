// flashcute — helpers of the sm80 kernel family: register-layout views of mma.sync
// accumulators, predicated cp.async tile copies, ldmatrix-fed GEMMs, vector atomics.
#pragma once

#include <cute/tensor.hpp>

#include "flashcute/common/utils.h"

namespace flashcute::sm80 {

using namespace cute;

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

// The same copy with rows that are not evenly strided (KV cache: GQA-packed query rows, pages):
// src0 is the partition of a tile whose rows all start at offset 0 (row stride 0), and
// row_offset(row, m) the element offset of a row, the thread's m-th (a caller may share a
// lookup between passes); rows past max_rows are zero-filled and their offsets taken for row 0,
// which is always inside the tensor.
template <bool kCheckRows, typename TiledCopy, typename TS, typename TD, typename TC, typename TP, typename RowOffset>
CUTE_DEVICE void copy_rows(TiledCopy const& tiled_copy, TS const& src0, TD&& dst, TC const& coord, TP const& col_ok,
                           int max_rows, RowOffset const& row_offset) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src0); ++m) {
    const int row = get<0>(coord(0, m, 0));
    const bool row_ok = !kCheckRows || row < max_rows;
    const int64_t offset = row_offset(row_ok ? row : 0, m);
    CUTE_UNROLL
    for (int k = 0; k < size<2>(src0); ++k) {
      copy(tiled_copy.with(row_ok && col_ok(k)), make_tensor(src0(_, m, k).data() + offset, src0(_, m, k).layout()),
           dst(_, m, k));
    }
  }
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

}  // namespace flashcute::sm80
