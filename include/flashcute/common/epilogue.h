// flashcute — the part of the forward epilogue both kernel families share: storing L; merging
// partial results over disjoint key sets (split-KV's combine and cluster merge, decoding's tile).
#pragma once

#include <cute/tensor.hpp>

#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/params.h"

namespace flashcute {

using namespace cute;

// L of this thread's rows (lse[i] for row i of the rowcol coordinate view cO of the O tile):
// the thread holding a row's column 0 writes it, for the rows inside the sequence.
template <int kBlockM, int kRows, typename TensorC>
CUTE_DEVICE void store_lse(const FwdParams& p, const FwdTile& tile, const SeqlenInfo& seqlen, TensorC const& cO,
                           const float (&lse)[kRows]) {
  if (get<1>(cO(0, 0)) != 0) return;
  const int rows_left = seqlen.q - tile.m_block * kBlockM;
  float* lse_row0 = p.lse + seqlen.lse_offset(p, tile.bidb, tile.bidh) + tile.m_block * kBlockM;
  CUTE_UNROLL
  for (int i = 0; i < kRows; ++i) {
    const int row = get<0>(cO(i, 0));
    if (row < rows_left) lse_row0[row] = lse[i];
  }
}

// ---- Merging partials: (O_s, L_s) of disjoint key sets s -> L = log sum_s exp(L_s),
// O = sum_s exp(L_s - L) O_s. A partial that saw no key has L_s = -inf and weighs 0; none: L = -inf.
// L from the partials' max m and sum_s exp(L_s - m).
CUTE_DEVICE float merged_lse(float m, float sum) { return sum > 0.f ? m + logf(sum) : -INFINITY; }
// exp(L_s - L) (also the terms of the sum above, with L = m).
CUTE_DEVICE float partial_weight(float lse_s, float lse) { return lse == -INFINITY ? 0.f : expf(lse_s - lse); }
// acc += w o, skipping w = 0 (a partial that saw no key: its O is never read into the sum).
CUTE_DEVICE void add_weighted(float4& acc, float w, const float4& o) {
  if (w != 0.f) {
    acc.x += w * o.x;
    acc.y += w * o.y;
    acc.z += w * o.z;
    acc.w += w * o.w;
  }
}

// ---- Partials of the same rows over disjoint keys, staged in shared memory (decoding's tile:
// each warp's O and L over its own keys; both families' decoding epilogues). o_s: (part, row,
// col) floats, kHeadDim columns; lse_s: (part, row).
// A part's (O, L) from registers: o_rc / cO the rowcol views of its m16n8 accumulator and of the
// accumulator's coordinates (adjacent column pairs), lse[i] the L of the view's row i.
template <int kRows, int kHeadDim, typename TensorO, typename TensorC, int kN>
CUTE_DEVICE void stage_partial(TensorO const& o_rc, TensorC const& cO, const float (&lse)[kN], int part, float* o_s,
                               float* lse_s) {
  CUTE_UNROLL
  for (int i = 0; i < size<0>(o_rc); ++i) {
    const int r = get<0>(cO(i, 0));
    if (get<1>(cO(i, 0)) == 0) lse_s[part * kRows + r] = lse[i];
    CUTE_UNROLL
    for (int j = 0; j < size<1>(o_rc); j += 2) {
      *reinterpret_cast<float2*>(o_s + (part * kRows + r) * kHeadDim + get<1>(cO(i, j))) =
          make_float2(o_rc(i, j), o_rc(i, j + 1));
    }
  }
}
// The merge of kParts staged partials by kThreads threads: thread t takes row t / kThreadsPerRow
// and kCols adjacent columns from c0; a row at or past rows_left stops once its L is known. Then
// store(r, L, first, c0, o): o[k] the merged float4 columns c0 + 4 k, first whether the thread is
// its row's first (which stores L).
template <int kParts, int kRows, int kHeadDim, int kThreads, typename Store>
CUTE_DEVICE void merge_staged_partials(int tidx, const float* o_s, const float* lse_s, int rows_left, Store&& store) {
  constexpr int kThreadsPerRow = kThreads / kRows < kHeadDim / 4 ? kThreads / kRows : kHeadDim / 4;
  constexpr int kCols = kHeadDim / kThreadsPerRow;
  static_assert(kCols % 4 == 0, "float4 columns");
  if (tidx >= kRows * kThreadsPerRow) return;
  const int r = tidx / kThreadsPerRow, c0 = tidx % kThreadsPerRow * kCols;
  float lse_w[kParts];
  float m = -INFINITY;
  CUTE_UNROLL
  for (int w = 0; w < kParts; ++w) {
    lse_w[w] = lse_s[w * kRows + r];
    m = fmaxf(m, lse_w[w]);
  }
  float sum = 0.f;
  CUTE_UNROLL
  for (int w = 0; w < kParts; ++w) sum += partial_weight(lse_w[w], m);
  const float row_lse = merged_lse(m, sum);
  if (r >= rows_left) return;
  float4 o[kCols / 4];
  CUTE_UNROLL
  for (int k = 0; k < kCols / 4; ++k) {
    o[k] = make_float4(0.f, 0.f, 0.f, 0.f);
    CUTE_UNROLL
    for (int w = 0; w < kParts; ++w) {
      add_weighted(o[k], partial_weight(lse_w[w], row_lse),
                   *reinterpret_cast<const float4*>(o_s + (w * kRows + r) * kHeadDim + c0 + 4 * k));
    }
  }
  store(r, row_lse, tidx % kThreadsPerRow == 0, c0, o);
}

}  // namespace flashcute
