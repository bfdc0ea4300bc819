// flashcute — the mask policy of the main loops (both kernel families).
//
// A policy answers three questions for a CTA: which tiles along the other sequence to visit
// (key tiles of a query tile in the forward, query tiles of a key tile in the backward: a range
// from the window rules, walked densely or through a block-sparse list), which visited tiles
// hold masked scores (only those run apply()), and which scores inside them are -inf. The main
// loops are written once; dense, causal, windowed and block-sparse attention (and any mix of
// them) differ only in what the policy answers. The per-row rules are common/mask_rules.h,
// which the CPU backend uses too.
//
// Block-sparse masks list whole blocks whose sizes are multiples of the kernels' tiles (the
// op checks this), so a visited tile lies inside one listed block and needs element masking
// only where the window rules need it: the diagonal(s) and the partial tile at seqlen_k.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>
#include <type_traits>

#include "flashcute/common/mask_rules.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/tile_range.h"
#include "flashcute/params.h"

namespace flashcute {

using namespace cute;

// kWindow: rows have a key range (causal, or a sliding window (L, R) with run-time L and R);
// otherwise every key < seqlen_k is visible. kSparse: the tiles come from a block-sparse list.
// Both are template flags because the dense kernels then keep the registers that the list walk
// and the window arithmetic would take (measured for sparseness: the forward 3-5% slower with a
// run-time flag, docs/NOTES.md). kPack (the KV-cache kernels): query rows are GQA-packed
// (position, head) pairs (params.pack_gqa), row r at position r / pack_gqa; the rules work on
// positions. kLeftEdge = false (CausalMask, common/dispatch.h): the window is causal's, (-1, 0),
// known at compile time, so the kernel carries none of the left edge's code and no run-time R.
// (PaddedCausalMask, common/dispatch.h, is CausalMask for padded batches only: kVarlen = false.)
template <bool kWindow_, bool kSparse_, bool kPack_ = false, bool kLeftEdge_ = kWindow_>
struct AttentionMask {
  static constexpr bool kWindow = kWindow_;
  static constexpr bool kSparse = kSparse_;
  static constexpr bool kPack = kPack_;
  static constexpr bool kLeftEdge = kWindow_ && kLeftEdge_;
  static constexpr bool kCausal = kWindow_ && !kLeftEdge_;  // the window (-1, 0)
  static constexpr bool kVarlen = true;  // packed batches (cu_seqlens) as well as padded ones
  // Dense key tiles are visited last to first: only the first can be partial (at seqlen_k),
  // and without a window only the first holds masked scores.
  static constexpr bool kPartialTileFirst = !kSparse;
  static constexpr bool kMasksBeyondFirstTile = kWindow || kSparse;
  MaskRules rules;
  int tile_m;  // the kernel's query rows per tile
  int tile_n;  // the kernel's keys per tile
  BlockSparse sparse;
  std::conditional_t<kPack, int, cute::C<1>> pack;  // kPack: query rows per position

  CUTE_DEVICE AttentionMask(const FwdParams& p, const SeqlenInfo& seqlen, int tile_m_, int tile_n_)
      : rules{kPack ? seqlen.q / p.pack_gqa : seqlen.q, seqlen.k, kLeftEdge ? p.window_left : -1,
              kCausal ? 0 : kWindow ? p.window_right : -1},
        tile_m(tile_m_),
        tile_n(tile_n_),
        sparse(p.sparse),
        pack(make_pack(p)) {}

  // Where sequence b's rows and keys are (the sm80 backward asks its policy).
  static CUTE_DEVICE SeqlenInfo seqlen(const FwdParams& p, int b) { return SeqlenInfo(p, b); }

  static CUTE_DEVICE auto make_pack(const FwdParams& p) {
    if constexpr (kPack) {
      return p.pack_gqa;
    } else {
      return cute::C<1>{};
    }
  }
  // The query position of kernel row r. (The functions below spell out the kPack = false case
  // without it: the same arithmetic through pos() cost the d128 causal forward 48 bytes of
  // spills, ptxas.)
  CUTE_DEVICE int pos(int r) const { return r / pack; }

  // Can a masked tile follow an unmasked one in the forward's (reverse) walk? Only with a left
  // window edge or a sparse list; dense causal has its masked tiles at the front.
  CUTE_DEVICE bool masked_runs_recur() const { return kSparse || (kLeftEdge && rules.window_left >= 0); }

