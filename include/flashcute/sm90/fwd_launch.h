// flashcute — the sm90 forward launcher: the mask policy of the call, the TMA descriptors, the
// kernel's types, grid and shared memory.
#pragma once

#include <algorithm>

#include "flashcute/common/dispatch.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"
#include "flashcute/sm90/epilogue_fwd.h"
#include "flashcute/sm90/fwd_kernel.h"
#include "flashcute/sm90/mainloop_fwd.h"
#include "flashcute/sm90/traits.h"

namespace flashcute::sm90 {

// Persistent CTAs (common/scheduler.h) where each tile's key range is short and the tiles of a
// call have equal work (no packed batch, cache or block-sparse list: the hardware's own
// scheduling balances those), and where O has a buffer of its own (Traits::kPersistent).
// Measured on the H100 (bf16, 16k tokens, d64 / d128, against one CTA per tile, alternating
// processes): non-causal seqlen 512 -15% / -7..-9%, 1024 -8..-9% / -4..-5%, 2048 -1..-3% / -2..-3%;
// causal (pairs of query blocks) 512 -17% / -11%, 1024 -12% / -10%, 2048 -8% / -9%. At 4096-16384
// keys the two grids ran within this comparison's noise (two builds of the same code differed by
// up to 6.5% at 4096): the bound is 4096 keys (docs/NOTES.md, session 16; the macro below moves it).
#ifndef FLASHCUTE_SM90_FWD_PERSISTENT_MAX_KEYS
#define FLASHCUTE_SM90_FWD_PERSISTENT_MAX_KEYS 4096
#endif
// The keys a query tile can see: seqlen_k, or the band of a window with both edges.
inline int64_t fwd_key_range(const FwdParams& p, int block_m, int block_n) {
  int64_t keys = p.seqlen_k;
  if (p.window_left >= 0 && p.window_right >= 0) {
    keys = std::min<int64_t>(keys, int64_t(p.window_left) + p.window_right + block_m + block_n);
  }
  return keys;
}
template <typename Traits>
bool persistent_fwd(const FwdParams& p) {
  return Traits::kPersistent &&
         fwd_key_range(p, Traits::kBlockM, Traits::kBlockN) <= FLASHCUTE_SM90_FWD_PERSISTENT_MAX_KEYS &&
         !p.is_varlen() && p.cache_seqlens == nullptr && !p.sparse.enabled();
}

template <typename Traits, typename Mask>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
  check_sparse_tiles(params.sparse, Traits::kBlockM, Traits::kBlockN);
  using Mainloop = MainloopFwd<Traits, Mask>;
  using Scheduler = PersistentTileScheduler<Traits::kBlockM, Mask::kWindow>;
  FwdParams p = params;
  if (!persistent_fwd<Traits>(p)) p.num_sms = 0;  // one CTA per tile
  launch_kernel(&flashcute_fwd_kernel<Mainloop, EpilogueFwd<Traits>, Scheduler>, Scheduler::grid(p),
                Traits::kNThreads, int(sizeof(typename Mainloop::SharedStorage)), stream, Mainloop::to_params(p));
}

// Query rows per tile. d <= 64: 192 (three consumer warpgroups, FlashAttention-3's d64 tile) for
// dense calls, and for causal or windowed ones whose key range is long; 128 for block-sparse
// calls (their blocks are 128 rows) and for short causal or windowed ones, where a taller tile
// computes more of the masked triangle. Measured on the H100 (bf16, 16k tokens, d64, 192 against
// 128 rows, alternating processes): non-causal 2048-16384 -5..-11%, 512-1024 -3..+0.5%; causal
// 512-2048 +21..27% (hence 128 there), 4096-16384 -3..-8% (docs/NOTES.md, session 20).
#ifndef FLASHCUTE_SM90_FWD_TALL_BLOCK_M
#define FLASHCUTE_SM90_FWD_TALL_BLOCK_M 192
#endif
// Keys per step of the d128 dense kernel for key ranges over 4096 (one CTA per tile):
// FlashAttention-3's 128 x 176 tile, fewer steps, barriers and O rescales per key; forward 3.4%
// / 3.6% faster at 8k / 16k tokens than 128 keys (H100, docs/NOTES.md session 23). It has no
// dropout or score-mod code (MainloopFwd::kFeatures): calls with them keep 128 keys, as do
// shorter ranges (the persistent kernel; 4096 keys would be 24 tiles of 176, 3% of them masked).
#ifndef FLASHCUTE_SM90_FWD_WIDE_BLOCK_N
#define FLASHCUTE_SM90_FWD_WIDE_BLOCK_N 176
#endif
template <typename Element, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  with_mask_policy(params, [&](auto mask) {
    using Mask = typename decltype(mask)::type;
    using Short = typename FwdConfig<kHeadDim, Element>::Traits;
    if constexpr (kHeadDim > 64 || Mask::kSparse || FLASHCUTE_SM90_FWD_TALL_BLOCK_M == Short::kBlockM) {
      using Wide = typename FwdConfig<kHeadDim, Element, 128, FLASHCUTE_SM90_FWD_WIDE_BLOCK_N>::Traits;
      if constexpr (kHeadDim == 128 && !Mask::kWindow && !Mask::kSparse && Wide::kBlockN != Short::kBlockN) {
        if (!params.has_dropout() && !params.has_score_mod() &&
            fwd_key_range(params, Short::kBlockM, Short::kBlockN) > FLASHCUTE_SM90_FWD_PERSISTENT_MAX_KEYS) {
          launch_fwd<Wide, Mask>(params, stream);
          return;
        }
      }
      launch_fwd<Short, Mask>(params, stream);
    } else {
      using Tall = typename FwdConfig<kHeadDim, Element, FLASHCUTE_SM90_FWD_TALL_BLOCK_M>::Traits;
      // (Two launch sites of Tall: folding them into one run-time test would instantiate the
      // 128-row dense kernel, which no call runs.)
      if constexpr (!Mask::kWindow) {
        launch_fwd<Tall, Mask>(params, stream);
      } else if (fwd_key_range(params, Short::kBlockM, Short::kBlockN) > FLASHCUTE_SM90_FWD_PERSISTENT_MAX_KEYS) {
        launch_fwd<Tall, Mask>(params, stream);
      } else {
        launch_fwd<Short, Mask>(params, stream);
      }
    }
  });
}

}  // namespace flashcute::sm90
