// flashcute — the sm80 backward launcher: the workspace, and the three stages (preprocess, main
// kernel with the call's mask policy, dQ conversion), each launched on its own by the op.
#pragma once

#include "flashcute/common/bwd_pre_post.h"
#include "flashcute/common/dispatch.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"
#include "flashcute/sm80/bwd_kernel.h"
#include "flashcute/sm80/epilogue_bwd.h"
#include "flashcute/sm80/mainloop_bwd.h"
#include "flashcute/sm80/traits.h"

namespace flashcute::sm80 {

template <typename Element, int kHeadDim>
BwdWorkspace bwd_workspace(const BwdParams& params, int num_sms) {
  return make_bwd_workspace(params, num_sms, BwdConfig<kHeadDim, Element>::Traits::kBlockN, kHeadDim);
}

template <typename Element, int kHeadDim>
void run_bwd_stage(BwdStage stage, const BwdParams& params, const BwdWorkspace& ws, cudaStream_t stream) {
  using Traits = typename BwdConfig<kHeadDim, Element>::Traits;
  if (stage != BwdStage::kMain) {
    launch_bwd_pre_post<Traits, 80>(stage, params, ws, stream);
    return;
  }
  check_sparse_tiles(params.sparse, Traits::kBlockM, Traits::kBlockN);
  const DqAccumShape acc = dq_accum_shape(params, ws);
  with_policies<PaddedCausalMask>(params, [&](auto mask, auto score_mod, auto dropout) {
    using Mainloop = MainloopBwd<Traits, typename decltype(mask)::type, score_mod, dropout>;
    const int num_x = params.deterministic ? ws.num_splits : ceil_div_int(params.seqlen_k, Traits::kBlockN);
    launch_kernel_chained(&flashcute_bwd_kernel<Mainloop, EpilogueBwd<Traits>, KvTileScheduler>,
                          KvTileScheduler::grid(params, num_x), Traits::kNThreads,
                          int(sizeof(typename Mainloop::SharedStorage)), stream, params, acc);
  });
}

}  // namespace flashcute::sm80
