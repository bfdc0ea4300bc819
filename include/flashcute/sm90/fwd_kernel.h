// flashcute — the sm90 forward kernel: FlashAttention-2's Algorithm 1 on Hopper, warp-
// specialised. Warpgroup 0 is the producer (one warp issues the TMA copies of mainloop_fwd.h's
// load(), with few registers); the other warpgroups are consumers (mma(), then the epilogue),
// with the registers setmaxnreg moves to them. The same template signature as the sm80 family's
// kernel, so the launcher picks the family and nothing else.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/softmax.h"
#include "flashcute/params.h"

namespace flashcute::sm90 {

template <typename Mainloop, typename Epilogue, typename Scheduler>
__global__ void __launch_bounds__(Mainloop::kNThreads, 1)
    flashcute_fwd_kernel(__grid_constant__ const typename Mainloop::Params params) {
  using Traits = typename Mainloop::Traits;
  extern __shared__ __align__(1024) char smem_buf[];
  auto& smem = *reinterpret_cast<typename Mainloop::SharedStorage*>(smem_buf);

  if (threadIdx.x == 0) Mainloop::init(params, smem);
  __syncthreads();  // the last CTA-wide barrier: the roles split below

  const FwdTile tile = Scheduler::get(params.p);
  // (KV-cache calls that run here, dispatch.cu: the keys of sequence b are its used positions)
  const SeqlenInfo seqlen =
      params.p.cache_seqlens != nullptr ? SeqlenInfo::with_cache(params.p, tile.bidb) : SeqlenInfo(params.p, tile.bidb);
  if (tile.m_block * Mainloop::kBlockM >= seqlen.q) return;  // packed batches: past this sequence

  if (threadIdx.x < 128) {  // producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x < 32) Mainloop{}.load(params, tile, seqlen, smem);
  } else {  // consumer warpgroups
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread_idx = threadIdx.x - 128;
    auto acc_o = Mainloop::make_acc_o();
    OnlineSoftmax<Mainloop::kRows> softmax;
    Mainloop{}.mma(params, tile, seqlen, acc_o, softmax, smem, thread_idx);      // Algorithm 1's loop
    Epilogue::store(params.p, tile, seqlen, acc_o, softmax, smem, thread_idx);  // O /= l, L, stores
  }
}

}  // namespace flashcute::sm90
