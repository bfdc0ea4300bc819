// flashcute — the sm90 decoding kernel (flash-decoding over a KV cache): the producer warp (warp
// 0) streams the split's K and V tiles by TMA (mainloop_decode.h load()), the consumer warps
// run Algorithm 1 over them (mma()), then the split's partial and the cluster-wide merge of the
// query tile's splits (epilogue_decode.h). A cluster is one query tile's splits.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/softmax.h"
#include "flashcute/common/utils.h"
#include "flashcute/params.h"

namespace flashcute::sm90 {

template <typename Mainloop, typename Epilogue>
__global__ void __launch_bounds__(Mainloop::kNThreads, 1)
    flashcute_decode_kernel(__grid_constant__ const typename Mainloop::Params params) {
  extern __shared__ __align__(1024) char smem_buf[];
  auto& smem = *reinterpret_cast<typename Mainloop::SharedStorage*>(smem_buf);
  if (threadIdx.x == 0) Mainloop::init(params, smem);
  __syncthreads();
  // The appended tokens (launch chain: common/utils.h). No dependents_may_launch(): the next
  // decoding call's CTAs, launched early onto the SMs this grid leaves free, slowed back-to-back
  // calls down (H200, b 1, GQA 32/8, CUDA graphs: 32k 50.7 -> 37.3 us, 8k 17.3 -> 14.4 us without
  // chained launches; session 48).
  wait_for_previous_grid();

  // Every CTA of a cluster has the same (sequence, head group, query tile): they leave together.
  const FwdTile tile = KvCacheTileScheduler<Mainloop::kBlockM>::get(params.p);
  // (Its query rows need no load; its keys, the cache's length, each role reads where it needs them:
  // the producer after its first copy, Mainloop::load.)
  if (tile.m_block * Mainloop::kBlockM >= SeqlenInfo(params.p, tile.bidb).q) return;

  // Every CTA's barriers are initialised before another CTA of the cluster writes to its landing
  // buffers (the consumers wait for this arrival before they send their partials).
  cute::cluster_arrive_relaxed();

  // Warpgroup 0 produces (its first thread; the others idle), the next consumes. A CTA leaves once
  // the rows it merges are written; no CTA reads another's shared memory, so none waits for the
  // others to leave.
  const bool producer = threadIdx.x < 128;
  const int thread_idx = threadIdx.x - 128;  // the consumers' index
  const bool consumer = !producer && thread_idx < Mainloop::kNumMmaThreads;
  if (producer) {
    cutlass::arch::warpgroup_reg_dealloc<Mainloop::kProducerRegs>();
    if (threadIdx.x == 0) Mainloop{}.load(params, tile, smem);
  } else {  // (the consumers' code inside the branch that raised their registers: ptxas holds code
            // after the two roles' join to the producer's count)
    cutlass::arch::warpgroup_reg_alloc<Mainloop::kConsumerRegs>();
    if (consumer) {
      const SeqlenInfo seqlen = SeqlenInfo::with_cache(params.p, tile.bidb);
      auto acc_o = Mainloop::make_acc_o();
      OnlineSoftmax<Mainloop::kRows> softmax;
      Mainloop{}.mma(params, tile, seqlen, acc_o, softmax, smem, thread_idx);  // Algorithm 1's loop
      const typename Epilogue::Cluster cluster(tile, seqlen);
      Epilogue::split_partial(params.p, tile, cluster, acc_o, softmax, smem.merge, smem.landing, thread_idx);
      Epilogue::merge_rows(params.p, tile, cluster, smem.landing, thread_idx);
    }
  }
}

}  // namespace flashcute::sm90
