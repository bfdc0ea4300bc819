// flashcute — dropout's keep mask (SPEC score pipeline, step 6): one element -> random number
// map, shared by both kernel families, the CPU backend and flashcute.dropout_mask.
//
// The map (a pure function of rng_state = (seed, offset), the shape and the element's index;
// FlashAttention-2's scheme, features.md §5): the scores of one (sequence b, query head h) are
// cut into 16 x 32 blocks (R, C) = (i / 16, j / 32); block (R, C) gets 32 Philox4x32-7 draws,
// one per "lane" l = (r % 8) * 4 + (c % 8) / 2 of its element (r, c) = (i % 16, j % 32), each
// giving 16 random bytes:
//   counter = (offset + (b * nheads + h) * 32 + l  [64 bits],  R  [32 bits],  C  [32 bits]),
//   key = seed;  byte (c / 16) * 8 + ((c % 16) / 8) * 4 + (r / 8) * 2 + c % 2 of the draw.
// The element is kept iff its byte <= threshold = floor((1 - p) * 255): probability
// (threshold + 1) / 256, within 1/256 of 1 - p; kept values are scaled by 1 / (1 - p).
//
// Why this map: lane l is exactly the lane of a warp that holds (r, c) in an m16n8 MMA
// accumulator (sm80's mma.sync and sm90's wgmma share that layout), and that thread holds all
// 16 elements the draw covers (rows r, r + 8; columns c, c + 1 of four 8-column atoms). So a
// kernel thread makes one Philox call per 16 of its scores, whatever the tile shape, as long as
// its warp owns 32 adjacent columns of S (apply() below; the sm80 backward's S/dP MMA is laid
// out so).
#pragma once

#include <cstdint>
#include <utility>

#include "flashcute/params.h"

#if defined(__CUDACC__)
#include <cute/tensor.hpp>
#endif

namespace flashcute {

// The threshold of a dropout probability p in [0, 1): keep iff byte <= threshold.
inline uint32_t dropout_threshold(double p) { return static_cast<uint32_t>((1.0 - p) * 255.0); }

// Philox4x32's key schedule for a seed: the round keys (k0, k1) of its 7 rounds, computed once
// per map rather than per draw (14 of a draw's ~42 integer instructions).
struct PhiloxKeys {
  uint32_t k[7][2];
  FLASHCUTE_HOST_DEVICE explicit PhiloxKeys(uint64_t seed) {
    for (int round = 0; round < 7; ++round) {
      k[round][0] = uint32_t(seed) + uint32_t(round) * 0x9E3779B9u;
      k[round][1] = uint32_t(seed >> 32) + uint32_t(round) * 0xBB67AE85u;
    }
  }
};

struct Philox4x32 {
  uint32_t w[4];

  // Philox4x32 with 7 rounds (Salmon et al. 2011; 7 as FlashAttention-2 uses).
  static FLASHCUTE_HOST_DEVICE Philox4x32 draw(const PhiloxKeys& keys, uint64_t counter_lo, uint32_t c2, uint32_t c3) {
    uint32_t x0 = uint32_t(counter_lo), x1 = uint32_t(counter_lo >> 32), x2 = c2, x3 = c3;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
    for (int round = 0; round < 7; ++round) {
      const uint64_t p0 = uint64_t(0xD2511F53u) * x0;  // one mul.wide each
      const uint64_t p1 = uint64_t(0xCD9E8D57u) * x2;
      const uint32_t y0 = uint32_t(p1 >> 32) ^ x1 ^ keys.k[round][0];
      const uint32_t y2 = uint32_t(p0 >> 32) ^ x3 ^ keys.k[round][1];
      x1 = uint32_t(p1);
      x3 = uint32_t(p0);
      x0 = y0;
      x2 = y2;
    }
    return Philox4x32{{x0, x1, x2, x3}};
  }
  FLASHCUTE_HOST_DEVICE uint32_t byte(int i) const { return (w[i / 4] >> (8 * (i % 4))) & 0xffu; }
};

// The keep mask of one (sequence b, query head h).
struct DropoutMap {
  PhiloxKeys keys;       // of the seed
  uint64_t counter = 0;  // offset + (b * nheads + h) * 32
  uint32_t threshold = 255;

