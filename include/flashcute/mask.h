// flashcute — the mask policy of the main loops.
//
// A policy answers two questions for a CTA: which tiles along the other sequence to visit
// (key tiles of a query tile in the forward, query tiles of a key tile in the backward), and
// which scores inside a visited tile are -inf. The main loops are written once; dense, causal
// and block-sparse attention (and any mix of them) differ only in what the policy answers.
//
// Block-sparse masks list whole blocks whose sizes are multiples of the kernels' tiles (the
// op checks this), so a visited tile lies inside one listed block and needs element masking
// only where the dense rules need it: the causal diagonal and the partial tile at seqlen_k.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "params.h"

namespace flashcute {

using namespace cute;

// A block-sparse list of tiles: the listed blocks, per_block tiles each, in list order (or
// reversed). tile(it) for it in [0, count) is a tile index, or -1 for a tile outside
// [first, last) (past the sequence, beyond the causal diagonal, or a bad index), which the
// walk skips.
struct TileList {
  const int* blocks;
  int count;
  int per_block;
  int first;
  int last;
  bool reverse;

  CUTE_DEVICE int tile(int it) const {
    const int e = it / per_block, sub = it - e * per_block;
    const int block = blocks[reverse ? count / per_block - 1 - e : e];
    if (block < 0 || block > last / per_block) return -1;  // out of range (also keeps the product small)
    const int t = block * per_block + (reverse ? per_block - 1 - sub : sub);
    return t >= first && t < last ? t : -1;
  }

  // The next visited position after it (count when there is none); next(-1) is the first.
  CUTE_DEVICE int next(int it) const {
    do {
      ++it;
    } while (it < count && tile(it) < 0);
    return it;
  }
};

// ---- Cursors: how the main loops walk their tiles --------------------------------------
// Forward, dense: the key tiles of a query tile from the last to the first.
struct DenseKvCursor {
  int n;
  CUTE_DEVICE bool valid() const { return n >= 0; }
  CUTE_DEVICE int tile() const { return n; }
  CUTE_DEVICE int next_tile() const { return n - 1; }  // -1: none
  CUTE_DEVICE void advance() { --n; }
};

// Forward, block-sparse: the listed key tiles, in list order (last entry first).
struct SparseKvCursor {
  TileList list;
  int it;
  int next;
  CUTE_DEVICE bool valid() const { return it < list.count; }
  CUTE_DEVICE int tile() const { return list.tile(it); }
  CUTE_DEVICE int next_tile() const { return next < list.count ? list.tile(next) : -1; }
  CUTE_DEVICE void advance() {
    it = next;
    next = list.next(next);
  }
};

// Backward, dense: every (query head of the kv head's group, query tile from m_begin on) as
// one step counter, heads outermost.
struct DenseQCursor {
  int step, num_steps, steps_per_head, m_begin, head0;
  CUTE_DEVICE bool valid() const { return step < num_steps; }
  CUTE_DEVICE int head() const { return head0 + step / steps_per_head; }
  CUTE_DEVICE int tile() const { return m_begin + step % steps_per_head; }
  CUTE_DEVICE void advance() { ++step; }
};

// Backward, block-sparse: the listed query tiles of each query head in turn. The heads' lists
// are recomputed from the policy where used rather than kept (registers are scarce there).
template <typename Mask>
struct SparseQCursor {
  const Mask& mask;
  int b, n_tile, head_, head_end, it;
  CUTE_DEVICE TileList list() const { return mask.q_tiles(b, head_, n_tile); }
  CUTE_DEVICE bool valid() const { return head_ < head_end; }
  CUTE_DEVICE int head() const { return head_; }
  CUTE_DEVICE int tile() const { return list().tile(it); }
  CUTE_DEVICE void advance() {  // to the next visited tile, across heads
    it = list().next(it);
    while (it >= list().count && ++head_ < head_end) it = list().next(-1);
  }
};

// Causal (bottom-right aligned: key j is masked for query i when j > i + seqlen_k - seqlen_q)
// or not, dense or block-sparse. Key columns past seqlen_k are always masked. Sparseness is a
// template flag because the dense kernels then keep the registers that the list walk would
// take (measured: the forward 3-5% slower with a run-time flag, docs/NOTES.md).
template <bool kCausal_, bool kSparse_>
struct AttentionMask {
  static constexpr bool kCausal = kCausal_;
  static constexpr bool kSparse = kSparse_;
  // Dense key tiles are visited last to first: only the first can be partial (at seqlen_k),
  // and without causal only the first holds masked scores.
  static constexpr bool kPartialTileFirst = !kSparse;
  static constexpr bool kMasksBeyondFirstTile = kCausal || kSparse;
  int seqlen_q;
  int seqlen_k;
  int tile_m;  // the kernel's query rows per tile
  int tile_n;  // the kernel's keys per tile
  BlockSparse sparse;

