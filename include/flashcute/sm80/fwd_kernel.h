// flashcute — the sm80 forward kernel: FlashAttention-2, Algorithm 1. For the tile the
// scheduler hands out, the main loop (mainloop_fwd.h) and the epilogue (epilogue_fwd.h).
// The same template signature as the sm90 family's kernel, so the launcher picks the family
// and nothing else.
#pragma once

#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/softmax.h"
#include "flashcute/params.h"

namespace flashcute::sm80 {

// __grid_constant__: the parameter block stays in constant space even where the kernel takes
// its address (the loops' lambdas capture it by reference), with no local-memory copy.
template <typename Mainloop, typename Epilogue, typename Scheduler>
__global__ void __launch_bounds__(Mainloop::kNThreads, Mainloop::kMinCtasPerSm)
    flashcute_fwd_kernel(__grid_constant__ const FwdParams params) {
  extern __shared__ __align__(128) char smem_buf[];
  auto& smem = *reinterpret_cast<typename Mainloop::SharedStorage*>(smem_buf);
  if constexpr (Scheduler::kChained) {  // KV cache: the appended tokens are read; the combine may launch
    wait_for_previous_grid();
    dependents_may_launch();
  }

  const FwdTile tile = Scheduler::get(params);
  const SeqlenInfo seqlen = Mainloop::seqlen_info(params, tile.bidb);
  if (tile.m_block * Mainloop::kBlockM >= seqlen.q) return;  // packed batches: past this sequence

  auto acc_o = Mainloop::make_acc_o();
  OnlineSoftmax<Mainloop::kRows> softmax;
  Mainloop{}.run(params, tile, seqlen, acc_o, softmax, smem);  // Algorithm 1's loop
  Epilogue::store(params, tile, seqlen, acc_o, softmax, smem);  // O /= l, L, stores
}

}  // namespace flashcute::sm80
