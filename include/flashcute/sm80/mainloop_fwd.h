// flashcute — the sm80 forward main loop: FlashAttention-2, Algorithm 1, over the key tiles of
// one query tile.
//
// The CTA's warps split the kBlockM query rows (each warp owns whole rows of S), so the softmax
// stays inside a warp (decoding's tile: the warps split the keys instead, each with its own m, l
// and O over its keys, which the epilogue merges; traits.h). The CTA walks the key/value tiles
// its mask policy lists (dense: last to first; block-sparse: the listed blocks), keeping O, the
// row max m and the row sum l in registers:
//
//   for each key tile j:    S = Q K_j^T            (tensor cores, operands via ldmatrix)
//                           S = mod(S); mask S     (score modification: every tile; the mask
//                                                   policy: only on tiles with masked scores)
//                           m' = max(m, rowmax S); P = exp2(S - m'); l = l e^(m-m') + rowsum P
//                           P = P * keep           (dropout, common/dropout.h)
//                           O = O e^(m-m') + P V_j
//
// K_j and V_j come from global memory by cp.async into swizzled shared memory; V_j's load
// overlaps S = Q K_j^T, and the next K tile's load overlaps O += P V_j.
//
// kKvCache (attention_with_kvcache): the same loop over one split of the key tiles (split-KV),
// with Q's rows GQA-packed (position, head) pairs and K/V rows read through the page table
// (common/kvcache.h): only the loads differ.
#pragma once

#include <cute/tensor.hpp>

#include <algorithm>

#include "flashcute/common/dropout.h"
#include "flashcute/common/kvcache.h"
#include "flashcute/common/mask.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/score_mod.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/softmax.h"
#include "flashcute/common/utils.h"
#include "flashcute/sm80/traits.h"
#include "flashcute/sm80/utils.h"

// The most CTAs per SM that decoding's tile is bounded to at d <= 64 (3: as at larger head dims,
// for A/B runs; MainloopFwd::kMinCtasPerSm).
#ifndef FLASHCUTE_KV_DECODE_D64_CTAS
#define FLASHCUTE_KV_DECODE_D64_CTAS 4
#endif

#ifndef FLASHCUTE_KV_PAGE_GROUPS  // 0: the page table read per row (for A/B runs)
#define FLASHCUTE_KV_PAGE_GROUPS 1
#endif

namespace flashcute::sm80 {

using namespace cute;

template <typename Traits_, typename Mask_, bool kScoreMod_, bool kKvCache_ = false, bool kRowSlopes_ = false>
struct MainloopFwd {
  using Traits = Traits_;
  using Mask = Mask_;
  static constexpr bool kScoreMod = kScoreMod_;  // the kernel has softcap, ALiBi and dropout code
  static constexpr bool kKvCache = kKvCache_;    // a KV-cache call: split range, row-wise loads
  // ALiBi on GQA-packed rows (KV cache): a slope and a position per row (ScoreMod<int>). A kernel
  // of its own: in the softcap kernel that code cost softcap decoding 0.6-7% (H200, session 41).
  static constexpr bool kRowSlopes = kRowSlopes_;
  using Element = typename Traits::Element;
  using TiledMma = typename Traits::TiledMma;    // S = Q K^T
  using TiledMmaO = typename Traits::TiledMmaO;  // O += P V (side by side: each warp its own)
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kNThreads = Traits::kNThreads;

