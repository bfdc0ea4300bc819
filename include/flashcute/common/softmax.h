// flashcute — the online softmax of FlashAttention-2, in base 2 (both kernel families).
//
// Scores stay unscaled in the MMA accumulators (raw q.k, or the "softmax units" of a score
// modification, common/score_mod.h); exp(scale * s - m) is computed as
// exp2(s * scale_log2 - m * scale_log2), one FFMA and one EX2 per score. The output
// accumulator is rescaled when a row's max grows and normalised once at the end; only
// the log-sum-exp L = m + log(l) is kept. The backward recomputes P from L and takes the
// softmax's gradient (the two functions at the end).
#pragma once

#include <cute/tensor.hpp>

#include "flashcute/common/dropout.h"
#include "flashcute/common/utils.h"

namespace flashcute {

using namespace cute;

// op over row i of s (rows, cols) in kChains interleaved chains, combined at the end.
template <int kChains, typename TensorS, typename Op>
CUTE_DEVICE float row_reduce(TensorS const& s, int i, Op op) {
  constexpr int kCols = decltype(size<1>(s))::value;
  static_assert(kCols % kChains == 0 && (kChains & (kChains - 1)) == 0, "a power of two dividing the columns");
  float part[kChains];
  CUTE_UNROLL
  for (int c = 0; c < kChains; ++c) part[c] = s(i, c);
  CUTE_UNROLL
  for (int j = kChains; j < kCols; ++j) part[j % kChains] = op(part[j % kChains], s(i, j));
  CUTE_UNROLL
  for (int width = kChains / 2; width > 0; width /= 2) {
    CUTE_UNROLL
    for (int c = 0; c < width; ++c) part[c] = op(part[c], part[c + width]);
  }
  return part[0];
}

// kMaxChains: the row max in that many interleaved chains of FMNMX (1: one chain, which nvcc
// does not reassociate, each FMNMX waiting on the one before); kSumChains: the row sum of P in that
// many interleaved chains of FADD. A kernel family picks them per tile (sm90/mainloop_fwd.h).
template <int kRows, int kMaxChains = 1, int kSumChains = 1>
struct OnlineSoftmax {
  float row_max[kRows];  // running max of the raw scores of each of this thread's rows
  float row_sum[kRows];  // running sum of exp2, this thread's columns only (reduced at the end)

  CUTE_DEVICE OnlineSoftmax() {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      row_max[i] = -INFINITY;
      row_sum[i] = 0.f;
    }
  }

  // One step of Algorithm 1 on a block of scores s (rows, cols): new max m, rescale of l
  // and O by exp2(m_old - m), s replaced by P = exp2(s - m), l += rowsum(P).
  template <bool kFirst, typename TensorS, typename TensorO>
  CUTE_DEVICE void step(TensorS& s, TensorO& o, float scale_log2) {
    float rescale[kRows];
    new_max<kFirst>(s, scale_log2, rescale);
    if (!kFirst) rescale_o(o, rescale);  // before the exponentials: rescale[] dies here
    exponentiate(s, scale_log2);
  }

  // The same step without touching O (a pipelined loop rescales O once the GEMM that is still
  // adding into it has finished): rescale[i] = exp2(m_old - m) of row i.
  template <bool kFirst, typename TensorS>
  CUTE_DEVICE void update(TensorS& s, float scale_log2, float (&rescale)[kRows]) {
    new_max<kFirst>(s, scale_log2, rescale);
    exponentiate(s, scale_log2);
  }

