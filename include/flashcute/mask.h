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

// ---- Cursors: how the main loops walk their tiles --------------------------------------
// Forward, dense: the key tiles of a query tile from the last to the first.
struct DenseKvCursor {
  int n;
  CUTE_DEVICE bool valid() const { return n >= 0; }
  CUTE_DEVICE int tile() const { return n; }
  CUTE_DEVICE int next_tile() const { return n - 1; }  // -1: none
  CUTE_DEVICE void advance() { --n; }
};

// Block-sparse: one list of blocks (each per_block tiles), walked entry by entry; only the tiles
// in [first, last) are visited (the others are past the sequence or beyond the causal diagonal),
// and entries outside the sequence's blocks are skipped, never dereferenced.
struct BlockWalk {
  const int* blocks;
  int count;      // entries in the list
  int per_block;  // tiles per block
  int first;      // tiles < first are skipped
  int last;       // tiles >= last are skipped

  // The visited tiles of entry e, as [begin, end); empty for a bad or fully skipped entry.
  CUTE_DEVICE void tiles_of(int e, int& begin, int& end) const {
    const int block = blocks[e];
    const bool ok = block >= 0 && block < ceil_div(last, per_block);
    begin = ok ? max(block * per_block, first) : 0;
    end = ok ? min(block * per_block + per_block, last) : 0;
  }
};

// Forward, block-sparse: the listed key tiles, from the list's last entry to its first and each
// block's tiles last to first (so that an ascending list is visited like the dense walk: the
// tiles at seqlen_k and on the causal diagonal first). cur / nxt: this tile and the next (-1: none).
struct SparseKvCursor {
  BlockWalk walk;
  int e;      // the entry of nxt
  int begin;  // the first tile of nxt's block
  int cur, nxt;

  CUTE_DEVICE static SparseKvCursor start(BlockWalk const& walk) {
    SparseKvCursor c{walk, walk.count, 0, -1, -1};
    c.nxt = c.after(-1);
    c.advance();
    return c;
  }
  CUTE_DEVICE bool valid() const { return cur >= 0; }
  CUTE_DEVICE int tile() const { return cur; }
  CUTE_DEVICE int next_tile() const { return nxt; }
  CUTE_DEVICE void advance() {
    cur = nxt;
    if (cur >= 0) nxt = after(cur);
  }
  // The tile visited after t (t = -1: before the first), moving e and begin along.
  CUTE_DEVICE int after(int t) {
    if (t > begin) return t - 1;
    while (--e >= 0) {
      int end;
      walk.tiles_of(e, begin, end);
      if (begin < end) return end - 1;
    }
    return -1;
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

// Backward, block-sparse: the listed query tiles of each query head in turn, each list in its
// (ascending) order, each block's tiles first to last.
template <typename Mask>
struct SparseQCursor {
  const Mask& mask;
  int b, n_tile, head_, head_end;
  BlockWalk walk;  // head_'s list
  int e;           // the entry of the current tile
  int cur, end;    // the current tile and the end of its block's run

  CUTE_DEVICE static SparseQCursor start(const Mask& mask, int b, int head0, int num_heads, int n_tile) {
    SparseQCursor c{mask, b, n_tile, head0, head0 + num_heads, mask.q_walk(b, head0, n_tile), -1, 0, 0};
    c.next_block();
    return c;
  }
  CUTE_DEVICE bool valid() const { return head_ < head_end; }
  CUTE_DEVICE int head() const { return head_; }
  CUTE_DEVICE int tile() const { return cur; }
  CUTE_DEVICE void advance() {
    if (++cur >= end) next_block();
  }
  // On the first tile of the next block with visited tiles, across heads (head_ = head_end: done).
  CUTE_DEVICE void next_block() {
    while (true) {
      if (++e >= walk.count) {
        if (++head_ >= head_end) return;
        walk = mask.q_walk(b, head_, n_tile);
        e = -1;
        continue;
      }
      walk.tiles_of(e, cur, end);
      if (cur < end) return;
    }
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

  // Block-sparse, forward: the list of key blocks of query tile m_tile of (b, h).
  CUTE_DEVICE BlockWalk kv_walk(int b, int h, int m_tile) const {
    const int64_t r = sparse.row(b, h) * sparse.num_q_blocks + m_tile / (sparse.block_m / tile_m);
    const int count = min(max(sparse.kv_num[r], 0), sparse.num_kv_blocks);
    return BlockWalk{sparse.kv_idx + r * sparse.num_kv_blocks, count, sparse.block_n / tile_n, 0,
                     n_tile_end(m_tile)};
  }

  // Block-sparse, backward: the list of query blocks that see key tile n_tile, for query head h
  // of batch b.
  CUTE_DEVICE BlockWalk q_walk(int b, int h, int n_tile) const {
    const int64_t r = sparse.row(b, h) * sparse.num_kv_blocks + n_tile / (sparse.block_n / tile_n);
    const int count = min(max(sparse.q_num[r], 0), sparse.num_q_blocks);
    return BlockWalk{sparse.q_idx + r * sparse.num_q_blocks, count, sparse.block_m / tile_m, m_tile_begin(n_tile),
                     ceil_div(seqlen_q, tile_m)};
  }

  // The forward's walk over the key tiles of query tile m_tile of (b, h).
  CUTE_DEVICE auto kv_cursor(int b, int h, int m_tile) const {
    if constexpr (kSparse) {
      return SparseKvCursor::start(kv_walk(b, h, m_tile));
    } else {
      return DenseKvCursor{n_tile_end(m_tile) - 1};
    }
  }

  // The backward's walk over (query head, query tile) for key tile n_tile and the query heads
  // [head0, head0 + num_heads) of batch b.
  CUTE_DEVICE auto q_cursor(int b, int head0, int num_heads, int n_tile) const {
    if constexpr (kSparse) {
      return SparseQCursor<AttentionMask>::start(*this, b, head0, num_heads, n_tile);
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