  // KV cache with small pages (a multiple of 16 tokens, smaller than a tile): the page table is
  // read once per 16-row group of a key tile, and the copy's row passes are permuted so that a
  // thread's rows pair up in groups, 8 rows apart (row % 8, hence the shared-memory swizzle, stays
  // the thread's own): thread row i = i0 + 8 i1 (i0 < 8) copies rows i0 + 8 m + 8 R i1 in its
  // passes m < R, so passes m and m + 1 (m even) share a group's lookup. H100 (ncu, MQA b 1 128k):
  // a lookup and address per row made the 16-token paged kernel run 22% more instructions than the
  // contiguous one, and 18% longer; this halves the lookups: paged d128 MQA 1.8-3.2% faster,
  // other d128 paged points 0.1-1.0%, d32 / d64 paged 1.2-6.6%, contiguous caches -1.5..+1.2%
  // (BENCHMARKS.md, session 27).
  // -DFLASHCUTE_KV_PAGE_GROUPS=0 builds the lookup per row.
  static constexpr int kKvPageGroup = FLASHCUTE_KV_PAGE_GROUPS ? 16 : 1;
  static constexpr int kKvPassStride = 8;  // rows between a thread's passes: the swizzle's period
  static constexpr int kKvPassesPerGroup = FLASHCUTE_KV_PAGE_GROUPS ? kKvPageGroup / kKvPassStride : 1;
  static constexpr int kKvRowThreads = kNThreads / Traits::kGmemThreadsPerRow;  // rows per copy pass
  static constexpr int kKvRowsPerThread = kBlockN / kKvRowThreads;               // R
  static_assert(!kKvCache || (kBlockN % kKvRowThreads == 0 && kKvRowThreads % kKvPassStride == 0 &&
                              kKvRowsPerThread % kKvPassesPerGroup == 0));
  using KvCopyRows = std::conditional_t<
      FLASHCUTE_KV_PAGE_GROUPS != 0,
      Layout<Shape<Shape<Int<kKvPassStride>, Int<kKvRowThreads / kKvPassStride>, Int<kKvRowsPerThread>>,
                   Int<kHeadDim>>,
             Stride<Stride<_1, Int<kKvPassStride * kKvRowsPerThread>, Int<kKvPassStride>>, Int<kBlockN>>>,
      Layout<Shape<Int<kBlockN>, Int<kHeadDim>>>>;

  // The one truth about shared memory: Q, then K and V; V^T is a view of V, and the epilogue's
  // O reuses Q's space. KV cache: the (page, row) of each 16-row group of two key tiles and the
  // page-table entries of two (small pages).
  struct SharedStorageQKV {
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutQ>> q;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutKV>> k;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutKV>> v;
  };
  struct SharedStorageKvCache : SharedStorageQKV {
    int2 page_rows[2][kBlockN / kKvPageGroup];   // tile n's (page, row) in [n % 2]
    int2 page_entries[2][kBlockN / kKvPageGroup];  // tile n's (entry as read, row) in [n % 2]
  };
  using SharedStorage = std::conditional_t<kKvCache, SharedStorageKvCache, SharedStorageQKV>;
  // CTAs per SM that the kernel's registers must allow (its launch bounds): decoding's tile as
  // many as its shared memory holds, up to three, four at d <= 64 (the split heuristic counts
  // them); the others none beyond one (ptxas's choice). Decoding's d128 windowed tile took 194
  // registers, two CTAs per SM, with the page table's entries read two tiles ahead; bounded, it
  // keeps three. d64's tiles, bounded to three, took 165 registers; to four, 128 with 24 bytes of
  // spills (d32: 128, none). d64 decoding, three -> four (H200, session 38, BENCHMARKS.md; the
  // heuristic's wave four too): MHA and GQA 32/8 at b 8 and 32 -8.6..-2.6% but for b 8 GQA at 8k
  // and 32k (-0.6..+1.3%); at b 1 contiguous MHA and GQA 8k and GQA 32k +1.4..+3.3%.
  static constexpr int kSmemCtasPerSm = int(227 * 1024 / sizeof(SharedStorage));
  static constexpr int kMaxDecodeCtasPerSm = kHeadDim <= 64 ? FLASHCUTE_KV_DECODE_D64_CTAS : 3;
  static constexpr int kMinCtasPerSm =
      Traits::kWarpsN == 1 ? 1 : std::clamp(kSmemCtasPerSm, 1, kMaxDecodeCtasPerSm);

  // Where sequence b's rows are (KV cache: its used cache positions).
  static CUTE_DEVICE SeqlenInfo seqlen_info(const FwdParams& p, int b) {
    if constexpr (kKvCache) {
      return SeqlenInfo::with_cache(p, b);
    } else {
      return SeqlenInfo(p, b);
    }
  }

