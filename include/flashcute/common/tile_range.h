// flashcute — how the main loops walk their tiles: cursors over key tiles (forward) and over
// (query head, query tile) steps (backward), dense or through a block-sparse list.
//
// A cursor only enumerates tiles; which of them hold masked scores is the mask policy's
// question (common/mask.h). Arch-free: used by both kernel families.
#pragma once

#include <cute/config.hpp>

namespace flashcute {

CUTE_HOST_DEVICE constexpr int ceil_div_int(int a, int b) { return (a + b - 1) / b; }

struct SplitKvCursor;

// Forward, dense: the key tiles [begin, end) of a query tile, from the last to the first (so the
// tile at seqlen_k and the causal diagonal come first).
struct DenseKvCursor {
  int n;      // the current tile
  int begin;  // the first tile (visited last)
  CUTE_DEVICE bool valid() const { return n >= begin; }
  CUTE_DEVICE int tile() const { return n; }
  CUTE_DEVICE int next_tile() const { return n - 1 >= begin ? n - 1 : -1; }  // -1: none
  CUTE_DEVICE void advance() { --n; }
  // Split-KV: the split-th of num_splits consecutive ranges of equal tile counts (the last one
  // shorter; empty when there are fewer tiles than splits).
  CUTE_DEVICE DenseKvCursor split(int split, int num_splits) const {
    const int per = ceil_div_int(n + 1 - begin, num_splits);
    const int lo = begin + split * per;
    return DenseKvCursor{min(lo + per, n + 1) - 1, lo};
  }
  // Split-KV that knows each split's first tile before the range's end (the sm90 decoding kernel):
  // split s starts at tile begin + s, then walks its split of the tiles past the first num_splits,
  // last to first (so a split's masked tiles at the range's top, seqlen_k's and the causal
  // diagonal's, come right after its lead tile).
  CUTE_DEVICE SplitKvCursor split_lead(int split, int num_splits) const;
};

// A split of split_lead: its lead tile, then the rest of its range.
struct SplitKvCursor {
  int n;               // the current tile; -1: none left
  DenseKvCursor rest;  // the tiles after it
  CUTE_DEVICE bool valid() const { return n >= 0; }
  CUTE_DEVICE int tile() const { return n; }
  CUTE_DEVICE void advance() {
    n = rest.valid() ? rest.tile() : -1;
    rest.advance();
  }
};

CUTE_DEVICE SplitKvCursor DenseKvCursor::split_lead(int split, int num_splits) const {
  const int lead = begin + split, rest_begin = begin + num_splits;
  const DenseKvCursor rest{max(n, rest_begin - 1), rest_begin};  // (empty if n < rest_begin)
  return SplitKvCursor{lead <= n ? lead : -1, rest.split(split, num_splits)};
}

// Block-sparse: one list of blocks (each per_block tiles), walked entry by entry; only the tiles
// in [first, last) are visited (the others are outside the rows' key ranges), and entries outside
// the sequence's blocks are skipped, never dereferenced.
struct BlockWalk {
  const int* blocks;
  int count;      // entries in the list
  int per_block;  // tiles per block
  int first;      // tiles < first are skipped
  int last;       // tiles >= last are skipped

  // The visited tiles of entry e, as [begin, end); empty for a bad or fully skipped entry.
  CUTE_DEVICE void tiles_of(int e, int& begin, int& end) const {
    const int block = blocks[e];
    const bool ok = block >= 0 && block < ceil_div_int(last, per_block);
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

// Backward, dense: every (query head of the kv head's group, query tile in [m_begin, m_end)) as
// one step counter, heads outermost.
struct DenseQCursor {
  int step, num_steps, steps_per_head, m_begin, head0;
  CUTE_DEVICE bool valid() const { return step < num_steps; }
  CUTE_DEVICE int head() const { return head0 + step / steps_per_head; }
  CUTE_DEVICE int tile() const { return m_begin + step % steps_per_head; }
  CUTE_DEVICE void advance() { ++step; }
};

// Backward, block-sparse: the listed query tiles of each query head in turn, each list in its
// (ascending) order, each block's tiles first to last (Mask::q_walk gives a head's list).
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

}  // namespace flashcute
