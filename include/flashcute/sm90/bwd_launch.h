// flashcute — the sm90 backward launcher: the workspace, and the three stages (the shared
// preprocess, the main kernel with the call's policies and TMA descriptors, the shared dQ
// conversion in this family's thread order), each launched on its own by the op.
#pragma once

#include <type_traits>

#include "flashcute/common/bwd_pre_post.h"
#include "flashcute/common/dispatch.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"
#include "flashcute/sm90/bwd_kernel.h"
#include "flashcute/sm90/epilogue_bwd.h"
#include "flashcute/sm90/mainloop_bwd.h"
#include "flashcute/sm90/traits.h"

namespace flashcute::sm90 {

template <typename Element, int kHeadDim>
BwdWorkspace bwd_workspace(const BwdParams& params, int num_sms) {
  static_assert(BwdConfig<kHeadDim, Element, false>::Traits::kBlockN == BwdConfig<kHeadDim, Element, true>::Traits::kBlockN);
  return make_bwd_workspace(params, num_sms, BwdConfig<kHeadDim, Element, false>::Traits::kBlockN, kHeadDim);
}

template <typename Element, int kHeadDim>
void run_bwd_stage(BwdStage stage, const BwdParams& params, const BwdWorkspace& ws, cudaStream_t stream) {
  // The tiles depend on whether the main kernel has dropout's code and a mask (BwdConfig), and the
  // dQ conversion reads the accumulator in the order of the main kernel's tiles: every stage of a
  // call picks them from the same policy choice.
  with_policies<void>(params, [&](auto mask, auto score_mod, auto dropout) {
    using Mask = typename decltype(mask)::type;
    using Traits =
        typename BwdConfig<kHeadDim, Element, decltype(dropout)::value, !Mask::kWindow && !Mask::kSparse>::Traits;
    if (stage != BwdStage::kMain) {
      // (The swapped S/dP leave the dQ GEMM's tiles and thread order as they are: one conversion
      // kernel serves both.)
      using PrePost = typename BwdConfig<kHeadDim, Element, decltype(dropout)::value>::Traits;
      static_assert(PrePost::kBlockM == Traits::kBlockM &&
                    std::is_same_v<typename PrePost::TiledMmadQ, typename Traits::TiledMmadQ>);
      launch_bwd_pre_post<PrePost, 90>(stage, params, ws, stream);
      return;
    }
    check_sparse_tiles(params.sparse, Traits::kBlockM, Traits::kBlockN);
    using Mainloop = MainloopBwd<Traits, Mask, score_mod, dropout>;
    using Scheduler = PersistentKvTileScheduler<Traits::kBlockN>;
    launch_kernel_chained(&flashcute_bwd_kernel<Mainloop, EpilogueBwd<Traits>, Scheduler>,
                          Scheduler::grid(params, ws.num_splits), Traits::kNThreads,
                          int(sizeof(typename Mainloop::SharedStorage)), stream,
                          Mainloop::to_params(params, dq_accum_shape(params, ws)));
  });
}

}  // namespace flashcute::sm90
