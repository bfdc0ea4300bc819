// flashcute — which keys a query row sees, as integer rules shared by the CUDA mask policy
// (common/mask.h) and the CPU backend (src/cpu), so the two can never disagree.
//
// Bottom-right aligned (SPEC score pipeline, step 4): query row i of a sequence with seqlen_q
// rows and seqlen_k keys sits at key position p_i = i + seqlen_k - seqlen_q and sees the keys j
// with p_i - L <= j <= p_i + R and 0 <= j < seqlen_k; L = window_left, R = window_right, -1
// meaning unbounded on that side; causal is R = 0. No CuTe and no std:: here: the CPU-only
// build includes this file.
#pragma once

#include "flashcute/params.h"

namespace flashcute {

struct MaskRules {
  int seqlen_q = 0;
  int seqlen_k = 0;
  int window_left = -1;   // L: -1 unbounded
  int window_right = -1;  // R: -1 unbounded; causal is 0

  FLASHCUTE_HOST_DEVICE static int imin(int a, int b) { return a < b ? a : b; }
  FLASHCUTE_HOST_DEVICE static int imax(int a, int b) { return a > b ? a : b; }

  // p_i: the key position of query row i.
  FLASHCUTE_HOST_DEVICE int diag(int row) const { return row + seqlen_k - seqlen_q; }

  // Row i sees the keys [col_begin(i), col_end(i)) (empty when col_end <= col_begin).
  FLASHCUTE_HOST_DEVICE int col_begin(int row) const {
    return window_left < 0 ? 0 : imax(diag(row) - window_left, 0);
  }
  FLASHCUTE_HOST_DEVICE int col_end(int row) const {
    return window_right < 0 ? seqlen_k : imax(imin(diag(row) + window_right + 1, seqlen_k), 0);
  }

  // The rows that see key j: [row_begin(j), row_end(j)) among [0, seqlen_q) (the backward's
  // ranges: j >= p_i - L and j <= p_i + R solved for i).
  FLASHCUTE_HOST_DEVICE int row_begin(int col) const {
    return window_right < 0 ? 0 : imin(imax(col - window_right - (seqlen_k - seqlen_q), 0), seqlen_q);
  }
  FLASHCUTE_HOST_DEVICE int row_end(int col) const {
    return window_left < 0 ? seqlen_q : imax(imin(col + window_left - (seqlen_k - seqlen_q) + 1, seqlen_q), 0);
  }
};

}  // namespace flashcute
