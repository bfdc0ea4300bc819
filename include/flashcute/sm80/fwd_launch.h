// flashcute — the sm80 forward launcher: the mask policy of the call, the kernel's types,
// grid and shared memory.
#pragma once

#include <algorithm>

#include "flashcute/common/dispatch.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"
#include "flashcute/sm80/epilogue_fwd.h"
#include "flashcute/sm80/fwd_kernel.h"
#include "flashcute/sm80/mainloop_fwd.h"
#include "flashcute/sm80/traits.h"

namespace flashcute::sm80 {

template <typename Traits, typename Mask, bool kScoreMod>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
  check_sparse_tiles(params.sparse, Traits::kBlockM, Traits::kBlockN);
  using Mainloop = MainloopFwd<Traits, Mask, kScoreMod>;
  using Scheduler = SingleTileScheduler<Traits::kBlockM, Mask::kWindow, /*kGrid3D=*/!kScoreMod>;
  launch_kernel(&flashcute_fwd_kernel<Mainloop, EpilogueFwd<Traits>, Scheduler>, Scheduler::grid(params),
                Traits::kNThreads, int(sizeof(typename Mainloop::SharedStorage)), stream, params);
}

template <typename Element, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  // Dropout runs in the score-mod variant (a run-time branch): on sm90 GPUs the sm90 family's
  // forward serves it.
  with_policies<CausalMask>(params, [&](auto mask, auto score_mod, auto dropout) {
    launch_fwd<typename FwdConfig<kHeadDim, Element>::Traits, typename decltype(mask)::type,
               decltype(score_mod)::value || decltype(dropout)::value>(params, stream);
  });
}

// KV cache: FA2's decoding tiles (64 query rows, 4 warps; 128 keys per step up to d = 128, 64
// above) so that two or more CTAs share an SM and GQA packing fills the rows; split-KV partials.
// Calls without softcap or ALiBi whose packed query rows fit in 16 (decoding one position with up
// to 16 query heads per KV head) take decoding's tile: 16 rows, the warps side by side along the
// keys (traits.h), a quarter of the MMA work per key tile for the same bytes (cuDNN's decode
// kernel is 16 x 128 x 128 with 1 x 4 x 1 warps). Measured (bf16, d128, 32 query heads, CUDA
// graphs, against the 64-row tile, alternating processes; BENCHMARKS.md, session 26): on the H200
// MHA and GQA 32/8 at b 8-32 -0.3..-9.0% on contiguous caches and -7.6..-15.9% on 16-token pages
// (its DRAM throughput at b 8, 32k MHA 80% -> 94%, ncu), at b 1 -2.4..+0.4% (pages -2.4..-9.9%);
// on the H100, whose memory the 64-row tile already kept busy (93%), -1.7..+2.6%. (A 16-row tile
// of one warp gained as much on the H200 at b >= 8 but lost 8-35% at b = 1 and with small pages,
// its one warp issuing every load.) MQA's 32 packed rows stay on the 64-row tile, and so do
// calls with softcap or ALiBi: two kernels per unit fewer, for build time.
#ifndef FLASHCUTE_KV_DECODE_ROWS  // 0: every call on the 64-row tile (for A/B runs)
#define FLASHCUTE_KV_DECODE_ROWS 16
#endif
// (Decoding's tile: a warp per 32 keys of the tile.)
template <int kHeadDim, typename Element, int kRows = 64, int kBlockN = (kHeadDim <= 128 ? 128 : 64)>
using KvCacheTraits = KernelTraits<kHeadDim, kRows, kBlockN, kRows == 64 ? 4 : kBlockN / 32, Element,
                                   kRows == 64 ? 1 : kBlockN / 32>;
// Whether a call (params.seqlen_q query positions, pack_gqa heads each) runs on decoding's tile.
inline bool kvcache_decode_tile(const FwdParams& p) {
  return FLASHCUTE_KV_DECODE_ROWS > 0 && !p.has_score_mod() &&
         int64_t(p.seqlen_q) * p.pack_gqa <= FLASHCUTE_KV_DECODE_ROWS;
}

template <typename Traits, typename Mask, bool kScoreMod, bool kRowSlopes = false>
using KvCacheMainloop = MainloopFwd<Traits, Mask, kScoreMod, /*kKvCache=*/true, kRowSlopes>;

