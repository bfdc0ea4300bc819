// flashcute — the sm80 forward launcher: the mask policy of the call, the kernel's types,
// grid and shared memory.
#pragma once

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
  using Scheduler = SingleTileScheduler<Traits::kBlockM, Mask::kWindow>;
  launch_kernel(&flashcute_fwd_kernel<Mainloop, EpilogueFwd<Traits>, Scheduler>, Scheduler::grid(params),
                Traits::kNThreads, int(sizeof(typename Mainloop::SharedStorage)), stream, params);
}

template <typename Element, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  // Dropout runs in the score-mod variant (a run-time branch): on sm90 GPUs the sm90 family's
  // forward serves it.
  with_policies(params, [&](auto mask, auto score_mod, auto dropout) {
    launch_fwd<typename FwdConfig<kHeadDim, Element>::Traits, typename decltype(mask)::type,
               decltype(score_mod)::value || decltype(dropout)::value>(params, stream);
  });
}

// KV cache: FA2's decoding tiles (64 query rows, 4 warps; 128 keys per step up to d = 128, 64
// above) so that two or more CTAs share an SM and GQA packing fills the rows; split-KV partials.
template <int kHeadDim, typename Element>
using KvCacheTraits = KernelTraits<kHeadDim, 64, kHeadDim <= 128 ? 128 : 64, 4, Element>;

template <typename Element, int kHeadDim>
void kvcache_tiles(int& block_m, int& block_n) {
  block_m = KvCacheTraits<kHeadDim, Element>::kBlockM;
  block_n = KvCacheTraits<kHeadDim, Element>::kBlockN;
}

template <typename Element, int kHeadDim>
void run_fwd_kvcache(const FwdParams& call, cudaStream_t stream) {
  using Traits = KvCacheTraits<kHeadDim, Element>;
  FwdParams params = call;
  params.seqlen_q *= params.pack_gqa;  // the kernel's query rows: (position, head) pairs
  // Softcap or ALiBi calls keep their dense variant here (unlike with_policies): on the windowed
  // one, decoding with softcap took 1-6% longer (H100, BENCHMARKS.md "Feature calls on the
  // windowed kernels"), for 14% of this unit's compile time.
  dispatch_window(params, [&](auto window) {
    dispatch_bool(params.has_score_mod(), [&](auto score_mod) {
      using Mask = AttentionMask<decltype(window)::value, /*kSparse=*/false, /*kPack=*/true>;
      using Mainloop = MainloopFwd<Traits, Mask, decltype(score_mod)::value, /*kKvCache=*/true>;
      using Scheduler = KvCacheTileScheduler<Traits::kBlockM>;
      launch_kernel_chained(&flashcute_fwd_kernel<Mainloop, EpilogueFwdPartial<Traits>, Scheduler>,
                            Scheduler::grid(params), Traits::kNThreads, int(sizeof(typename Mainloop::SharedStorage)),
                            stream, params);
    });
  });
}

}  // namespace flashcute::sm80
