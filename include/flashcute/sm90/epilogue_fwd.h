// flashcute — the sm90 forward epilogue: the end of Algorithm 1 for one query tile, per consumer
// warpgroup (its 64 rows), with no barrier across warpgroups:
//
//   O /= l;  L = m * softmax_scale + log l     (rows that saw no key: O = 0, L = -inf)
//
// L goes out from registers (the thread holding a row's column 0 writes it); O goes registers ->
// shared (stmatrix, into the warpgroup's rows of O's buffer, or of Q's space, which only it read)
// -> global with 16-byte stores predicated on the sequence's rows and the real head dim.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flashcute/common/epilogue.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/utils.h"
#include "flashcute/sm90/mainloop_fwd.h"
#include "flashcute/sm90/utils.h"

namespace flashcute::sm90 {

using namespace cute;

template <typename Traits>
struct EpilogueFwd {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;

  template <typename AccO, typename Softmax>
  static CUTE_DEVICE void store(const FwdParams& p, const FwdTile& tile, const SeqlenInfo& seqlen, AccO& acc_o,
                                Softmax& softmax, Element* smem_o, int thread_idx) {
    typename Traits::TiledMmaPV mma_pv;
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);
    Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
    Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
    const int rows_left = seqlen.q - tile.m_block * kBlockM;

    constexpr int kRows = decltype(size<0>(o_rc))::value;
    float lse[kRows];
    softmax.finalize(o_rc, p.softmax_scale, lse, p.dropout_scale);
    store_lse<kBlockM>(p, tile, seqlen, cO, lse);

    Tensor sO = make_tensor(make_smem_ptr(smem_o), typename Traits::SmemLayoutO{});
    Tensor rO = convert_fragment<Element>(acc_o);
    auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, mma_pv);
    auto smem_thr_o = smem_copy_o.get_thread_slice(thread_idx);
    const int warp_group = thread_idx / 128;
    // A persistent CTA's warpgroup rewrites its rows of O's buffer tile after tile: every thread
    // has read the last tile's rows before any overwrites them.
    if constexpr (Traits::kPersistent) {
      cutlass::arch::NamedBarrier::sync(128, uint32_t(FwdBarrier::kEpilogueWG0) + warp_group);
    }
    copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));
    cutlass::arch::NamedBarrier::sync(128, uint32_t(FwdBarrier::kEpilogueWG0) + warp_group);

    // This warpgroup's 64 rows, shared -> global.
    typename Traits::GmemTiledCopyO gmem_copy_o;
    Tensor tOc = gmem_copy_o.get_thread_slice(thread_idx % 128).partition_S(make_identity_tensor(Shape<_64, Int<kHeadDim>>{}));
    Tensor mO = head_tensor<Element, kHeadDim>(p.o, p.o_stride, tile.bidb, tile.bidh, seqlen.q, seqlen.q_offset);
    Tensor gO = local_tile(mO, Shape<_64, Int<kHeadDim>>{}, make_coord(tile.m_block * (kBlockM / 64) + warp_group, 0));
    Tensor sO_wg = local_tile(sO, Shape<_64, Int<kHeadDim>>{}, make_coord(warp_group, 0));
    store_smem_tile(gmem_copy_o, thread_idx % 128, sO_wg, gO, tOc, column_predicate(tOc, p.headdim),
                    rows_left - warp_group * 64);
  }
};

}  // namespace flashcute::sm90