// The tile of a call and how many of its CTAs the split heuristic counts per SM (its wave): two
// 64-row CTAs (FA2's count); decoding's as many as are resident (up to three, four at d <= 64;
// d128: the 227 KB of an sm90 SM hold three), except d128 on a contiguous cache: two. Measured on
// the H200 (bf16, 32 query heads, CUDA graphs, forced splits against the heuristic in one process,
// 4 interleaved rounds, BENCHMARKS.md session 38): d128 contiguous with a wave of two,
// -0.7..-2.7% at the 8 decode-grid points where the split count changes (b 1 GQA 32/8 32k 43 -> 32
// splits, 40.0 -> 39.3 us); with two, 16-token pages +0.6..+1.7% at 6 of those 8 (-1.2..-0.0 at
// 2) and d64 (then three resident) +4..+13% at all 8; a wave of four lost 6-21%.
template <typename Traits>
void kvcache_tile_of(const FwdParams& params, int& block_m, int& block_n, int& ctas_per_sm) {
  using Mainloop = KvCacheMainloop<Traits, AttentionMask<false, false, true>, false>;
  block_m = Traits::kBlockM;
  block_n = Traits::kBlockN;
  const bool contiguous_d128 = Traits::kHeadDim == 128 && params.block_table == nullptr;
  const int resident = Mainloop::kMinCtasPerSm;
  ctas_per_sm = Traits::kWarpsN == 1 ? 2 : contiguous_d128 ? std::min(2, resident) : resident;
}
template <typename Element, int kHeadDim>
void kvcache_tiles(const FwdParams& params, int& block_m, int& block_n, int& ctas_per_sm) {
  if (kvcache_decode_tile(params)) {
    kvcache_tile_of<KvCacheTraits<kHeadDim, Element, 16>>(params, block_m, block_n, ctas_per_sm);
  } else {
    kvcache_tile_of<KvCacheTraits<kHeadDim, Element>>(params, block_m, block_n, ctas_per_sm);
  }
}

template <typename Element, int kHeadDim>
void run_fwd_kvcache(const FwdParams& call, cudaStream_t stream) {
  FwdParams params = call;
  const bool decode = kvcache_decode_tile(params);
  const bool packed_alibi = params.alibi_slopes != nullptr && params.pack_gqa > 1;  // the row-slope kernels
  params.seqlen_q *= params.pack_gqa;  // the kernel's query rows: (position, head) pairs
  // Softcap or ALiBi calls keep their dense variant here (unlike with_policies): on the windowed
  // one, decoding with softcap took 1-6% longer (H100, BENCHMARKS.md "Feature calls on the
  // windowed kernels"), for 14% of this unit's compile time.
  dispatch_window(params, [&](auto window) {
    dispatch_bool(params.has_score_mod(), [&](auto score_mod) {
      using Mask = AttentionMask<decltype(window)::value, /*kSparse=*/false, /*kPack=*/true>;
      auto launch = [&](auto traits, auto row_slopes) {
        using Traits = typename decltype(traits)::type;
        using Mainloop = KvCacheMainloop<Traits, Mask, decltype(score_mod)::value, decltype(row_slopes)::value>;
        using Scheduler = KvCacheTileScheduler<Traits::kBlockM>;
        launch_kernel_chained(&flashcute_fwd_kernel<Mainloop, EpilogueFwdPartial<Traits>, Scheduler>,
                              Scheduler::grid(params), Traits::kNThreads,
                              int(sizeof(typename Mainloop::SharedStorage)), stream, params);
      };
      if constexpr (!decltype(score_mod)::value) {
        if (decode) {
          launch(TypeTag<KvCacheTraits<kHeadDim, Element, 16>>{}, std::false_type{});
        } else {
          launch(TypeTag<KvCacheTraits<kHeadDim, Element>>{}, std::false_type{});
        }
      } else {
        dispatch_bool(packed_alibi,
                      [&](auto row_slopes) { launch(TypeTag<KvCacheTraits<kHeadDim, Element>>{}, row_slopes); });
      }
    });
  });
}

}  // namespace flashcute::sm80