  // This thread's O accumulator (cleared) and the number of rows of S / O it holds.
  using AccO = decltype(partition_fragment_C(TiledMmaO{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  static constexpr int kRows = decltype(size<0>(acc_rowcol(std::declval<AccO>().layout())))::value;
  static CUTE_DEVICE AccO make_acc_o() {
    AccO acc_o = partition_fragment_C(TiledMmaO{}, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_o);
    return acc_o;
  }

  template <typename AccO, typename Softmax>
  CUTE_DEVICE void run(const FwdParams& params, const FwdTile& tile, const SeqlenInfo& seqlen, AccO& acc_o,
                       Softmax& softmax, SharedStorage& smem) const {
    const int tidx = threadIdx.x;
    const int m_block = tile.m_block;
    const Mask mask(params, seqlen, kBlockM, kBlockN);
    auto kv = [&] {  // the walk over the key tiles to visit
      if constexpr (kKvCache) {
        return mask.kv_cursor(tile.bidb, tile.bidh, m_block).split(tile.split, params.num_splits);
      } else {
        return mask.kv_cursor(tile.bidb, tile.bidh, m_block);
      }
    }();
    const int bidh_kv = tile.bidh / params.h_per_kv();

    // ---- Global tensors of this (sequence, head): (rows, kHeadDim) with a unit last stride.
    Tensor mQ = head_tensor<Element, kHeadDim>(params.q, params.q_stride, tile.bidb, tile.bidh, seqlen.q,
                                               seqlen.q_offset);
    Tensor mK = head_tensor<Element, kHeadDim>(params.k, params.k_stride, tile.bidb, bidh_kv, seqlen.k,
                                               seqlen.k_offset);
    Tensor mV = head_tensor<Element, kHeadDim>(params.v, params.v_stride, tile.bidb, bidh_kv, seqlen.k,
                                               seqlen.k_offset);
    Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
    Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, n_tiles)
    Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));

    // ---- Shared memory: Q, K, V tiles; V^T is a view of sV.
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
    Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
    Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});

