// flashcute — the part of the forward epilogue both kernel families share: storing L.
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

}  // namespace flashcute
