// flashcute — the sm90 forward launcher: the mask policy of the call, the TMA descriptors, the
// kernel's types, grid and shared memory.
#pragma once

#include "flashcute/common/dispatch.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"
#include "flashcute/sm90/epilogue_fwd.h"
#include "flashcute/sm90/fwd_kernel.h"
#include "flashcute/sm90/mainloop_fwd.h"
#include "flashcute/sm90/traits.h"

namespace flashcute::sm90 {

template <typename Traits, typename Mask>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
  check_sparse_tiles(params.sparse, Traits::kBlockM, Traits::kBlockN);
  using Mainloop = MainloopFwd<Traits, Mask>;
  using Scheduler = SingleTileScheduler<Traits::kBlockM, Mask::kWindow>;
  launch_kernel(&flashcute_fwd_kernel<Mainloop, EpilogueFwd<Traits>, Scheduler>, Scheduler::grid(params),
                Traits::kNThreads, int(sizeof(typename Mainloop::SharedStorage)), stream,
                Mainloop::to_params(params));
}

template <typename Element, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  with_mask_policy(params, [&](auto mask) {
    launch_fwd<typename FwdConfig<kHeadDim, Element>::Traits, typename decltype(mask)::type>(params, stream);
  });
}

}  // namespace flashcute::sm90