  // (Without dropout, rng_state == nullptr: a map that is never applied.)
  FLASHCUTE_HOST_DEVICE DropoutMap(const FwdParams& p, int b, int h)
      : keys(p.rng_state ? uint64_t(p.rng_state[0]) : 0),
        counter((p.rng_state ? uint64_t(p.rng_state[1]) : 0) + (uint64_t(b) * p.nheads + h) * 32),
        threshold(p.dropout_threshold) {}
  FLASHCUTE_HOST_DEVICE DropoutMap(uint64_t seed, uint64_t offset, int64_t bh, uint32_t threshold_)
      : keys(seed), counter(offset + uint64_t(bh) * 32), threshold(threshold_) {}

  // The draw of block (R, C) for lane l.
  FLASHCUTE_HOST_DEVICE Philox4x32 draw(int block_row, int block_col, int lane) const {
    return Philox4x32::draw(keys, counter + lane, uint32_t(block_row), uint32_t(block_col));
  }
  // Is score (i, j) kept? (One draw per element: for the CPU backend and dropout_mask.)
  FLASHCUTE_HOST_DEVICE bool keep(int i, int j) const {
    const int r = i % 16, c = j % 32;
    const int lane = (r % 8) * 4 + (c % 8) / 2;
    const int byte = (c / 16) * 8 + ((c % 16) / 8) * 4 + (r / 8) * 2 + c % 2;
    return draw(i / 16, j / 32, lane).byte(byte) <= threshold;
  }

#if defined(__CUDACC__)
  // ---- The kernels' side. p, coord: (rows, cols) views of an m16n8 / wgmma accumulator (or of
  // its 16-bit conversion), whose rows pair up as (r, r + 8) and whose columns come in groups of
  // four 8-column atoms, a warp's four covering 32 adjacent columns; row0 / col0: the tile's first
  // score. Masks are applied to pairs of adjacent columns (c, c + 1 of one atom: one 32-bit
  // register of 16-bit P), as FlashAttention-2 does: 4 instructions per pair, where a compare
  // and a select per fp32 score took ~7 (the sm90 forward: +29..66% with those, +21..43% with
  // these, H100, docs/NOTES.md).

  // The draws of this thread's blocks: one per (row pair, column group); draw d covers rows
  // m, m + 1 and columns g .. g + 7 of the view (block_of).
  template <typename TensorC>
  static constexpr int kDraws = decltype(cute::size<0>(std::declval<TensorC>()))::value / 2 *
                                (decltype(cute::size<1>(std::declval<TensorC>()))::value / 8);
  template <int kCols>
  static CUTE_DEVICE void block_of(int d, int& m, int& g) {
    m = d / (kCols / 8) * 2;
    g = d % (kCols / 8) * 8;
  }
  template <typename TensorC>
  CUTE_DEVICE Philox4x32 draw_block(TensorC const& coord, int row0, int col0, int d) const {
    using namespace cute;
    static_assert(decltype(size<0>(coord))::value % 2 == 0 && decltype(size<1>(coord))::value % 8 == 0,
                  "rows in pairs, columns in groups of four 8-column atoms");
    int m, g;
    block_of<decltype(size<1>(coord))::value>(d, m, g);
    return draw((row0 + get<0>(coord(m, g))) / 16, (col0 + get<1>(coord(m, g))) / 32, threadIdx.x % 32);
  }
  template <typename TensorC>
  CUTE_DEVICE cute::array<Philox4x32, kDraws<TensorC>> draw_all(TensorC const& coord, int row0, int col0) const {
    cute::array<Philox4x32, kDraws<TensorC>> draws;
    CUTE_UNROLL
    for (int d = 0; d < kDraws<TensorC>; ++d) draws[d] = draw_block(coord, row0, col0, d);
    return draws;
  }

  // Calls fn(i, j, mask) for each pair of adjacent columns (j, j + 1) of row i of the view, draw d
  // of the kN being draw_of(d): mask has 0xffff in the 16-bit lane (low: j, high: j + 1) of each
  // kept score, 0 for a dropped one.
  template <int kCols, int kN, typename DrawOf, typename Fn>
  CUTE_DEVICE void for_each_pair(DrawOf const& draw_of, Fn&& fn) const {
    const uint32_t threshold2 = threshold | (threshold << 16);
    CUTE_UNROLL
    for (int d = 0; d < kN; ++d) {
      int m, g;
      block_of<kCols>(d, m, g);
      const Philox4x32 draw_d = draw_of(d);
      CUTE_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTE_UNROLL
        for (int atom = 0; atom < 4; ++atom) {
          // bytes 2r, 2r + 1 of the atom's word (row r of the pair, columns c, c + 1), zero-extended
          // to 16 bits; compared as f16 (0..255 are ordered subnormals) against the threshold
          const uint32_t bytes = __byte_perm(draw_d.w[atom], 0, r == 0 ? 0x4140 : 0x4342);
          uint32_t mask;
          asm("set.le.u32.f16x2 %0, %1, %2;" : "=r"(mask) : "r"(bytes), "r"(threshold2));
          fn(m + r, g + 2 * atom, mask);
        }
      }
    }
  }
  template <int kCols, size_t kN, typename Fn>
  CUTE_DEVICE void for_each_pair(cute::array<Philox4x32, kN> const& draws, Fn&& fn) const {
    for_each_pair<kCols, int(kN)>([&](int d) { return draws[d]; }, fn);
  }

