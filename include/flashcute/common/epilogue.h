// flashcute — the part of the forward epilogue both kernel families share: storing L; merging
// partial results over disjoint key sets (split-KV's combine, decoding's tile).
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

}  // namespace flashcute
