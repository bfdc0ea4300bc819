// flashcute — the tile schedulers: which tile a CTA computes. One tile per CTA, decoded from a
// 1-D grid (so any batch and head count fits); the hardware schedules the CTAs.
#pragma once

#include <cuda_runtime.h>

#include <cute/config.hpp>

#include "flashcute/common/tile_range.h"
#include "flashcute/params.h"

namespace flashcute {

// Forward: query block, query head (GQA packing: the group's first), batch (sequence), and the
// range of keys (split-KV).
struct FwdTile {
  int m_block;
  int bidh;
  int bidb;
  int split = 0;
};

// A 1-D grid over (query block, batch, head), query blocks fastest. kLongestFirst (causal or
// windowed): the query blocks with the most keys start first, so the short ones fill the tail.
// Packed batches: every sequence gets the blocks of the longest (params.seqlen_q); the kernel
// returns at once from blocks past its sequence.
template <int kBlockM, bool kLongestFirst>
struct SingleTileScheduler {
  static CUTE_DEVICE FwdTile get(const FwdParams& p) {
    const int num_m_blocks = ceil_div_int(p.seqlen_q, kBlockM);
    const int m_idx = blockIdx.x % num_m_blocks;
    return {kLongestFirst ? num_m_blocks - 1 - m_idx : m_idx, int(blockIdx.x / num_m_blocks / p.batch),
            int((blockIdx.x / num_m_blocks) % p.batch)};
  }
  static dim3 grid(const FwdParams& p) { return dim3(ceil_div_int(p.seqlen_q, kBlockM) * p.batch * p.nheads); }
};

// KV cache: a 1-D grid over (query block, split, batch, head group), query blocks fastest. With
// GQA packing (params.pack_gqa = g) a CTA's rows are (position, head) pairs of the g query heads
// of one KV head, so the grid has nheads / g head groups of seqlen_q rows (the kernel's params
// count packed rows: seqlen_q * g).
template <int kBlockM>
struct KvCacheTileScheduler {
  static CUTE_DEVICE FwdTile get(const FwdParams& p) {
    const int num_m_blocks = ceil_div_int(p.seqlen_q, kBlockM);
    int x = blockIdx.x;
    const int m_block = x % num_m_blocks;
    x /= num_m_blocks;
    const int split = x % p.num_splits;
    x /= p.num_splits;
    return {m_block, (x / p.batch) * p.pack_gqa, x % p.batch, split};
  }
  static dim3 grid(const FwdParams& p) {
    return dim3(ceil_div_int(p.seqlen_q, kBlockM) * p.num_splits * p.batch * (p.nheads / p.pack_gqa));
  }
};

// Backward: key block (or deterministic split), batch, kv head.
struct BwdTile {
  int x;  // key block, or the CTA's split in deterministic mode
  int bidb;
  int bidh_kv;
};

// A 1-D grid over (key block or split, batch, kv head), the first fastest.
struct KvTileScheduler {
  static CUTE_DEVICE BwdTile get(const FwdParams& p) {
    const int num_x = gridDim.x / (p.batch * p.nheads_kv);
    return {int(blockIdx.x % num_x), int((blockIdx.x / num_x) % p.batch), int(blockIdx.x / num_x / p.batch)};
  }
  static dim3 grid(const FwdParams& p, int num_x) { return dim3(num_x * p.batch * p.nheads_kv); }
};

}  // namespace flashcute
