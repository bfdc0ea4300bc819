// flashcute — the sm90 decoding main loop (flash-decoding over a KV cache): FlashAttention-2's
// Algorithm 1 over one split of a query tile's key tiles, warp-specialised.
//
// The producer warp issues the TMA copies of K_j and V_j (a box per tile: contiguous caches, and
// paged ones whose pages hold whole tiles, the page found through the page table) into
// kStages-deep rings; each consumer
// warp owns 32 keys of every tile (the sm80 decoding tile, sm90/traits.h DecodeTraits) with its
// own m, l and O:
//
//   for each key tile j of the split:   wait K_j;  S = Q K_j^T   (mma.sync, ldmatrix)
//                                       release K_j; mask S      (only tiles with masked scores)
//                                       m' = max(m, rowmax S); P = exp2(S - m'); l = l e^(m-m') + rowsum P
//                                       wait V_j;  O = O e^(m-m') + P V_j;  release V_j
//
// The epilogue (epilogue_decode.h) merges the warps' and then the splits' partials: a query
// tile's splits run as one cluster, so no combine kernel follows.
#pragma once

#include <algorithm>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flashcute/common/kvcache.h"
#include "flashcute/common/mask.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/utils.h"
#include "flashcute/sm80/utils.h"
#include "flashcute/sm90/traits.h"
#include "flashcute/sm90/utils.h"

namespace flashcute::sm90 {

using namespace cute;

// (Pages smaller than a tile, a TMA box per 16-row group and the page-table lookups of each tile
// in the producer warp's lanes, ran 16-token pages 1.2-1.7x the sm80 kernel's time: not kept,
// BENCHMARKS.md session 48. With each lane's entry read a tile ahead, 16-, 32- and 64-token pages
// alike, H200, b 1, GQA 32/8, 8k / 32k: 19.1 / 58.3 us against the sm80 kernel's 16.9 / 40.5: the
// 32 boxes of 2 KB per tile, not the lookups, bound it; session 50.)
template <typename Traits_, typename Mask_>
struct MainloopDecode {
  using Traits = Traits_;
  using Mask = Mask_;
  using Element = typename Traits::Element;
  using Mma = typename Traits::Mma;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kConsumerWarps = Traits::kConsumerWarps;  // a warp per 32 keys
  static constexpr int kNumMmaThreads = 32 * kConsumerWarps;
  // A producer warpgroup (its first warp issues the copies, with few registers: setmaxnreg) and a
  // consumer warpgroup (d <= 128; above, two consumer warps and two idle ones).
  static constexpr int kNThreads = 256;
  // (The consumers' 256 registers rather than 240: d256's kernels spill 12-28 bytes rather than
  // 68-188, and b 1, GQA 32/8, 8k / 32k d256 runs 25.5 / 84.0 -> 24.0 / 78.5 us; d128 unchanged.
  // H200, session 52.)
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 256;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kNumMmaThreads <= 65536);
  using TmaKV = typename Traits::TmaKV;
  using SmemLayoutKV = typename Traits::SmemLayoutKV;
  static constexpr int kTileElems = cosize_v<SmemLayoutKV>;

  struct Params {
    FwdParams p;
    TmaKV tma_k, tma_v;
    typename Traits::ShapeKV shape_k, shape_v;
  };

