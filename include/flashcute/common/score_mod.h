// flashcute — score modifications (SPEC score pipeline, steps 2 and 3), applied by both kernel
// families to every tile's scores before the mask, and their backward.
//
// The kernels' accumulators hold raw q.k. Without a modification they stay raw, and the softmax
// multiplies by scale (params.softmax_scale_log2 = scale log2 e). With softcap c they become
// z = c tanh(scale q.k / c) in natural-log units (softmax_scale = 1); ALiBi then subtracts
// slope |p_i - j| in the same units (alibi_scale: 1 / scale without softcap, 1 with it).
// Which one a call uses is run-time (a uniform branch per tile); whether a kernel contains this
// code at all is its kScoreMod template flag where that pays (sm80: the unused code cost the
// backward 3-8%, docs/NOTES.md).
#pragma once

#include <cute/tensor.hpp>

#include <type_traits>

#include "flashcute/common/seqlen.h"
#include "flashcute/params.h"

namespace flashcute {

using namespace cute;

// tanh(x) = 1 - 2 / (e^{2x} + 1): two MUFU operations, absolute error ~1e-7 (tanh.approx's
// 2^-11 relative error would put ~c * 5e-4 on a capped score: more than bf16's own rounding).
CUTE_DEVICE float tanh_accurate(float x) {
  return 1.f - 2.f / (exp2f(x * 2.8853900817779268f) + 1.f);  // 2 log2(e)
}

// Pack: query rows per position, as the mask's (common/mask.h): cute::C<1>, or int for the
// KV-cache kernels' GQA-packed rows, where row r is position r / pack of head h + r % pack, so
// ALiBi's slope and position are per row.
template <typename Pack = cute::C<1>>
struct ScoreMod {
  static constexpr bool kPacked = !std::is_same_v<Pack, cute::C<1>>;
  float softcap = 0.f;     // c; 0: off
  float softcap_in = 0.f;  // scale / c: raw q.k -> the argument of tanh
  float alibi = 0.f;       // slope of this (batch, head) in softmax units (packed: alibi_scale); 0: off
  int diag_offset = 0;     // seqlen_k - seqlen_q of this sequence (p_i = i + diag_offset)
  const float* slopes = nullptr;  // packed: the slopes of this batch from head h on
  Pack pack;

  CUTE_DEVICE ScoreMod(const FwdParams& p, const SeqlenInfo& seqlen, int b, int h, Pack pack_ = {})
      : softcap(p.softcap),
        softcap_in(p.softcap > 0.f ? p.scale / p.softcap : 0.f),
        diag_offset(seqlen.k - seqlen.q / pack_),
        pack(pack_) {
    if (p.alibi_slopes == nullptr) return;
    if constexpr (kPacked) {
      alibi = p.alibi_scale;
      slopes = p.alibi_slopes + b * p.alibi_batch_stride + h;
    } else {
      alibi = p.alibi_slopes[b * p.alibi_batch_stride + h] * p.alibi_scale;
    }
  }

  // Whether a call modifies its scores at all (a uniform branch per tile).
  static CUTE_DEVICE bool active(const FwdParams& p) { return p.has_score_mod(); }

  // ALiBi's |p_i - j| for the scores of row i of a tile view, as floats without an int -> float
  // conversion per score (I2F issues at the MUFU rate, a quarter of FFMA's): the distance to the
  // thread's first column of the row, converted once, minus each column's offset from it, which
  // is a compile-time constant of the fragment layout.
  template <typename TensorC>
  CUTE_DEVICE float row_distance(TensorC const& coord, int i, int row0, int col0) const {
    const int r = row0 + get<0>(coord(i, 0));
    if constexpr (kPacked) {
      return float(position(r) + diag_offset - col0 - get<1>(coord(i, 0)));
    } else {
      return float(r + diag_offset - col0 - get<1>(coord(i, 0)));
    }
  }
  // ALiBi's slope (softmax units) of row i of a tile view.
  template <typename TensorC>
  CUTE_DEVICE float row_slope(TensorC const& coord, int i, int row0) const {
    if constexpr (kPacked) {
      const int r = row0 + get<0>(coord(i, 0));
      return alibi * slopes[r - position(r) * pack];
    } else {
      return alibi;
    }
  }
  // Packed row r's position r / pack, through a float reciprocal: exact for r < 2^22 (the error,
  // under r 2^-23 / pack, stays below (r + 0.5) / pack's distance to an integer, 1 / (2 pack);
  // src/cuda/dispatch.cu packs ALiBi calls only within that). The d128 score-mod kernel spilled
  // 16/16 B with an integer division, 68/80 with a multiply-shift one, none with this. Only packed-
  // ALiBi kernels run it (kRowSlopes): in softcap's it cost 0.6-7% (H200, session 41, NOTES).
  CUTE_DEVICE int position(int r) const {
    return int((float(r) + 0.5f) * __frcp_rn(float(pack)));
  }
  template <typename TensorC>
  static CUTE_DEVICE float col_offset(TensorC const& coord, int i, int j) {
    return float(get<1>(coord(i, j)) - get<1>(coord(i, 0)));
  }

  // s: raw scores as (rows, cols) -> softmax units; coord, row0, col0: as for the mask's apply().
  template <typename TensorS, typename TensorC>
  CUTE_DEVICE void premask(TensorS& s, TensorC const& coord, int row0, int col0) const {
    if (softcap > 0.f) {
      CUTE_UNROLL
      for (int i = 0; i < size(s); ++i) s(i) = softcap * tanh_accurate(s(i) * softcap_in);
    }
    if (alibi != 0.f) {
      CUTE_UNROLL
      for (int i = 0; i < size<0>(s); ++i) {
        const float dist = row_distance(coord, i, row0, col0), slope = row_slope(coord, i, row0);
        CUTE_UNROLL
        for (int j = 0; j < size<1>(s); ++j) s(i, j) -= slope * fabsf(dist - col_offset(coord, i, j));
      }
    }
  }

  // Backward: ds holds dL/dz (z the modified score, per unit of softmax input); turns it into
  // dL/d(scale q.k) (the kernels multiply by scale at the end): with softcap, times
  // 1 - tanh^2 = 1 - ((z - bias) / c)^2. z is recovered from P = exp2(z softmax_scale_log2 - L2),
  // so no copy of the scores is kept: z = (L2 + log2 P) / softmax_scale_log2; where P = 0, dS is 0
  // anyway. lse_log2[i]: L2 of row i of the view. ALiBi's bias does not depend on q.k.
  template <typename TensorDS, typename TensorP, typename TensorC, typename RowStat>
  CUTE_DEVICE void grad(TensorDS& ds, TensorP const& p, TensorC const& coord, int row0, int col0,
                        RowStat const& lse_log2, float softmax_scale_log2) const {
    static_assert(!kPacked, "the KV-cache kernels (packed rows) have no backward");
    if (softcap <= 0.f) return;
    const float inv_cap = 1.f / softcap, to_units = 1.f / softmax_scale_log2;
    CUTE_UNROLL
    for (int i = 0; i < size<0>(ds); ++i) {
      const float dist = row_distance(coord, i, row0, col0);
      CUTE_UNROLL
      for (int j = 0; j < size<1>(ds); ++j) {
        const float pij = fabsf(p(i, j));  // dropout marks dropped scores with a negative sign
        const float z = (lse_log2[i] + __log2f(pij)) * to_units;
        const float t = (z + alibi * fabsf(dist - col_offset(coord, i, j))) * inv_cap;
        ds(i, j) = pij > 0.f ? ds(i, j) * (1.f - t * t) : 0.f;
      }
    }
  }
};

}  // namespace flashcute
