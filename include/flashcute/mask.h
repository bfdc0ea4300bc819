// flashcute — mask policies of the main loops.
//
// A policy answers two questions for a query block: which key blocks to visit, and
// which scores inside a visited block are -inf. The main loop is written once; dense,
// causal (and later block-sparse) attention differ only in the policy.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

namespace flashcute {

using namespace cute;

// Dense attention, optionally causal (bottom-right aligned: key j is masked for query i
// when j > i + seqlen_k - seqlen_q). Key columns past seqlen_k are always masked.
template <bool kCausal_>
struct DenseMask {
  static constexpr bool kCausal = kCausal_;
  int seqlen_q;
  int seqlen_k;

  // Key blocks [0, n_block_end) hold every key some row of query block m_block sees.
  CUTE_DEVICE int n_block_end(int m_block, int block_m, int block_n) const {
    int n_end = ceil_div(seqlen_k, block_n);
    if (kCausal) {
      const int last_key = (m_block + 1) * block_m - 1 + seqlen_k - seqlen_q;  // of the block's last row
      n_end = min(n_end, ceil_div(last_key + 1, block_n));
    }
    return max(n_end, 0);
  }

  // Backward: query blocks [m_block_begin, ceil(seqlen_q / block_m)) hold every row that sees
  // some key of key block n_block.
  CUTE_DEVICE int m_block_begin(int n_block, int block_m, int block_n) const {
    if (!kCausal) return 0;
    const int first_row = n_block * block_n - (seqlen_k - seqlen_q);  // first row that sees key n_block * block_n
    return max(first_row, 0) / block_m;
  }

  // Can a key block other than the last one hold masked scores? (Not without causal: then
  // only the partial block at seqlen_k, which the forward visits first.)
  static constexpr bool kMasksBeyondLastBlock = kCausal;

  // Does tile (m_block, n_block) hold a masked score? Only such tiles run apply().
  CUTE_DEVICE bool needs_mask(int m_block, int n_block, int block_m, int block_n) const {
    if ((n_block + 1) * block_n > seqlen_k) return true;  // the partial block at seqlen_k
    if (!kCausal) return false;
    // Masked somewhere iff the block's first row misses the block's last key.
    return m_block * block_m + seqlen_k - seqlen_q < (n_block + 1) * block_n - 1;
  }

  // s: scores as (rows, cols); coord: the (row, col) of each score inside the tile, whose
  // top-left element is query row0, key col0.
  template <typename TensorS, typename TensorC>
  CUTE_DEVICE void apply(TensorS& s, TensorC const& coord, int row0, int col0) const {
    CUTE_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      const int row = row0 + get<0>(coord(i, 0));
      const int col_limit = kCausal ? min(seqlen_k, row + 1 + seqlen_k - seqlen_q) : seqlen_k;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(s); ++j) {
        if (col0 + get<1>(coord(i, j)) >= col_limit) s(i, j) = -INFINITY;
      }
    }
  }
};

}  // namespace flashcute