  // The 32-bit register holding 16-bit elements (i, j) and (i, j + 1) of a register view.
  template <typename Tensor16>
  static CUTE_DEVICE uint32_t& pair(Tensor16& p, int i, int j) {
    static_assert(sizeof(typename Tensor16::value_type) == 2, "pairs of 16-bit values");
    return reinterpret_cast<uint32_t*>(raw_pointer_cast(p.data()))[p.layout()(i, j) / 2];
  }
  // Marks the dropped scores of fp32 pair (i, j), (i, j + 1) of P (P >= 0) with a negative sign.
  template <typename TensorF>
  static CUTE_DEVICE void mark_pair(TensorF& p, int i, int j, uint32_t mask) {
    p(i, j) = __uint_as_float(__float_as_uint(p(i, j)) ^ ((~mask << 16) & 0x80000000u));
    p(i, j + 1) = __uint_as_float(__float_as_uint(p(i, j + 1)) ^ (~mask & 0x80000000u));
  }

  // Forward: P *= keep on the converted (16-bit) P of this thread.
  template <typename Tensor16, size_t kN>
  CUTE_DEVICE void apply(Tensor16& p16, cute::array<Philox4x32, kN> const& draws) const {
    using namespace cute;
    for_each_pair<decltype(size<1>(p16))::value>(draws,
                                                  [&](int i, int j, uint32_t mask) { pair(p16, i, j) &= mask; });
  }

  // Backward (sm80 family): P *= keep on the converted P (for dV), and the fp32 P (kept for dS)
  // marked: a dropped score's P gets a negative sign, so that keep * dP = sign_keep(P, dP) and
  // P = |P| after the dP GEMM, with no register live across it beyond P itself (keeping the draws
  // or the masks instead spilled 144-244 bytes more in the backward's variants, ptxas).
  template <typename Tensor16, typename TensorF, size_t kN>
  CUTE_DEVICE void apply_signed(Tensor16& p16, TensorF& p, cute::array<Philox4x32, kN> const& draws) const {
    using namespace cute;
    for_each_pair<decltype(size<1>(p16))::value>(draws, [&](int i, int j, uint32_t mask) {
      pair(p16, i, j) &= mask;
      mark_pair(p, i, j, mask);
    });
  }
  // Backward (sm90 family, which converts and stores P one copy atom at a time): the same marks
  // made on the fp32 P alone, each draw made where it is used; P * keep for dV is then max(P, 0),
  // converted (store_converted<kRelu>). Neither the draws nor a 16-bit copy of P is live beside S
  // and dP: in the 128-row d64 steps apply_signed spilled 456-496 bytes, this 72-184 (ptxas). In
  // the sm80 backward, which converts P whole, this spilled more than apply_signed (d128 causal
  // 80/100 -> 216/412 bytes), so it keeps apply_signed (docs/NOTES.md, session 28).
  template <typename TensorF, typename TensorC>
  CUTE_DEVICE void mark_dropped(TensorF& p, TensorC const& coord, int row0, int col0) const {
    using namespace cute;
    for_each_pair<decltype(size<1>(coord))::value, kDraws<TensorC>>(
        [&](int d) { return draw_block(coord, row0, col0, d); },
        [&](int i, int j, uint32_t mask) { mark_pair(p, i, j, mask); });
  }
  // dP * keep for a P marked by apply_signed or mark_dropped.
  static CUTE_DEVICE float sign_keep(float p, float dp) {
    return __uint_as_float(__float_as_uint(dp) & ~uint32_t(__float_as_int(p) >> 31));
  }
#endif
};

}  // namespace flashcute
