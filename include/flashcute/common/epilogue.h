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
// accumulator's coordinates (adjacent column pairs), lse[i] the L of the view's row i; only the
// rows below `rows` (the sm90 decoding kernel's rows inside the sequence, 4 of 16 at GQA 32/8: H200,
// b 1, 8k / 32k 12.9 / 36.5 -> 12.6 / 36.2 us, session 51).
template <int kRows, int kHeadDim, typename TensorO, typename TensorC, int kN>
CUTE_DEVICE void stage_partial(TensorO const& o_rc, TensorC const& cO, const float (&lse)[kN], int part, float* o_s,
                               float* lse_s, int rows = kRows) {
  CUTE_UNROLL
  for (int i = 0; i < size<0>(o_rc); ++i) {
    const int r = get<0>(cO(i, 0));
    if (r >= rows) continue;
    if (get<1>(cO(i, 0)) == 0) lse_s[part * kRows + r] = lse[i];
    CUTE_UNROLL
    for (int j = 0; j < size<1>(o_rc); j += 2) {
      *reinterpret_cast<float2*>(o_s + (part * kRows + r) * kHeadDim + get<1>(cO(i, j))) =
          make_float2(o_rc(i, j), o_rc(i, j + 1));
    }
  }
}
// The merge of `parts` (at most kMaxParts) staged partials, part w's row r at row w * part_rows + r
// of o_s and lse_s, by kThreads threads a float4 at a time: unit u is row u / (kHeadDim / 4),
// columns c .. c + 3 from c = 4 (u % (kHeadDim / 4)), for the rows below `rows` and the columns
// below `cols` (the real head dim). Each unit is store(r, L, c, o): o the merged columns, L the
// row's (stored by its unit of c = 0). A unit per thread, rather than each row's columns spread
// over a fixed number of threads, puts every thread on the few rows of a decoding step (the sm90
// decoding kernel, H200, b 1, GQA 32/8, 8k / 32k: 13.2 / 36.8 -> 12.9 / 36.5 us; with 16 threads
// per row of the cluster merge, two float4 each, 14.0 / 37.7; session 51).
template <int kMaxParts, int kHeadDim, int kThreads, typename Store>
CUTE_DEVICE void merge_staged_partials(int tidx, const float* o_s, const float* lse_s, int parts, int part_rows,
                                       int rows, int cols, Store&& store) {
  constexpr int kUnits = kHeadDim / 4;  // float4 columns
  for (int u = tidx; u < rows * kUnits; u += kThreads) {
    const int r = u / kUnits, c = u % kUnits * 4;
    if (c >= cols) continue;
    float lse_w[kMaxParts];
    float m = -INFINITY;
    CUTE_UNROLL
    for (int w = 0; w < kMaxParts; ++w) {
      lse_w[w] = w < parts ? lse_s[w * part_rows + r] : -INFINITY;
      m = fmaxf(m, lse_w[w]);
    }
    float sum = 0.f;
    CUTE_UNROLL
    for (int w = 0; w < kMaxParts; ++w) sum += partial_weight(lse_w[w], m);
    const float row_lse = merged_lse(m, sum);
    float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
    CUTE_UNROLL
    for (int w = 0; w < kMaxParts; ++w) {
      const float weight = partial_weight(lse_w[w], row_lse);  // (0 for w >= parts: never read)
      if (weight != 0.f) {
        add_weighted(o, weight, *reinterpret_cast<const float4*>(o_s + (w * part_rows + r) * kHeadDim + c));
      }
    }
    store(r, row_lse, c, o);
  }
}

}  // namespace flashcute