  // m = max(m, rowmax s); rescale[i] = exp2(m_old - m); l *= rescale.
  template <bool kFirst, typename TensorS>
  CUTE_DEVICE void new_max(TensorS const& s, float scale_log2, float (&rescale)[kRows]) {
    static_assert(decltype(size<0>(s))::value == kRows);
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      float m = row_max[i];
      if constexpr (kMaxChains == 1) {
        CUTE_UNROLL
        for (int j = 0; j < size<1>(s); ++j) m = fmaxf(m, s(i, j));
      } else {
        m = fmaxf(m, row_reduce<kMaxChains>(s, i, MaxOp{}));
      }
      m = quad_allreduce(m, MaxOp{});  // the 4 threads of a quad hold one row
      rescale[i] = 1.f;
      if (!kFirst) {
        // A row with every score masked so far keeps m = -inf; use 0 so exp2 gives 0, not NaN.
        rescale[i] = exp2f(row_max[i] * scale_log2 - (m == -INFINITY ? 0.f : m * scale_log2));
        row_sum[i] *= rescale[i];
      }
      row_max[i] = m;
    }
  }

  // s replaced by P = exp2(s - m); l += rowsum(P) (this thread's columns).
  template <typename TensorS>
  CUTE_DEVICE void exponentiate(TensorS& s, float scale_log2) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float m_scaled = row_max[i] == -INFINITY ? 0.f : row_max[i] * scale_log2;
      float l[kSumChains] = {};
      CUTE_UNROLL
      for (int j = 0; j < size<1>(s); ++j) {
        s(i, j) = exp2f(s(i, j) * scale_log2 - m_scaled);
        l[j % kSumChains] += s(i, j);
      }
      CUTE_UNROLL
      for (int c = 1; c < kSumChains; ++c) l[0] += l[c];
      row_sum[i] += l[0];
    }
  }

  template <typename TensorO>
  CUTE_DEVICE void rescale_o(TensorO& o, const float (&rescale)[kRows]) const {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      CUTE_UNROLL
      for (int j = 0; j < size<1>(o); ++j) o(i, j) *= rescale[i];
    }
  }

  // End of Algorithm 1: O *= o_scale / l, and L = m * scale + log(l) (natural log); o_scale:
  // dropout's 1 / (1 - p). Rows that saw no key have l = 0: O stays 0 and L = -inf.
  template <typename TensorO>
  CUTE_DEVICE void finalize(TensorO& o, float scale, float (&lse)[kRows], float o_scale = 1.f) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const float l = quad_allreduce(row_sum[i], SumOp{});
      const bool empty = l == 0.f || l != l;
      const float inv = empty ? 1.f : o_scale / l;
      lse[i] = empty ? -INFINITY : row_max[i] * scale + __logf(l);
      CUTE_UNROLL
      for (int j = 0; j < size<1>(o); ++j) o(i, j) *= inv;
    }
  }
};

// ---- The backward's softmax, per step (both families' main loops) ----------------------------
// s: the (modified, masked) scores of a tile as (rows, cols) -> P = exp2(s * scale_log2 - L2),
// in place; lse_log2[i]: L2 = L * log2(e) of row i of the view (an array, or anything indexed
// so: the sm90 backward's swapped tiles read their many rows' statistics from shared memory).
template <typename TensorS, typename RowStat>
CUTE_DEVICE void recompute_p(TensorS& s, RowStat const& lse_log2, float scale_log2) {
  CUTE_UNROLL
  for (int i = 0; i < size<0>(s); ++i) {
    const float l = lse_log2[i];
    CUTE_UNROLL
    for (int j = 0; j < size<1>(s); ++j) s(i, j) = exp2f(s(i, j) * scale_log2 - l);
  }
}

// dp: dP as (rows, cols) -> dS = P * (dP - D), in place; dsum[i]: D of row i. kDropout: P carries
// the sign DropoutMap::apply_signed or mark_dropped gave the dropped scores, and
// dS = |P| * (keep dP - D) (D was scaled by 1 - p in the preprocess; without dropout P >= 0 and
// the values are the same).
template <bool kDropout, typename TensorDP, typename TensorP, typename RowStat>
CUTE_DEVICE void softmax_grad(TensorDP& dp, TensorP const& p, RowStat const& dsum) {
  CUTE_UNROLL
  for (int i = 0; i < size<0>(dp); ++i) {
    const float d = dsum[i];
    CUTE_UNROLL
    for (int j = 0; j < size<1>(dp); ++j) {
      if constexpr (kDropout) {
        dp(i, j) = fabsf(p(i, j)) * (DropoutMap::sign_keep(p(i, j), dp(i, j)) - d);
      } else {
        dp(i, j) = p(i, j) * (dp(i, j) - d);
      }
    }
  }
}

}  // namespace flashcute
