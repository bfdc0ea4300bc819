// flashcute — the sm90 backward epilogue for one key tile, per consumer warpgroup (its 64 keys):
// dK_j *= scale (dK_j and dV_j also by dropout's 1 / (1 - p)); registers -> shared (stmatrix, dK_j
// into P's and dS's space, dV_j into dQ's staging buffer, both free after the main loop's
// release_kv(), while the producer loads the next tile's K and V into theirs) -> global with
// 16-byte stores predicated on the sequence's keys and the real head dim. Both warpgroups then
// sync: the next tile's first P and dS stores overwrite the staging.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flashcute/common/bwd_pre_post.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/utils.h"
#include "flashcute/sm90/mainloop_bwd.h"

namespace flashcute::sm90 {

using namespace cute;

template <typename Traits>
struct EpilogueBwd {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;

  template <typename AccDKV, typename SharedStorage>
  static CUTE_DEVICE void store(const BwdParams& p, const BwdTile& tile, const SeqlenInfo& seqlen, AccDKV& acc_dk,
                                AccDKV& acc_dv, SharedStorage& smem, int thread_idx) {
    const int n_block = tile.x;
    scale_dkv(p, acc_dk, acc_dv);  // dK *= scale; both by dropout's 1 / (1 - p)
    Tensor sdK = make_tensor(make_smem_ptr(smem.pds_dk.dk.data()), typename Traits::SmemLayoutK{});
    Tensor sdV = make_tensor(make_smem_ptr(smem.dq_dv.dv.data()), typename Traits::SmemLayoutK{});
    auto copy_s = make_tiled_copy_C(typename Traits::SmemCopyAtomdKV{}, typename Traits::TiledMmadKV{});
    auto thr_s = copy_s.get_thread_slice(thread_idx);
    copy(copy_s, thr_s.retile_S(convert_fragment<Element>(acc_dk)), thr_s.partition_D(sdK));
    copy(copy_s, thr_s.retile_S(convert_fragment<Element>(acc_dv)), thr_s.partition_D(sdV));
    const int warp_group = thread_idx / 128;
    cutlass::arch::NamedBarrier::sync(128, uint32_t(BwdBarrier::kEpilogueWG0) + warp_group);

    // This warpgroup's 64 keys, shared -> global.
    typename Traits::GmemTiledCopydKV gmem_copy;
    Tensor tc = gmem_copy.get_thread_slice(thread_idx % 128).partition_S(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
    const int rows_left = seqlen.k - n_block * kBlockN - warp_group * 64;
    auto store = [&](auto const& s_tile, void* base, Strides s) __attribute__((always_inline)) {
      Tensor m = head_tensor<Element, kHeadDim>(base, s, tile.bidb, tile.bidh_kv, seqlen.k, seqlen.k_offset);
      Tensor g = local_tile(m, Shape<_64, Int<kHeadDim>>{}, make_coord(n_block * (kBlockN / 64) + warp_group, 0));
      store_smem_tile(gmem_copy, thread_idx % 128, local_tile(s_tile, Shape<_64, Int<kHeadDim>>{}, make_coord(warp_group, 0)),
                      g, tc, column_predicate(tc, p.headdim), rows_left);
    };
    store(sdK, p.dk, p.dk_stride);
    store(sdV, p.dv, p.dv_stride);
    cutlass::arch::NamedBarrier::sync(Traits::kNumMmaThreads, uint32_t(BwdBarrier::kEpilogueDone));
  }
};

}  // namespace flashcute::sm90
