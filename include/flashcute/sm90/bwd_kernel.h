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
  wait_for_previous_grid();  // the preprocess's D, L, cleared dQ accumulator and tile counter
  dependents_may_launch();   // the dQ conversion (it waits for this kernel's end)

  const BwdParams& p = params.p;
  int i = 0;  // uses of the Q / dO ring, across the CTA's key tiles
  // Both roles walk the CTA's key tiles: fn(t, tile, seqlen, kv_use) for each tile inside its
  // sequence (packed batches: key blocks past a short sequence's end have no work; kv_use counts
  // the tiles done), then next_of(t, u) gives the successor of the CTA's u-th tile.
  auto for_each_tile = [&](auto&& fn, auto&& next_of) {
    for (int t = Scheduler::first(p), u = 0, kv_use = 0; t < Scheduler::num_tiles(p); t = next_of(t, u++)) {
      const BwdTile tile = Scheduler::tile(p, t);
      const SeqlenInfo seqlen(p, tile.bidb);
      if (tile.x * Mainloop::kBlockN < seqlen.k) fn(t, tile, seqlen, kv_use++);
    }
  };
  if (threadIdx.x < 128) {  // producer warpgroup
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x < 32) {
      for_each_tile(
          [&](int, const BwdTile& tile, const SeqlenInfo& seqlen, int kv_use) {
            Mainloop{}.load(params, tile, kv_use, seqlen, smem, i);
          },
          [&](int t, int u) {  // take the next tile and hand it to the consumers
            const int next = __shfl_sync(0xffffffff, threadIdx.x == 0 ? Scheduler::next(p, t) : 0, 0);
            if (threadIdx.x == 0) {
              smem.tiles.wait_empty(u);
              smem.next_tile = next;
              smem.tiles.fill_done(u);
            }
            return next;
          });
    }
  } else {  // consumer warpgroups
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int thread_idx = threadIdx.x - 128;
    for_each_tile(
        [&](int t, const BwdTile& tile, const SeqlenInfo& seqlen, int kv_use) {
          auto acc_dk = Mainloop::make_acc_dkv();
          auto acc_dv = Mainloop::make_acc_dkv();
          Mainloop{}.mma(params, tile, kv_use, Scheduler::split(p, t), seqlen, acc_dk, acc_dv, smem, thread_idx,
                         i);                                                  // Algorithm 2
          Mainloop::release_kv(smem, thread_idx);                             // K_j, V_j to the next tile's loads
          Epilogue::store(p, tile, seqlen, acc_dk, acc_dv, smem, thread_idx);  // dK *= scale, stores
        },
        [&](int, int u) {  // the producer's pick
          smem.tiles.wait_full(u);
          const int next = smem.next_tile;
          smem.tiles.release(u, true);
          return next;
        });  // (release_kv waited for each tile's last dQ reduction)
  }
}

}  // namespace flashcute::sm90