    // ---- Global -> shared copies, predicated on seqlen (rows) and headdim (columns).
    typename Traits::GmemTiledCopyQKV gmem_copy;
    auto gmem_thr = gmem_copy.get_thread_slice(tidx);
    Tensor tQgQ = gmem_thr.partition_S(gQ);
    Tensor tQsQ = gmem_thr.partition_D(sQ);
    Tensor tKgK = gmem_thr.partition_S(gK);  // (CPY, CPY_N, CPY_K, n_tiles)
    // (KV cache: K/V tiles through the copy's row order, KvCopyRows.)
    auto kv_copy_rows = [](auto const& t) {
      if constexpr (kKvCache) {
        return make_tensor(t.data(), composition(t.layout(), KvCopyRows{}));
      } else {
        return t;
      }
    };
    Tensor tKsK = gmem_thr.partition_D(kv_copy_rows(sK));
    Tensor tVgV = gmem_thr.partition_S(gV);
    Tensor tVsV = gmem_thr.partition_D(kv_copy_rows(sV));
    Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tKcK = gmem_thr.partition_S(kv_copy_rows(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{})));
    Tensor col_ok = column_predicate(tQcQ, params.headdim);  // same columns for Q, K, V

    // Loads of Q, and of K and V tile n (rows < rows_left valid; kCheckRows: zero-fill the rest).
    // KV cache: row by row, from tiles whose rows start at offset 0 (common/kvcache.h).
    const KvCacheRows cache{params, tile.bidb, tile.bidh, bidh_kv};
    auto rowless = [](const void* ptr, auto rows) {
      return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)),
                         make_layout(make_shape(rows, Int<kHeadDim>{}), make_stride(_0{}, _1{})));
    };
    Tensor tQgQ0 = gmem_thr.partition_S(rowless(params.q, Int<kBlockM>{}));
    Tensor tKgK0 = gmem_thr.partition_S(rowless(params.k, Int<kBlockN>{}));
    Tensor tVgV0 = gmem_thr.partition_S(rowless(params.v, Int<kBlockN>{}));
    auto load_q = [&]() __attribute__((always_inline)) {
      const int rows_left = seqlen.q - m_block * kBlockM;
      if constexpr (kKvCache) {
        copy_rows<true>(gmem_copy, tQgQ0, tQsQ, tQcQ, col_ok, rows_left,
                        [&](int r, int) { return cache.q_row(params.q_stride, m_block * kBlockM + r); });
      } else {
        copy_tile<true>(gmem_copy, tQgQ, tQsQ, tQcQ, col_ok, rows_left);
      }
    };
    auto load_kv = [&](auto check_rows, auto& tgmem, auto& tgmem0, auto& tsmem, const Strides& stride, int n,
                       int rows_left) __attribute__((always_inline)) {
      constexpr bool kCheck = decltype(check_rows)::value;
      if constexpr (kKvCache) {
        if (cache.tile_in_one_page(kBlockN)) {  // one page lookup per tile (contiguous: one "page")
          const int64_t row0 = cache.kv_row(stride, n * kBlockN);
          copy_rows<kCheck>(gmem_copy, tgmem0, tsmem, tKcK, col_ok, rows_left,
                            [&](int r, int) { return row0 + r * stride.row; });
        } else {  // small pages: the rows' groups, published by publish_rows
          int2 group;  // (page, row) of the group of the thread's rows of passes m, m + 1 (m even)
          copy_rows<kCheck>(gmem_copy, tgmem0, tsmem, tKcK, col_ok, rows_left, [&](int r, int m) {
            if (m % kKvPassesPerGroup == 0) group = smem.page_rows[n % 2][r / kKvPageGroup];
            return cache.kv_offset(stride, group.x, group.y + r % kKvPageGroup);
          });
        }
      } else {
        copy_tile<kCheck>(gmem_copy, tgmem(_, _, _, n), tsmem, tKcK, col_ok, rows_left);
      }
    };
    // KV cache with small pages: the page table read once per 16-row group of tile n (a thread per
    // group), into shared memory, rather than once per row and copy pass by every thread (16-token
    // pages: 0.76-0.94x the contiguous cache's speed with the latter, BENCHMARKS.md). In two stages,
    // so that no step waits for the table: fetch_rows(n) copies tile n's entries into slot n % 2 of
    // page_entries by cp.async at the top of the step two tiles before tile n's (committed with
    // that step's V tile), and publish_rows(n) clamps them into the pool and stores (page, row) in
    // slot n % 2 of page_rows at the top of the next step, after its copy wait and before the
    // __syncthreads that precedes tile n's K load. (The lookup made right before that barrier held
    // every warp at it for the table's latency: MQA, b 32, 128k, ncu on the H200: barrier stalls
    // 0.22 -> 0.79 per issued instruction, 18% longer than the contiguous cache.) Thread g < the
    // tile's groups handles group g; it publishes the entries it fetched, after a cp.async wait;
    // page_entries slot n % 2 was last read by its publish two steps ago, page_rows slot n % 2 by
    // the copies of two tiles ago. (A group past seqlen_k maps to the last position's page: its
    // rows are not loaded.)
    constexpr int kPageGroups = kBlockN / kKvPageGroup;
    static_assert(kPageGroups <= kNThreads, "a thread per group of a tile");
    auto group_start = [&](int n) { return min(n * kBlockN + tidx * kKvPageGroup, seqlen.k - 1); };
    auto owns_page_group = [&] { return !cache.tile_in_one_page(kBlockN) && tidx < kPageGroups; };
    auto fetch_rows = [&](int n) __attribute__((always_inline)) {
      if constexpr (kKvCache) {
        if (owns_page_group()) {
          const int t = group_start(n);
          int2& entry = smem.page_entries[n % 2][tidx];
          SM80_CP_ASYNC_CACHEALWAYS<int>::copy(cache.table_entry(t), entry.x);
          entry.y = t % params.page_size;
        }
      }
    };
    auto publish_rows = [&](int n) __attribute__((always_inline)) {
      if constexpr (kKvCache) {
        if (owns_page_group()) {
          const int2 entry = smem.page_entries[n % 2][tidx];
          smem.page_rows[n % 2][tidx] = make_int2(cache.clamp_page(entry.x), entry.y);
        }
      }
    };
    auto load_k = [&](auto check_rows, int n, int rows_left) __attribute__((always_inline)) {
      load_kv(check_rows, tKgK, tKgK0, tKsK, params.k_stride, n, rows_left);
    };
    auto load_v = [&](auto check_rows, int n, int rows_left) __attribute__((always_inline)) {
      load_kv(check_rows, tVgV, tVgV0, tVsV, params.v_stride, n, rows_left);
    };

    // ---- The tiled MMAs and their register fragments. Warps side by side: a warp's O GEMM reads
    // the V rows of its own keys.
    TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tidx);
    TiledMmaO tiled_mma_o;
    auto thr_mma_o = tiled_mma_o.get_thread_slice(Traits::o_thread(tidx));
    auto own_keys = [&](auto const& vt) {
      if constexpr (Traits::kWarpsN == 1) {
        return vt;
      } else {
        return local_tile(vt, Shape<Int<kHeadDim>, _32>{}, make_coord(0, tidx / 32));
      }
    };
    Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
    Tensor tSrK = thr_mma.partition_fragment_B(sK);
    Tensor tOrVt = thr_mma_o.partition_fragment_B(own_keys(sVtNoSwizzle));

    // Shared -> register copies: ldmatrix for Q and K, transposing ldmatrix for V^T.
    auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto smem_thr_q = smem_copy_q.get_thread_slice(tidx);
    Tensor tSsQ = smem_thr_q.partition_S(sQ);
    auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
    auto smem_thr_k = smem_copy_k.get_thread_slice(tidx);
    Tensor tSsK = smem_thr_k.partition_S(sK);
    auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, tiled_mma_o);
    auto smem_thr_v = smem_copy_v.get_thread_slice(Traits::o_thread(tidx));
    Tensor tOsVt = smem_thr_v.partition_S(own_keys(sVt));

    // (row, col) of each accumulator element of S inside its tile, as a (rows, cols) view.
    Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cS = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
    Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));

    // KV cache: Q's load goes out before anything that waits for the cache's length (read at the
    // kernel's top), so that only the key range and the first K tile's addresses follow that read.
    // With the 3-D grid (common/scheduler.h), whose tile needs no division before that read: b = 1
    // decoding 0.2-1.8% faster on the H200, the bigger calls within +-0.5%, windowed decoding 3-5%
    // (session 40). The score-mod kernels (softcap, ALiBi) keep the order below, Q's load after
    // the first tile's pages: with this one their d128 kernel spilled 16/16 bytes and softcap
    // decoding ran 1-4% slower (session 40).
    constexpr bool kEarlyQ = kKvCache && !kScoreMod;
    if constexpr (kEarlyQ) {
      load_q();
      cp_async_fence();
    }
    // No key: the epilogue writes O = 0. (Tested here, after the setup: returning before it cost
    // the loop 5 more spilled registers, measured with ptxas.)
    if (!kv.valid()) {
      if constexpr (kEarlyQ) {  // every thread's part of Q has landed before the epilogue's shared memory use
        cp_async_wait<0>();
        __syncthreads();
      }
      return;
    }

    // ---- Prologue: Q and the first K tile in flight.
    if constexpr (kKvCache) {
      // The first tile's pages (small pages; the next one's fetched with them), then Q.
      if (kScoreMod || !cache.tile_in_one_page(kBlockN)) {
        fetch_rows(kv.tile());
        cp_async_fence();
        if constexpr (!kEarlyQ) load_q();
        if (kv.next_tile() >= 0) fetch_rows(kv.next_tile());
        cp_async_fence();
        cp_async_wait<1>();  // the first tile's pages (and an early Q)
        publish_rows(kv.tile());
        __syncthreads();
      }
    } else {
      load_q();
    }
    load_k(/*check_rows=*/cute::true_type{}, kv.tile(), seqlen.k - kv.tile() * kBlockN);
    cp_async_fence();

    // ---- One step of the main loop, on key tile n_block; n_next: the next one (-1: none).
    auto step = [&](int n_block, int n_next, auto is_first, auto is_masked) __attribute__((always_inline)) {
      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      cp_async_wait<0>();
      if (n_next >= 0) publish_rows(n_next);
      if constexpr (kKvCache) {  // the pages of the tile after n_next, a step ahead
        auto ahead = kv;
        ahead.advance();
        if (n_next >= 0 && ahead.next_tile() >= 0) fetch_rows(ahead.next_tile());
      }
      __syncthreads();  // K_j has landed; every warp is done with V of the previous step

      // V_j's load overlaps S = Q K_j^T. A partial tile (at seqlen_k: dense, the first one; in
      // any case a masked one) has its rows past seqlen_k zero-filled (P is 0 there, and
      // 0 * garbage could be NaN).
      constexpr bool kCheckRowsV = Mask::kPartialTileFirst ? decltype(is_first)::value : decltype(is_masked)::value;
      load_v(cute::bool_constant<kCheckRowsV>{}, n_block, seqlen.k - n_block * kBlockN);
      cp_async_fence();

      // S = Q K_j^T; the score modification on every tile, the mask on tiles with masked scores.
      gemm_ss(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, smem_copy_q, smem_copy_k, smem_thr_q, smem_thr_k);
      Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      if constexpr (kScoreMod) {
        const auto pack = [&] {  // the rows per position ScoreMod sees: C<1> but in the row-slope kernels
          if constexpr (kRowSlopes) return mask.pack; else return cute::C<1>{};
        }();
        ScoreMod(params, seqlen, tile.bidb, tile.bidh, pack).premask(s_rc, cS, m_block * kBlockM, n_block * kBlockN);
      }
      if constexpr (decltype(is_masked)::value) mask.apply(s_rc, cS, m_block * kBlockM, n_block * kBlockN);

      cp_async_wait<0>();
      __syncthreads();  // V_j has landed; every warp is done with K_j
      // The next K tile's load overlaps the softmax and O += P V_j.
      if (n_next >= 0) {
        const int rows_next = seqlen.k - n_next * kBlockN;
        if (!Mask::kPartialTileFirst && rows_next < kBlockN) {
          load_k(cute::true_type{}, n_next, rows_next);
        } else {
          load_k(cute::false_type{}, n_next, kBlockN);
        }
        cp_async_fence();
      }

      // Online softmax: m, l and O rescaled; S becomes P.
      softmax.template step<decltype(is_first)::value>(s_rc, o_rc, params.softmax_scale_log2);

      // O += P V_j, P converted to the input type in registers and used as the A operand.
      Tensor rP = convert_fragment<Element>(acc_s);
      // Dropout: P *= keep, after l has counted every score (O is scaled by 1 / (1 - p) at the end).
      if constexpr (kScoreMod && !kKvCache) {
        if (params.has_dropout()) {
          const DropoutMap dropout(params, tile.bidb, tile.bidh);
          Tensor p_rc = make_tensor(rP.data(), acc_rowcol(rP.layout()));
          dropout.apply(p_rc, dropout.draw_all(cS, m_block * kBlockM, n_block * kBlockN));
        }
      }
      Tensor tOrP = make_tensor(rP.data(), acc_as_A(rP.layout()));
      gemm_rs(tiled_mma_o, acc_o, tOrP, tOrVt, tOsVt, smem_copy_v, smem_thr_v);
    };

    // ---- Main loop over the key tiles the policy lists, in runs of tiles with masked scores and
    // runs without. Dense, the tiles come last to first, so the masked ones at seqlen_k and on
    // the right window edge come first; a left window edge or a sparse list can bring masked
    // runs back later.
    step(kv.tile(), kv.next_tile(), /*is_first=*/cute::true_type{}, /*is_masked=*/cute::true_type{});
    kv.advance();
    mask.walk_in_runs(m_block, kv, [&](auto is_masked) __attribute__((always_inline)) {
      step(kv.tile(), kv.next_tile(), cute::false_type{}, is_masked);
    });
  }
};

}  // namespace flashcute::sm80
