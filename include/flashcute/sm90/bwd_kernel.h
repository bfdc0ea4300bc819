// flashcute — the sm90 backward kernel: FlashAttention-2's Algorithm 2 on Hopper, warp-
// specialised, parallel over key tiles. Between the preprocess and the dQ conversion
// (common/bwd_pre_post.h), one CTA per key tile (and sequence, kv head): warpgroup 0 is the
// producer (one warp issues the TMA copies of mainloop_bwd.h's load()), the other two are
// consumers (mma(), then the epilogue). Deterministic mode: CTA `split` takes key tiles split,
// split + splits, ... and owns split `split` of the dQ accumulator, whose bulk reductions it
// issues one after the other (each completes before the next), so the sums are reproducible.
#pragma once

#include <cutlass/arch/reg_reconfig.h>

#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/params.h"
#include "flashcute/sm90/utils.h"

namespace flashcute::sm90 {

template <typename Mainloop, typename Epilogue, typename Scheduler>
__global__ void __launch_bounds__(Mainloop::kNThreads, 1)
    flashcute_bwd_kernel(__grid_constant__ const typename Mainloop::Params params) {
  using Traits = typename Mainloop::Traits;
  extern __shared__ __align__(1024) char smem_buf[];
  auto& smem = *reinterpret_cast<typename Mainloop::SharedStorage*>(smem_buf);

  if (threadIdx.x == 0) Mainloop::init(params, smem);
  __syncthreads();  // the last CTA-wide barrier: the roles split below

  const BwdParams& p = params.p;
  const BwdTile tile = Scheduler::get(p);
  const SeqlenInfo seqlen(p, tile.bidb);
  const int num_x = gridDim.x / (p.batch * p.nheads_kv);
  const int split = p.deterministic ? tile.x : 0;
  int i = 0;  // uses of the Q / dO ring, across the CTA's key tiles
  if (threadIdx.x < 128) {  // producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x < 32) {
      for (int n_block = tile.x, use = 0; n_block * Mainloop::kBlockN < seqlen.k; n_block += num_x, ++use) {
        Mainloop{}.load(params, tile, n_block, use, seqlen, smem, i);
      }
    }
  } else {  // consumer warpgroups
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread_idx = threadIdx.x - 128;
    for (int n_block = tile.x, use = 0; n_block * Mainloop::kBlockN < seqlen.k; n_block += num_x, ++use) {
      auto acc_dk = Mainloop::make_acc_dkv();
      auto acc_dv = Mainloop::make_acc_dkv();
      Mainloop{}.mma(params, tile, n_block, use, split, seqlen, acc_dk, acc_dv, smem, thread_idx, i);  // Algorithm 2
      Epilogue::store(p, tile, n_block, seqlen, acc_dk, acc_dv, smem, thread_idx);  // dK *= scale, stores
      if (thread_idx % 128 == 0) cutlass::arch::ClusterBarrier::arrive(&smem.barrier_kv_empty);
    }
    if (thread_idx == 0) bulk_wait_all();  // the last dQ reduction has read shared memory
  }
}

}  // namespace flashcute::sm90
