// flashcute — the sm80 backward kernel: FlashAttention-2, Algorithm 2, parallel over key tiles.
// Between the preprocess and the dQ conversion (common/bwd_pre_post.h), one CTA per key tile (and
// sequence, kv head) runs the main loop (mainloop_bwd.h) and the epilogue (epilogue_bwd.h).
// Deterministic mode: CTA `split` takes key tiles split, split + splits, ... and owns split
// `split` of the dQ accumulator, so its adds come in a fixed order; otherwise one key tile per
// CTA, all adding into split 0.
#pragma once

#include "flashcute/common/bwd_pre_post.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/params.h"

namespace flashcute::sm80 {

template <typename Mainloop, typename Epilogue, typename Scheduler>
__global__ void __launch_bounds__(Mainloop::kNThreads, 1)
    flashcute_bwd_kernel(__grid_constant__ const BwdParams params, DqAccumShape dq_acc) {
  extern __shared__ __align__(128) char smem_buf[];
  auto& smem = *reinterpret_cast<typename Mainloop::SharedStorage*>(smem_buf);
  wait_for_previous_grid();  // the preprocess's D, L and cleared dQ accumulator (common/utils.h)
  dependents_may_launch();   // the dQ conversion (it waits for this kernel's end)

  const BwdTile tile = Scheduler::get(params);
  const SeqlenInfo seqlen = Mainloop::Mask::seqlen(params, tile.bidb);
  const int num_x = gridDim.x / (params.batch * params.nheads_kv);
  const int split = params.deterministic ? tile.x : 0;
  for (int n_block = tile.x; n_block * Mainloop::kBlockN < seqlen.k; n_block += num_x) {
    auto acc_dk = Mainloop::make_acc_dkv();
    auto acc_dv = Mainloop::make_acc_dkv();
    Mainloop{}.run(params, dq_acc, tile, n_block, split, seqlen, acc_dk, acc_dv, smem);  // Algorithm 2's loop
    Epilogue::store(params, tile, n_block, seqlen, acc_dk, acc_dv, smem);                // dK *= scale, stores
  }
}

}  // namespace flashcute::sm80
