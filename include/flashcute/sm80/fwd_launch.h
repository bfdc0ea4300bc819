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
  with_policies(params, [&](auto mask, auto score_mod) {
    launch_fwd<typename FwdConfig<kHeadDim, Element>::Traits, typename decltype(mask)::type, score_mod>(params, stream);
  });
}

}  // namespace flashcute::sm80