  // The epilogue's buffers (epilogue_decode.h): each warp's O (normalised) and L, in the rings once
  // every tile has been read; and, beside the rings (the cluster's other CTAs write it while this
  // one may still stream), the split partials of the rows this CTA merges: row r of the tile goes
  // to the cluster's rank r % splits, split s's copy to slot s * ceil(kBlockM / splits) + r / splits.
  struct Merge {
    float o_warp[kConsumerWarps][kBlockM][kHeadDim];
    float lse_warp[kConsumerWarps][kBlockM];
  };
  static constexpr int kMaxSplits = 8;  // a portable cluster
  struct Landing {
    float o[kBlockM + kMaxSplits - 1][kHeadDim];
    float lse[kBlockM + kMaxSplits - 1];
    uint64_t full;  // armed by this CTA with the bytes its rows' partials take
  };
  struct Rings {
    cute::array_aligned<Element, kStages * kTileElems, 1024> k;
    cute::array_aligned<Element, kStages * kTileElems, 1024> v;
  };
  struct SharedStorage {
    union {
      Rings rings;
      Merge merge;
    };
    cute::array_aligned<Element, cosize_v<typename Mma::SmemLayoutQ>, 128> q;
    alignas(16) Landing landing;
    StageRing<kStages> ring_k, ring_v;
  };

