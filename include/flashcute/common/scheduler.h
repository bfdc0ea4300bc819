// flashcute — the tile schedulers: which tile a CTA computes. One tile per CTA, decoded from its
// grid (any batch and head count fits); the hardware schedules the CTAs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>

#include <cute/config.hpp>
#include <cutlass/fast_math.h>

#include "flashcute/common/tile_range.h"
#include "flashcute/params.h"

namespace flashcute {

// A grid's largest y and z extents (the 3-D grids below fall back to 1-D past them).
inline constexpr int kMaxGridYZ = 65535;

// Forward: query block, query head (GQA packing: the group's first), batch (sequence), and the
// range of keys (split-KV).
struct FwdTile {
  int m_block;
  int bidh;
  int bidb;
  int split = 0;
};

// A grid over (query block, batch, head), query blocks fastest. kLongestFirst (causal or
// windowed): the query blocks with the most keys start first, so the short ones fill the tail.
// Packed batches: every sequence gets the blocks of the longest (params.seqlen_q); the kernel
// returns at once from blocks past its sequence.
// kGrid3D: the grid is 3-D, (query block, batch, head), where batch and heads fit its y and z
// extents (65535), so that a CTA reads its tile from blockIdx; other shapes get the 1-D grid,
// decoded. Decoding takes two integer divisions at the top of the kernel: in the sm80 forward
// their dependent chain ran before the first load (ncu, H200, d64 causal, 512 tokens, 2 CTAs per
// SM: kernel time +1.8..1.9%, instructions +1.9%, against the pre-restructure build); with the 3-D
// grid that call is 1.1% faster (docs/NOTES.md, session 32). The sm80 forward's score-mod kernels
// keep the 1-D grid (kGrid3D = false): the fallback's code beside the 3-D path raised the d64 one's
// spills from 84/140 to 124/188 bytes, and softcap, ALiBi and dropout calls ran up to 3% slower.
template <int kBlockM, bool kLongestFirst, bool kGrid3D = true>
struct SingleTileScheduler {
  static constexpr bool kChained = false;  // see KvCacheTileScheduler
  // Tile t of the grid's order: query-block index i = t % M (M blocks per head) fastest, then
  // batch, then head; block_of(M, i) names the query block of index i.
  static CUTE_HOST_DEVICE int block_of(int num_m_blocks, int i) { return kLongestFirst ? num_m_blocks - 1 - i : i; }
  static CUTE_DEVICE FwdTile tile(const FwdParams& p, int t) {
    const int num_m_blocks = ceil_div_int(p.seqlen_q, kBlockM);
    const int bh = t / num_m_blocks;
    return {block_of(num_m_blocks, t % num_m_blocks), bh / p.batch, bh % p.batch};
  }
  // Whether the grid of a call is 3-D (host and device make the same test).
  static CUTE_HOST_DEVICE bool grid_3d(const FwdParams& p) {
    return kGrid3D && p.batch <= kMaxGridYZ && p.nheads <= kMaxGridYZ;
  }
  static CUTE_DEVICE FwdTile get(const FwdParams& p) {
    if (grid_3d(p)) return {block_of(int(gridDim.x), int(blockIdx.x)), int(blockIdx.z), int(blockIdx.y)};
    return tile(p, blockIdx.x);
  }
  static CUTE_HOST_DEVICE int num_tiles(const FwdParams& p) {
    return ceil_div_int(p.seqlen_q, kBlockM) * p.batch * p.nheads;
  }
  static dim3 grid(const FwdParams& p) {
    if (grid_3d(p)) return dim3(ceil_div_int(p.seqlen_q, kBlockM), p.batch, p.nheads);
    return dim3(num_tiles(p));
  }
};

// Persistent (sm90 forward, short key ranges): CTA c walks its share of the tiles, so that its
// producer loads the next tile's Q and K while its consumers finish the last one. Dense calls:
// the same order, tiles c, c + grid, c + 2 grid, ... (equal work each). kLongestFirst (causal,
// windowed): a query block's work grows with its index, so each head's blocks go in pairs of
// equal total, longest with shortest (M-1, 0), (M-2, 1), ..., and a CTA takes whole pairs: pairs
// c, c + grid, ... (Taking every grid-th tile of the dense order instead gave each CTA the same
// query block index, 132 being a multiple of 4: causal d128 seqlen 512 29% slower, H100.) The
// grid: params.num_sms CTAs, or one per tile when num_sms is 0 (the launcher's choice for long
// dense key ranges, packed batches and caches, whose tiles differ in work: the hardware's
// scheduling balances those), and then the order is the one-tile-per-CTA order. (Block-sparse
// calls walk this order too: lists of any lengths, spread over the CTAs by it.)
template <int kBlockM, bool kLongestFirst>
struct PersistentTileScheduler : SingleTileScheduler<kBlockM, kLongestFirst, /*kGrid3D=*/false> {
  using Base = SingleTileScheduler<kBlockM, kLongestFirst, false>;
  static constexpr int kUnit = kLongestFirst ? 2 : 1;  // tiles a CTA takes at a time
  static CUTE_HOST_DEVICE int num_units(const FwdParams& p) { return ceil_div_int(Base::num_tiles(p), kUnit); }
  // Whether this grid is persistent (fewer CTAs than units): the kernel asks once, then walks
  // first(), next(), ... below num_tiles(), each tile(t).
  static CUTE_DEVICE bool persistent(const FwdParams& p) { return int(gridDim.x) < num_units(p); }
  static CUTE_DEVICE int first(bool persistent) { return persistent ? blockIdx.x * kUnit : blockIdx.x; }
  static CUTE_DEVICE int next(bool persistent, int t) {
    if (!persistent) return t + gridDim.x;
    return t % kUnit != kUnit - 1 ? t + 1 : t + 1 + (gridDim.x - 1) * kUnit;
  }
  // The walk's two divisions (a tile's index by the query blocks per head, then by the batch),
  // prepared on the host for multiplications (cutlass::FastDivmod). Divided on the device, they
  // were a dependent chain of about 50 uniform-datapath instructions between a consumer
  // warpgroup's epilogue and its next tile, which the other warpgroups' next GEMMs wait for
  // (their turns follow its). Measured on the H200 against the divisions (4 alternating rounds):
  // forward at 512 tokens d64 -1.6% (causal -1.2%), d128 -1.7% (-1.5%); at 1024 d64 +0.6%
  // (-2.2%), d128 -3.2% (-1.9%); longer calls within the rounds' spread (docs/NOTES.md, session
  // 55, which has clock stamps of the tiles).
  struct Divmods {
    cutlass::FastDivmod m_blocks, batch;
  };
  static Divmods divmods(const FwdParams& p) {
    return {cutlass::FastDivmod(std::max(ceil_div_int(p.seqlen_q, kBlockM), 1)),
            cutlass::FastDivmod(std::max(p.batch, 1))};
  }
  // Tile t of the one-tile-per-CTA order (Base::tile's, with the divisions above); persistent and
  // kLongestFirst, a head's query blocks go M-1, 0, M-2, 1, ...
  static CUTE_DEVICE FwdTile tile(const Divmods& d, bool persistent, int t) {
    int bh, i, h, b;
    d.m_blocks(bh, i, t);
    d.batch(h, b, bh);
    const int m = d.m_blocks.divisor;
    return {kLongestFirst && persistent ? (i % 2 == 0 ? m - 1 - i / 2 : i / 2) : Base::block_of(m, i), h, b};
  }
  static dim3 grid(const FwdParams& p) {
    const int units = num_units(p);
    return dim3(p.num_sms > 0 && p.num_sms < units ? p.num_sms : Base::num_tiles(p));
  }
};

// KV cache: a grid over (query block, split), batch, head group, query blocks fastest. With GQA
// packing (params.pack_gqa = g) a CTA's rows are (position, head) pairs of the g query heads of
// one KV head, so the grid has nheads / g head groups of seqlen_q rows (the kernel's params count
// packed rows: seqlen_q * g). 3-D, ((query block, split), batch, head group), where batch and
// head groups fit its y and z extents, so that a CTA reads its tile from blockIdx; else 1-D,
// decoded. The kernel tells the two apart by the x extent (a 1-D grid of one batch and head group
// has the 3-D grid's tiles). Decoding one position (one query block) takes no division.
template <int kBlockM>
struct KvCacheTileScheduler {
  // Its kernel is the middle of a launch chain (common/utils.h): after the append kernel, before
  // the combine kernel.
  static constexpr bool kChained = true;
  static CUTE_HOST_DEVICE int num_m_blocks(const FwdParams& p) { return ceil_div_int(p.seqlen_q, kBlockM); }
  static CUTE_HOST_DEVICE int head_groups(const FwdParams& p) { return p.nheads / p.pack_gqa; }
  static CUTE_DEVICE FwdTile get(const FwdParams& p) {
    const int num_m = num_m_blocks(p);
    const int per_head = num_m * p.num_splits;  // the x extent of a 3-D grid
    int x = blockIdx.x, bidb = blockIdx.y, group = blockIdx.z;
    if (int(gridDim.x) != per_head) {  // 1-D
      const int bg = x / per_head;
      x -= bg * per_head;
      bidb = bg % p.batch;
      group = bg / p.batch;
    }
    const int split = num_m == 1 ? x : x / num_m;
    return {x - split * num_m, group * p.pack_gqa, bidb, split};
  }
  static dim3 grid(const FwdParams& p) {
    const int per_head = num_m_blocks(p) * p.num_splits;
    if (p.batch <= kMaxGridYZ && head_groups(p) <= kMaxGridYZ) return dim3(per_head, p.batch, head_groups(p));
    return dim3(per_head * p.batch * head_groups(p));
  }
};

// Backward: key block (or deterministic split), batch, kv head.
struct BwdTile {
  int x;  // key block (KvTileScheduler: or the CTA's split in deterministic mode)
  int bidb;
  int bidh_kv;
};

// A 1-D grid over (key block or split, batch, kv head), the first fastest. (A 3-D grid, read
// from blockIdx as SingleTileScheduler's, with the 1-D decode beside it for more than 65535
// batches or heads, ran the sm80 backward d64 0.1-0.9% faster but raised its d256 windowed
// kernel's spills from 104/128 to 164/188 bytes: not kept, session 32.)
struct KvTileScheduler {
  // Tile t of the order, num_x key blocks (or splits) per (batch, kv head).
  static CUTE_DEVICE BwdTile tile(const FwdParams& p, int t, int num_x) {
    return {t % num_x, (t / num_x) % p.batch, t / num_x / p.batch};
  }
  static CUTE_DEVICE BwdTile get(const FwdParams& p) {
    return tile(p, int(blockIdx.x), int(gridDim.x) / (p.batch * p.nheads_kv));
  }
  static dim3 grid(const FwdParams& p, int num_x) { return dim3(num_x * p.batch * p.nheads_kv); }
};

// Backward, persistent (the sm90 backward): at most params.num_sms CTAs, each walking key tiles t
// of KvTileScheduler's order (key blocks fastest, then batch, kv head: the tiles at work at once
// share their heads' Q and dO in L2). A CTA starts on tile blockIdx.x; its producer warp takes the
// next one from a global counter (zeroed by the preprocess stage) once it has issued a tile's
// loads, the hardware's greedy order without a CTA start per tile: K_j and V_j of the next tile
// load under the last one's epilogue. Deterministic mode: the grid is (split, batch, kv head),
// and the CTA of split s takes key blocks s, s + splits, ... of its head (KvTileScheduler's walk).
template <int kBlockN>
struct PersistentKvTileScheduler {
  // Stateless (the producer warp runs on 24 registers): every quantity from params and the grid.
  // Key blocks per (batch, kv head) (packed batches: of the longest sequence), and the tiles: an
  // index >= num_tiles ends the walk.
  static CUTE_HOST_DEVICE int num_n(const BwdParams& p) { return ceil_div_int(p.seqlen_k, kBlockN); }
  static CUTE_HOST_DEVICE int num_tiles(const BwdParams& p) { return num_n(p) * p.batch * p.nheads_kv; }
  // Deterministic mode: the dQ accumulator's splits (the grid's first mode); else 0.
  static CUTE_DEVICE int splits(const BwdParams& p) {
    return p.deterministic ? int(gridDim.x) / (p.batch * p.nheads_kv) : 0;
  }

  static CUTE_DEVICE int first(const BwdParams& p) {
    const int s = splits(p);
    return s > 0 ? int(blockIdx.x) / s * num_n(p) + int(blockIdx.x) % s : int(blockIdx.x);
  }
  // One thread asks (the dynamic walk takes a tile from the counter).
  static CUTE_DEVICE int next(const BwdParams& p, int t) {
    const int s = splits(p);
    if (s > 0) return t % num_n(p) + s < num_n(p) ? t + s : num_tiles(p);
    return atomicAdd(p.tile_counter, 1) + int(gridDim.x);
  }
  static CUTE_DEVICE BwdTile tile(const BwdParams& p, int t) { return KvTileScheduler::tile(p, t, num_n(p)); }
  // The dQ accumulator's split that tile t adds into.
  static CUTE_DEVICE int split(const BwdParams& p, int t) {
    const int s = splits(p);
    return s > 0 ? t % num_n(p) % s : 0;
  }

  static dim3 grid(const BwdParams& p, int num_splits) {
    if (p.deterministic) return KvTileScheduler::grid(p, num_splits);
    const int tiles = num_tiles(p);
    return dim3(p.num_sms > 0 && p.num_sms < tiles ? p.num_sms : tiles);
  }
};

}  // namespace flashcute