  CUTE_DEVICE AttentionMask(const FwdParams& p, int tile_m_, int tile_n_)
      : seqlen_q(p.seqlen_q), seqlen_k(p.seqlen_k), tile_m(tile_m_), tile_n(tile_n_), sparse(p.sparse) {}

  // Key tiles [0, n_tile_end) hold every key some row of query tile m_tile sees.
  CUTE_DEVICE int n_tile_end(int m_tile) const {
    int n_end = ceil_div(seqlen_k, tile_n);
    if (kCausal) {
      const int last_key = (m_tile + 1) * tile_m - 1 + seqlen_k - seqlen_q;  // of the tile's last row
      n_end = min(n_end, ceil_div(last_key + 1, tile_n));
    }
    return max(n_end, 0);
  }

  // Query tiles [m_tile_begin, ceil(seqlen_q / tile_m)) hold every row that sees some key of key
  // tile n_tile.
  CUTE_DEVICE int m_tile_begin(int n_tile) const {
    if (!kCausal) return 0;
    const int first_row = n_tile * tile_n - (seqlen_k - seqlen_q);  // first row that sees key n_tile * tile_n
    return max(first_row, 0) / tile_m;
  }

  // Block-sparse, forward: the listed key tiles of query tile m_tile of (b, h).
  CUTE_DEVICE TileList kv_tiles(int b, int h, int m_tile) const {
    const int per_block_m = sparse.block_m / tile_m;
    const int64_t r = sparse.row(b, h) * sparse.num_q_blocks + m_tile / per_block_m;
    const int per_block = sparse.block_n / tile_n;
    const int count = min(max(sparse.kv_num[r], 0), sparse.num_kv_blocks) * per_block;
    return TileList{sparse.kv_idx + r * sparse.num_kv_blocks, count, per_block, 0, n_tile_end(m_tile), true};
  }

  // Block-sparse, backward: the listed query tiles that see key tile n_tile, for query head h of
  // batch b.
  CUTE_DEVICE TileList q_tiles(int b, int h, int n_tile) const {
    const int per_block_n = sparse.block_n / tile_n;
    const int64_t r = sparse.row(b, h) * sparse.num_kv_blocks + n_tile / per_block_n;
    const int per_block = sparse.block_m / tile_m;
    const int count = min(max(sparse.q_num[r], 0), sparse.num_q_blocks) * per_block;
    return TileList{sparse.q_idx + r * sparse.num_q_blocks, count, per_block, m_tile_begin(n_tile),
                    ceil_div(seqlen_q, tile_m), false};
  }

  // The forward's walk over the key tiles of query tile m_tile of (b, h).
  CUTE_DEVICE auto kv_cursor(int b, int h, int m_tile) const {
    if constexpr (kSparse) {
      const TileList list = kv_tiles(b, h, m_tile);
      const int it = list.next(-1);
      return SparseKvCursor{list, it, list.next(it)};
    } else {
      return DenseKvCursor{n_tile_end(m_tile) - 1};
    }
  }

  // The backward's walk over (query head, query tile) for key tile n_tile and the query heads
  // [head0, head0 + num_heads) of batch b.
  CUTE_DEVICE auto q_cursor(int b, int head0, int num_heads, int n_tile) const {
    if constexpr (kSparse) {
      SparseQCursor<AttentionMask> c{*this, b, n_tile, head0, head0 + num_heads, -1};
      c.advance();
      return c;
    } else {
      const int m_begin = m_tile_begin(n_tile);
      const int per_head = max(ceil_div(seqlen_q, tile_m) - m_begin, 0);
      return DenseQCursor{0, per_head * num_heads, max(per_head, 1), m_begin, head0};
    }
  }

  // Does tile (m_tile, n_tile) hold a masked score? Only such tiles run apply().
  CUTE_DEVICE bool needs_mask(int m_tile, int n_tile) const {
    if ((n_tile + 1) * tile_n > seqlen_k) return true;  // the partial tile at seqlen_k
    if (!kCausal) return false;
    // Masked somewhere iff the tile's first row misses the tile's last key.
    return m_tile * tile_m + seqlen_k - seqlen_q < (n_tile + 1) * tile_n - 1;
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

// Host side: calls fn(MaskTag<AttentionMask<causal, sparse>>{}) for the policy of a call.
template <typename Mask>
struct MaskTag {
  using type = Mask;
};
template <typename Fn>
void with_mask_policy(const FwdParams& p, Fn&& fn) {
  if (p.causal) {
    if (p.sparse.enabled()) return fn(MaskTag<AttentionMask<true, true>>{});
    return fn(MaskTag<AttentionMask<true, false>>{});
  }
  if (p.sparse.enabled()) return fn(MaskTag<AttentionMask<false, true>>{});
  return fn(MaskTag<AttentionMask<false, false>>{});
}

}  // namespace flashcute
