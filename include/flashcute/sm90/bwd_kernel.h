// flashcute — the sm90 backward kernel: FlashAttention-2's Algorithm 2 on Hopper, warp-
// specialised, parallel over key tiles. Between the preprocess and the dQ conversion
// (common/bwd_pre_post.h), persistent CTAs (PersistentKvTileScheduler) each walk key tiles (and
// sequence, kv head): warpgroup 0 is the producer (one warp issues the TMA copies of
// mainloop_bwd.h's load(), and takes the CTA's next tile), the other two are consumers (mma(),
// then the epilogue). Deterministic mode: the CTA of split s takes key tiles s, s + splits, ... and
// owns split s of the dQ accumulator, whose bulk reductions it issues one after the other (each
// completes before the next), so the sums are reproducible.
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
  int i = 0;  // uses of the Q / dO ring, across the CTA's key tiles
  if (threadIdx.x < 128) {  // producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x < 32) {
      // u counts the CTA's tiles, kv_use those inside their sequence (packed batches: key blocks
      // past a short sequence's end have no work).
      for (int t = Scheduler::first(p), u = 0, kv_use = 0; t < Scheduler::num_tiles(p); ++u) {
        const BwdTile tile = Scheduler::tile(p, t);
        const SeqlenInfo seqlen(p, tile.bidb);
        if (tile.x * Mainloop::kBlockN < seqlen.k) Mainloop{}.load(params, tile, kv_use++, seqlen, smem, i);
        t = __shfl_sync(0xffffffff, threadIdx.x == 0 ? Scheduler::next(p, t) : 0, 0);
        if (threadIdx.x == 0) {  // hand the next tile to the consumers
          smem.tiles.wait_empty(u);
          smem.next_tile = t;
          smem.tiles.fill_done(u);
        }
      }
    }
  } else {  // consumer warpgroups
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread_idx = threadIdx.x - 128;
    for (int t = Scheduler::first(p), u = 0, kv_use = 0; t < Scheduler::num_tiles(p); ++u) {
      const BwdTile tile = Scheduler::tile(p, t);
      const SeqlenInfo seqlen(p, tile.bidb);
      if (tile.x * Mainloop::kBlockN < seqlen.k) {
        auto acc_dk = Mainloop::make_acc_dkv();
        auto acc_dv = Mainloop::make_acc_dkv();
        Mainloop{}.mma(params, tile, kv_use, Scheduler::split(p, t), seqlen, acc_dk, acc_dv, smem, thread_idx,
                       i);                                                  // Algorithm 2
        Mainloop::release_kv(smem, thread_idx);                             // K_j, V_j to the next tile's loads
        Epilogue::store(p, tile, seqlen, acc_dk, acc_dv, smem, thread_idx);  // dK *= scale, stores
        ++kv_use;
      }
      smem.tiles.wait_full(u);
      t = smem.next_tile;
      smem.tiles.release(u, true);
    }  // (release_kv waited for each tile's last dQ reduction)
  }
}

}  // namespace flashcute::sm90