  // ---- Ranges: key tiles [n_tile_begin, n_tile_end) hold every key some row of query tile
  // m_tile sees; query tiles [m_tile_begin, m_tile_end) every row that sees a key of key tile n_tile.
  CUTE_DEVICE int n_tile_begin(int m_tile) const {
    if constexpr (kPack) {
      return kLeftEdge && rules.window_left >= 0 ? rules.col_begin(pos(m_tile * tile_m)) / tile_n : 0;
    } else {
      return kLeftEdge && rules.window_left >= 0 ? rules.col_begin(m_tile * tile_m) / tile_n : 0;
    }
  }
  CUTE_DEVICE int n_tile_end(int m_tile) const {
    const int n_max = ceil_div(rules.seqlen_k, tile_n);
    if (!kWindow || rules.window_right < 0) return n_max;
    if constexpr (kPack) {
      return min(n_max, ceil_div(rules.col_end(pos((m_tile + 1) * tile_m - 1)), tile_n));
    } else {
      return min(n_max, ceil_div(rules.col_end((m_tile + 1) * tile_m - 1), tile_n));
    }
  }
  CUTE_DEVICE int m_tile_begin(int n_tile) const {
    return kWindow ? rules.row_begin(n_tile * tile_n) / tile_m : 0;
  }
  CUTE_DEVICE int m_tile_end(int n_tile) const {
    const int m_max = ceil_div(rules.seqlen_q, tile_m);
    if (!kWindow) return m_max;
    const int last_col = min((n_tile + 1) * tile_n, rules.seqlen_k) - 1;
    const int row_end = rules.row_end(last_col);
    return row_end <= rules.row_begin(n_tile * tile_n) ? 0 : min(m_max, ceil_div(row_end, tile_m));
  }

  // Block-sparse, forward: the list of key blocks of query tile m_tile of (b, h).
  CUTE_DEVICE BlockWalk kv_walk(int b, int h, int m_tile) const {
    const int64_t r = sparse.row(b, h) * sparse.num_q_blocks + m_tile / (sparse.block_m / tile_m);
    const int count = min(max(sparse.kv_num[r], 0), sparse.num_kv_blocks);
    return BlockWalk{sparse.kv_idx + r * sparse.num_kv_blocks, count, sparse.block_n / tile_n,
                     n_tile_begin(m_tile), n_tile_end(m_tile)};
  }

  // Block-sparse, backward: the list of query blocks that see key tile n_tile, for query head h
  // of batch b.
  CUTE_DEVICE BlockWalk q_walk(int b, int h, int n_tile) const {
    const int64_t r = sparse.row(b, h) * sparse.num_kv_blocks + n_tile / (sparse.block_n / tile_n);
    const int count = min(max(sparse.q_num[r], 0), sparse.num_q_blocks);
    return BlockWalk{sparse.q_idx + r * sparse.num_q_blocks, count, sparse.block_m / tile_m, m_tile_begin(n_tile),
                     m_tile_end(n_tile)};
  }

  // The forward's walk over the key tiles of query tile m_tile of (b, h).
  CUTE_DEVICE auto kv_cursor(int b, int h, int m_tile) const {
    if constexpr (kSparse) {
      return SparseKvCursor::start(kv_walk(b, h, m_tile));
    } else {
      return DenseKvCursor{n_tile_end(m_tile) - 1, n_tile_begin(m_tile)};
    }
  }

  // The backward's walk over (query head, query tile) for key tile n_tile and the query heads
  // [head0, head0 + num_heads) of batch b.
  CUTE_DEVICE auto q_cursor(int b, int head0, int num_heads, int n_tile) const {
    if constexpr (kSparse) {
      return SparseQCursor<AttentionMask>::start(*this, b, head0, num_heads, n_tile);
    } else {
      const int m_begin = m_tile_begin(n_tile);
      const int per_head = max(m_tile_end(n_tile) - m_begin, 0);
      return DenseQCursor{0, per_head * num_heads, max(per_head, 1), m_begin, head0};
    }
  }

  // Does tile (m_tile, n_tile) hold a masked score? Only such tiles run apply().
  CUTE_DEVICE bool needs_mask(int m_tile, int n_tile) const {
    if ((n_tile + 1) * tile_n > rules.seqlen_k) return true;  // the partial tile at seqlen_k
    if (!kWindow) return false;
    // Right edge: the tile's first row misses the tile's last key. Left edge: the tile's last
    // row misses its first key.
    const int first_row = m_tile * tile_m, last_row = (m_tile + 1) * tile_m - 1;
    if constexpr (kPack) {
      if (rules.window_right >= 0 && rules.col_end(pos(first_row)) < (n_tile + 1) * tile_n) return true;
      return kLeftEdge && rules.window_left >= 0 && rules.col_begin(pos(last_row)) > n_tile * tile_n;
    } else {
      if (rules.window_right >= 0 && rules.col_end(first_row) < (n_tile + 1) * tile_n) return true;
      return kLeftEdge && rules.window_left >= 0 && rules.col_begin(last_row) > n_tile * tile_n;
    }
  }