  using AccO = decltype(partition_fragment_C(typename Mma::TiledMmaO{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  static constexpr int kRows = decltype(size<0>(sm80::acc_rowcol(std::declval<AccO>().layout())))::value;
  static CUTE_DEVICE AccO make_acc_o() {
    AccO acc_o = partition_fragment_C(typename Mma::TiledMmaO{}, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_o);
    return acc_o;
  }

  // ---- Host: the cache's TMA descriptors, (rows of a page, headdim, kv heads, pages).
  static Params to_params(const FwdParams& p) {
    const bool paged = p.block_table != nullptr;
    const int rows = paged ? p.page_size : p.seqlen_k, pages = paged ? p.num_pages : p.batch;
    auto gk = tma_gmem_tensor<Element>(p.k, p.k_stride, rows, p.headdim, p.nheads_kv, pages);
    auto gv = tma_gmem_tensor<Element>(p.v, p.v_stride, rows, p.headdim, p.nheads_kv, pages);
    using Box = Shape<Int<kBlockN>, Int<kHeadDim>>;
    Params kp;
    kp.p = p;
    kp.shape_k = gk.shape();
    kp.shape_v = gv.shape();
    kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gk, SmemLayoutKV{}, Box{}, _1{});
    kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gv, SmemLayoutKV{}, Box{}, _1{});
    return kp;
  }

  // ---- Device. Thread 0 initialises the barriers before the CTA's first __syncthreads.
  static CUTE_DEVICE void init(const Params& params, SharedStorage& smem) {
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    smem.ring_k.init(kConsumerWarps);
    smem.ring_v.init(kConsumerWarps);
    cutlass::arch::ClusterTransactionBarrier::init(&smem.landing.full, 1);
    cutlass::arch::fence_barrier_init();
  }

  // Whether the producer copies the split's first tile (tile `split`: the policy's tiles start at
  // 0, with no left window edge) before the cache's length is known, where that tile lies inside
  // the capacity. The length's read had taken about 1 us before the first copy; without it, H200,
  // GQA 32/8, b 1 8k / 32k 12.6 / 36.2 -> 12.0 / 35.5 us, b 8 8k 66.3 -> 65.7 (session 51). A
  // split with no tile after all waits for that copy before its consumers use the stages' space.
  static CUTE_DEVICE bool first_tile_early(const FwdParams& p, const FwdTile& tile) {
    return !Mask::kWindow && tile.split * kBlockN < p.seqlen_k;
  }
  // The key tiles of this CTA's split: its lead tile, then its share of the rest, last to first
  // (both roles walk the same). (The splits of a cluster take 5% longer on ranks 0, 1, 6 and 7
  // than on 2-5 at b 1, GQA 32/8, 32k, whichever keys they read: per-CTA clock stamps, H200,
  // session 51. Interleaving every tile over the splits did not change that, and slowed
  // 128-token pages from 36.1 to 40.6 us.)
  static CUTE_DEVICE SplitKvCursor key_tiles(const Mask& mask, const FwdParams& p, const FwdTile& tile) {
    return mask.kv_cursor(tile.bidb, tile.bidh, tile.m_block).split_lead(tile.split, p.num_splits);
  }

  // Producer (one lane): the split's first tile before the cache's length is read where it can be
  // (first_tile_early); then for each tile, wait for a free stage, arm its barriers with the tile's
  // bytes and copy K_j and V_j, a box each from the tile's page (contiguous: the sequence's). The
  // next tile's page-table entry is read a tile ahead (128-token pages, H200, b 1, GQA 32/8: 8k /
  // 32k 15.10 / 38.36 us, on a par with the contiguous cache's 14.56 / 37.75). Rows
  // past the sequence's keys are read from inside the cache (or zero-filled by TMA past it); the
  // consumers mask them (K) or zero them (V). (L2 hints on these loads: EVICT_FIRST 4-5% slower at
  // b 1 and 8, EVICT_LAST no change; H200, session 53.)
  CUTE_DEVICE void load(const Params& params, const FwdTile& tile, SharedStorage& smem) const {
    const FwdParams& p = params.p;
    const KvCacheRows cache{p, tile.bidb, tile.bidh, tile.bidh / p.h_per_kv()};
    Tensor mK = params.tma_k.get_tma_tensor(params.shape_k)(_, _, cache.h_kv, _);  // (rows, D, pages)
    Tensor mV = params.tma_v.get_tma_tensor(params.shape_v)(_, _, cache.h_kv, _);
    auto cta_k = params.tma_k.get_slice(_0{});
    auto cta_v = params.tma_v.get_slice(_0{});
    using Box = Shape<Int<kBlockN>, Int<kHeadDim>>;
    // Use i of the rings: K and V of key tile n, a box each from the page of table entry `entry`
    // (contiguous caches: the sequence's), K's stage already acquired (full_k).
    auto copy_tile = [&](int i, int n, int entry, uint64_t& full_k) {
      const int page = cache.page_from_entry(entry), row = cache.row_in_page(n * kBlockN);
      const int s = smem.ring_k.stage(i);
      Tensor sK = make_tensor(make_smem_ptr(smem.rings.k.data() + s * kTileElems), SmemLayoutKV{});
      Tensor sV = make_tensor(make_smem_ptr(smem.rings.v.data() + s * kTileElems), SmemLayoutKV{});
      copy(params.tma_k.with(full_k),
           cta_k.partition_S(local_tile(mK(_, _, page), Box{}, make_coord(row / kBlockN, _0{}))), cta_k.partition_D(sK));
      copy(params.tma_v.with(smem.ring_v.acquire(i, Traits::kBytesKV)),
           cta_v.partition_S(local_tile(mV(_, _, page), Box{}, make_coord(row / kBlockN, _0{}))), cta_v.partition_D(sV));
    };
    // The split's first tile before the cache's length is known (first_tile_early).
    const bool early = first_tile_early(p, tile);
    if (early) {
      copy_tile(0, tile.split, cache.table_entry_or_b(tile.split * kBlockN), smem.ring_k.acquire(0, Traits::kBytesKV));
    }
    const SeqlenInfo seqlen = SeqlenInfo::with_cache(p, tile.bidb);  // (after the copy: its asm orders it)
    const Mask mask(p, seqlen, kBlockM, kBlockN);
    auto kv = key_tiles(mask, p, tile);
    int i = 0;
    if (early && kv.valid()) {  // (its first tile is the one copied)
      kv.advance();
      i = 1;
    }
    int entry = kv.valid() ? cache.table_entry_or_b(kv.tile() * kBlockN) : 0;
    for (; kv.valid(); ++i) {
      const int n = kv.tile(), this_entry = entry;
      kv.advance();
      auto& full_k = smem.ring_k.acquire(i, Traits::kBytesKV);
      if (kv.valid()) entry = cache.table_entry_or_b(kv.tile() * kBlockN);  // the next tile's
      copy_tile(i, n, this_entry, full_k);
    }
  }

  // Consumers (thread_idx: 0 .. kNumMmaThreads - 1; the rest of their warpgroup idles): Algorithm 1
  // over the same tiles, a warp per 32 keys of each. Q (its packed rows, zero past seqlen.q) is
  // loaded once into shared memory and read by ldmatrix with each K tile. (K's and V's stages
  // released before the math, their fragments copied to registers first, Q's held: no change,
  // H200, b 1 / 8, GQA 32/8, 8k / 32k, session 50.)
  template <typename Softmax>
  CUTE_DEVICE void mma(const Params& params, const FwdTile& tile, const SeqlenInfo& seqlen, AccO& acc_o,
                       Softmax& softmax, SharedStorage& smem, int thread_idx) const {
    const FwdParams& p = params.p;
    const int tidx = thread_idx, lane = tidx % 32, warp = tidx / 32;
    const Mask mask(p, seqlen, kBlockM, kBlockN);
    auto kv = key_tiles(mask, p, tile);
    const KvCacheRows cache{p, tile.bidb, tile.bidh, 0};

    // Q: cp.async of the packed rows (common/kvcache.h) into shared memory.
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Mma::SmemLayoutQ{});
    {
      typename Mma::GmemTiledCopyQKV gmem_copy;
      auto gmem_thr = gmem_copy.get_thread_slice(tidx);
      Tensor tQsQ = gmem_thr.partition_D(sQ);
      Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
      Tensor tQgQ0 = gmem_thr.partition_S(make_tensor(make_gmem_ptr(static_cast<const Element*>(p.q)),
                                                      make_layout(Shape<Int<kBlockM>, Int<kHeadDim>>{},
                                                                  make_stride(_0{}, _1{}))));
      sm80::copy_rows<true>(gmem_copy, tQgQ0, tQsQ, tQcQ, column_predicate(tQcQ, p.headdim),
                            seqlen.q - tile.m_block * kBlockM,
                            [&](int r, int) { return cache.q_row(p.q_stride, tile.m_block * kBlockM + r); });
      cp_async_fence();
      cp_async_wait<0>();
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, kBarrierConsumers);
    }
    typename Mma::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tidx);
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
    auto smem_copy_q = make_tiled_copy_A(typename Mma::SmemCopyAtom{}, tiled_mma);
    auto smem_thr_q = smem_copy_q.get_thread_slice(tidx);
    Tensor tSsQ = smem_thr_q.partition_S(sQ);
    if (!kv.valid()) {  // no key in this split: O = 0, L = -inf
      if (first_tile_early(p, tile)) {
        smem.ring_k.wait_full(0);
        smem.ring_v.wait_full(0);
      }
      return;
    }

    // K_j (this warp's keys through the tiled MMA's column split) and V_j^T (its own rows).
    auto stage_k = [&](int s) { return make_tensor(make_smem_ptr(smem.rings.k.data() + s * kTileElems), SmemLayoutKV{}); };
    auto stage_vt = [&](int s, auto layout) {
      return local_tile(make_tensor(make_smem_ptr(smem.rings.v.data() + s * kTileElems), layout),
                        Shape<Int<kHeadDim>, _32>{}, make_coord(0, warp));
    };
    Tensor tSrK = thr_mma.partition_fragment_B(stage_k(0));
    auto smem_copy_k = make_tiled_copy_B(typename Mma::SmemCopyAtom{}, tiled_mma);
    auto smem_thr_k = smem_copy_k.get_thread_slice(tidx);
    typename Mma::TiledMmaO tiled_mma_o;
    auto thr_mma_o = tiled_mma_o.get_thread_slice(lane);
    Tensor tOrVt = thr_mma_o.partition_fragment_B(stage_vt(0, typename Traits::SmemLayoutVtNoSwizzle{}));
    auto smem_copy_v = make_tiled_copy_B(typename Mma::SmemCopyAtomT{}, tiled_mma_o);
    auto smem_thr_v = smem_copy_v.get_thread_slice(lane);

    Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cS = make_tensor(tScS.data(), sm80::acc_rowcol(tScS.layout()));
    Tensor o_rc = make_tensor(acc_o.data(), sm80::acc_rowcol(acc_o.layout()));

    // V rows past the sequence's keys (in its last, partial tile) are whatever the cache holds
    // there: this warp zeroes its own before O += P V reads them (P is 0 there, and 0 * NaN is
    // not), and orders its writes before the stage's next TMA write (proxy fence).
    auto zero_v_rows = [&](int s, int rows_valid) {
      Tensor sV = make_tensor(make_smem_ptr(smem.rings.v.data() + s * kTileElems), SmemLayoutKV{});
      constexpr int kChunks = kHeadDim / 8;  // 16-byte chunks per row
      CUTE_UNROLL
      for (int e = lane; e < 32 * kChunks; e += 32) {
        const int r = warp * 32 + e / kChunks;
        if (r >= rows_valid) *reinterpret_cast<uint4*>(&sV(r, e % kChunks * 8)) = make_uint4(0, 0, 0, 0);
      }
      cutlass::arch::fence_view_async_shared();
      __syncwarp();
    };

    int i = 0;  // the tile's use of the rings
    auto step = [&](int n_block, auto is_first, auto is_masked) __attribute__((always_inline)) {
      const int s = smem.ring_k.stage(i);
      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      smem.ring_k.wait_full(i);
      sm80::gemm_ss(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, smem_thr_k.partition_S(stage_k(s)), smem_copy_q, smem_copy_k,
                    smem_thr_q, smem_thr_k);
      __syncwarp();
      smem.ring_k.release(i, lane == 0);
      Tensor s_rc = make_tensor(acc_s.data(), sm80::acc_rowcol(acc_s.layout()));
      if constexpr (decltype(is_masked)::value) {
        mask.apply(s_rc, cS, tile.m_block * kBlockM, n_block * kBlockN);
      }
      softmax.template step<decltype(is_first)::value>(s_rc, o_rc, p.softmax_scale_log2);
      Tensor rP = convert_fragment<Element>(acc_s);
      Tensor tOrP = make_tensor(rP.data(), sm80::acc_as_A(rP.layout()));
      smem.ring_v.wait_full(i);
      if constexpr (decltype(is_masked)::value) {
        if ((n_block + 1) * kBlockN > seqlen.k) zero_v_rows(s, seqlen.k - n_block * kBlockN);
      }
      sm80::gemm_rs(tiled_mma_o, acc_o, tOrP, tOrVt, smem_thr_v.partition_S(stage_vt(s, typename Traits::SmemLayoutVt{})),
                    smem_copy_v, smem_thr_v);
      __syncwarp();
      smem.ring_v.release(i, lane == 0);
      ++i;
    };

    // The split's tiles (key_tiles: its lead tile, then its range last to first): the lead tile
    // masked, as the first tile of the sm80 loop; the range's top tile masked where the policy says
    // (the tile at seqlen_k, a causal diagonal); then the policy's runs with masked scores and runs
    // without, as in the forward (walk_in_runs). (One loop that asks the policy at every tile ran
    // d256 at b 1, GQA 32/8, 8k / 32k in 37.1 / 129.4 us against these runs' 24.0 / 78.5, with as
    // many registers; d128 in 12.0 / 35.5 against 12.2 / 35.7. H200, session 52.)
    step(kv.tile(), cute::true_type{}, cute::true_type{});
    kv.advance();
    if (kv.valid() && mask.needs_mask(tile.m_block, kv.tile())) {
      step(kv.tile(), cute::false_type{}, cute::true_type{});
      kv.advance();
    }
    mask.walk_in_runs(tile.m_block, kv, [&](auto is_masked) __attribute__((always_inline)) {
      step(kv.tile(), cute::false_type{}, is_masked);
    });
  }

  // Named barriers: 0 is __syncthreads'.
  static constexpr uint32_t kBarrierConsumers = 1;
};

}  // namespace flashcute::sm90
