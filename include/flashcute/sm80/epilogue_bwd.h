// flashcute — the sm80 backward epilogue for one key tile: dK_j *= scale (dK_j and dV_j also by
// dropout's 1 / (1 - p)); dK_j and dV_j to global memory through shared memory (K's and V's
// space) with 16-byte stores.
#pragma once

#include <cute/tensor.hpp>

#include "flashcute/common/bwd_pre_post.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/utils.h"
#include "flashcute/sm80/utils.h"

namespace flashcute::sm80 {

using namespace cute;

template <typename Traits>
struct EpilogueBwd {
  using Element = typename Traits::Element;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;

  template <typename AccDKV, typename SharedStorage>
  static CUTE_DEVICE void store(const BwdParams& params, const BwdTile& tile, int n_block, const SeqlenInfo& seqlen,
                                AccDKV& acc_dk, AccDKV& acc_dv, SharedStorage& smem) {
    const int tidx = threadIdx.x;
    scale_dkv(params, acc_dk, acc_dv);  // dK *= scale; both by dropout's 1 / (1 - p)
    Tensor rdK = convert_fragment<Element>(acc_dk);
    Tensor rdV = convert_fragment<Element>(acc_dv);
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
    __syncthreads();  // every warp is done with sK, sV (the dQ GEMM)
    auto copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, typename Traits::TiledMmadKV{});
    auto thr_o = copy_o.get_thread_slice(tidx);
    copy(copy_o, thr_o.retile_S(rdK), thr_o.partition_D(sK));
    copy(copy_o, thr_o.retile_S(rdV), thr_o.partition_D(sV));
    __syncthreads();

    typename Traits::GmemTiledCopyStore gmem_store;
    Tensor tKc = gmem_store.get_thread_slice(tidx).partition_D(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    Tensor col_ok = column_predicate(tKc, params.headdim);
    auto store = [&](auto const& s_tile, void* base, Strides s) __attribute__((always_inline)) {
      Tensor g = local_tile(head_tensor<Element, kHeadDim>(base, s, tile.bidb, tile.bidh_kv, seqlen.k, seqlen.k_offset),
                            Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
      store_smem_tile(gmem_store, tidx, s_tile, g, tKc, col_ok, seqlen.k - n_block * kBlockN);
    };
    store(sK, params.dk, params.dk_stride);
    store(sV, params.dv, params.dv_stride);
  }
};

}  // namespace flashcute::sm80