  // The forward main loops' walk over cursor kv's remaining tiles (sm80 and sm90 forward, sm90
  // decoding): in runs of tiles with masked scores and runs without, a loop each, calling
  // step(cute::true_type{}) on the tile at kv.tile() when it holds masked scores and
  // step(cute::false_type{}) when not. Dense, the masked tiles (seqlen_k's, the right window
  // edge's) come first; a left window edge or a sparse list can bring masked runs back. (Why runs:
  // sm90/mainloop_decode.h.)
  template <typename Cursor, typename Step>
  CUTE_DEVICE void walk_in_runs(int m_tile, Cursor& kv, Step&& step) const {
    const bool recur = masked_runs_recur();
    while (kv.valid()) {
      if constexpr (kMasksBeyondFirstTile) {
        CUTE_NO_UNROLL
        for (; kv.valid() && needs_mask(m_tile, kv.tile()); kv.advance()) step(cute::true_type{});
      }
      CUTE_NO_UNROLL
      for (; kv.valid() && !(recur && needs_mask(m_tile, kv.tile())); kv.advance()) step(cute::false_type{});
    }
  }

  // s: scores as (rows, cols); coord: the (row, col) of each score inside the tile, whose
  // top-left element is query row0, key col0.
  // Two passes: the right edge (and seqlen_k) on every masked tile, one compare per score as
  // before the restructure; the left edge only where a window has one. (ptxas, d128 causal
  // forward: one pass with both compares, or two inlined one-pass variants chosen at run time,
  // left 2-7 more spill reloads per tile in the unmasked loop; docs/NOTES.md.)
  template <typename TensorS, typename TensorC>
  CUTE_DEVICE void apply(TensorS& s, TensorC const& coord, int row0, int col0) const {
    CUTE_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      const int row = row0 + get<0>(coord(i, 0));
      const int hi = kWindow ? rules.col_end(kPack ? pos(row) : row) : rules.seqlen_k;
      CUTE_UNROLL
      for (int j = 0; j < size<1>(s); ++j) {
        if (col0 + get<1>(coord(i, j)) >= hi) s(i, j) = -INFINITY;
      }
    }
    if (kLeftEdge && rules.window_left >= 0) {
      CUTE_UNROLL
      for (int i = 0; i < size<0>(s); ++i) {
        const int row = row0 + get<0>(coord(i, 0));
        const int lo = rules.col_begin(kPack ? pos(row) : row);
        CUTE_UNROLL
        for (int j = 0; j < size<1>(s); ++j) {
          if (col0 + get<1>(coord(i, j)) < lo) s(i, j) = -INFINITY;
        }
      }
    }
  }

  // apply() for the rows of a wgmma accumulator (sm90 family, sm90/utils.h acc_rowcol): a
  // thread's element j of a row sits at column c + 8 (j / 2) + j % 2, c that of its element 0, so
  // the keys a row sees, an interval, are a run of its elements: one bit mask per row, and a
  // select per score on the mask's bits (nvcc reads 7 bits into predicates at a time, R2P),
  // instead of a compare and a select per score, and no column index per score held in a
  // register. Against apply() in the sm90 forward (H200, bf16, 3-4 alternating rounds): windowed
  // calls d64 -1.6..-5.2%, d128 +0.1..-3.8% at 8k-16k tokens (the 192-row windowed kernel's 96/108
  // bytes of spills gone); the dense and causal grid within +-2.1% (docs/NOTES.md, session 47).
  template <typename TensorS, typename TensorC>
  CUTE_DEVICE void apply_wgmma_rows(TensorS& s, TensorC const& coord, int row0, int col0) const {
    constexpr int kCols = decltype(size<1>(s))::value;
    static_assert(kCols % 2 == 0 && kCols <= 64, "pairs of columns, at most 64 per row");
    using Bits = std::conditional_t<(kCols > 32), uint64_t, uint32_t>;
    const int c = col0 + get<1>(coord(0, 0));
    auto below = [&](int col) {  // how many of the row's elements lie left of key col
      const int d = col - c;
      return d <= 0 ? 0 : min(2 * (d >> 3) + min(d & 7, 2), kCols);
    };
    auto first = [](int n) { return n >= kCols ? ~Bits(0) : (Bits(1) << n) - 1; };  // elements [0, n)
    CUTE_UNROLL
    for (int i = 0; i < size<0>(s); ++i) {
      const int row = row0 + get<0>(coord(i, 0));
      const int r = kPack ? pos(row) : row;
      Bits keep = first(below(kWindow ? rules.col_end(r) : rules.seqlen_k));
      if (kLeftEdge && rules.window_left >= 0) keep &= ~first(below(rules.col_begin(r)));
      CUTE_UNROLL
      for (int j = 0; j < kCols; ++j) {
        if (!((keep >> j) & 1)) s(i, j) = -INFINITY;
      }
    }
  }
};

}  // namespace flashcute
