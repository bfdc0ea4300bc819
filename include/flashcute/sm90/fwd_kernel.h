// flashcute — the sm90 forward kernel: FlashAttention-2's Algorithm 1 on Hopper, warp-
// specialised. Warpgroup 0 is the producer (one lane issues the TMA copies of mainloop_fwd.h's
// load(), with few registers); the other warpgroups are consumers (mma(), then the epilogue),
// with the registers setmaxnreg moves to them. A CTA computes one tile or, persistent, several.
// The same template signature as the sm80 family's kernel, so the launcher picks the family and
// nothing else.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/softmax.h"
#include "flashcute/params.h"

namespace flashcute::sm90 {

template <typename Mainloop, typename Epilogue, typename Scheduler>
__global__ void __launch_bounds__(Mainloop::kNThreads, 1)
    flashcute_fwd_kernel(__grid_constant__ const typename Mainloop::Params params,
                         __grid_constant__ const typename Scheduler::Divmods divmods) {
  using Traits = typename Mainloop::Traits;
  extern __shared__ __align__(1024) char smem_buf[];
  auto& smem = *reinterpret_cast<typename Mainloop::SharedStorage*>(smem_buf);

  if (threadIdx.x == 0) Mainloop::init(params, smem);
  __syncthreads();  // the last CTA-wide barrier: the roles split below

  // Both roles walk the same tiles: a persistent CTA's share (common/scheduler.h), or one. Tiles
  // past their sequence (packed batches) are skipped by both.
  // (with_cache: KV-cache calls run here too, dispatch.cu; their keys are the used positions.)
  auto for_each_tile = [&](auto&& fn) {
    auto visit = [&](const FwdTile& tile) {
      const SeqlenInfo seqlen = SeqlenInfo::with_cache(params.p, tile.bidb);
      if (tile.m_block * Mainloop::kBlockM < seqlen.q) fn(tile, seqlen);
    };
    if constexpr (Traits::kPersistent) {
      const int num_tiles = Scheduler::num_tiles(params.p);
      const bool persistent = Scheduler::persistent(params.p);
      for (int t = Scheduler::first(persistent); t < num_tiles; t = Scheduler::next(persistent, t)) {
        visit(Scheduler::tile(divmods, persistent, t));
      }
    } else {  // (no loop: the d256 windowed kernels spilled 24 more bytes with it)
      visit(Scheduler::get(params.p));
    }
  };
  typename Mainloop::PipelineState pipe;
  if (threadIdx.x < 128) {  // producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x >= 32 || !cute::elect_one_sync()) return;  // one lane issues every copy
    for_each_tile([&](const FwdTile& tile, const SeqlenInfo& seqlen) {
      Mainloop{}.load(params, tile, seqlen, smem, pipe);
    });
  } else {  // consumer warpgroups
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread_idx = threadIdx.x - 128;
    Mainloop::start_consumers(thread_idx);
    for_each_tile([&](const FwdTile& tile, const SeqlenInfo& seqlen) {
      auto acc_o = Mainloop::make_acc_o();
      OnlineSoftmax<Mainloop::kRows, Mainloop::kSoftmaxMaxChains, Mainloop::kSoftmaxSumChains> softmax;
      Mainloop{}.mma(params, tile, seqlen, acc_o, softmax, smem, thread_idx, pipe);  // Algorithm 1's loop
      Epilogue::store(params.p, tile, seqlen, acc_o, softmax, Mainloop::smem_o(smem), thread_idx);  // O /= l, L, out
    });
  }
}

}  // namespace flashcute::sm90
