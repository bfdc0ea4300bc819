// flashcute — the sm80 forward epilogue: the end of Algorithm 1 for one query tile.
//
//   O /= l;  L = m * softmax_scale + log l     (rows that saw no key: O = 0, L = -inf)
//
// L goes out from registers (the thread holding a row's column 0 writes it); O goes
// registers -> shared (Q's space) -> global with 16-byte stores.
#pragma once

#include <cute/tensor.hpp>

#include "flashcute/common/epilogue.h"
#include "flashcute/common/kvcache.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/utils.h"
#include "flashcute/sm80/utils.h"

namespace flashcute::sm80 {

using namespace cute;

template <typename Traits>
struct EpilogueFwd {
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;

  template <typename AccO, typename Softmax, typename SharedStorage>
  static CUTE_DEVICE void store(const FwdParams& params, const FwdTile& tile, const SeqlenInfo& seqlen, AccO& acc_o,
                                Softmax& softmax, SharedStorage& smem) {
    const int tidx = threadIdx.x;
    typename Traits::TiledMma tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(tidx);
    Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
    Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
    const int rows_left = seqlen.q - tile.m_block * kBlockM;

    constexpr int kRows = decltype(size<0>(o_rc))::value;
    float lse[kRows];
    softmax.finalize(o_rc, params.softmax_scale, lse, params.dropout_scale);
    store_lse<kBlockM>(params, tile, seqlen, cO, lse);

    // O: registers -> shared (Q's space; each warp rewrites only its own rows of sQ, which only
    // it has read) -> global with 16-byte stores.
    Tensor sO = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutO{});
    Tensor rO = convert_fragment<Element>(acc_o);
    auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
    auto smem_thr_o = smem_copy_o.get_thread_slice(tidx);
    copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));
    __syncthreads();

    typename Traits::GmemTiledCopyO gmem_copy_o;
    Tensor tOc = gmem_copy_o.get_thread_slice(tidx).partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor mO = head_tensor<Element, kHeadDim>(params.o, params.o_stride, tile.bidb, tile.bidh, seqlen.q,
                                               seqlen.q_offset);
    Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(tile.m_block, 0));
    store_smem_tile(gmem_copy_o, tidx, sO, gO, tOc, column_predicate(tOc, params.headdim), rows_left);
  }
};

// KV cache (split-KV): the same end of Algorithm 1, O and L of this split of the keys going to
// the float32 partials o_accum / lse_accum (params.h) straight from registers, row by row
// (GQA-packed rows belong to different heads); the combine kernel (src/cuda/kvcache.cu) merges
// the splits. O is small next to the K/V a decoding CTA streams, so no shared-memory staging.
// Warps side by side along the keys (decoding's tile): each warp's (O, L) is a split of its own,
// merged here first, through shared memory, the way the combine merges splits.
template <typename Traits>
struct EpilogueFwdPartial {
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kWarpsN = Traits::kWarpsN;

  template <typename AccO, typename Softmax, typename SharedStorage>
  static CUTE_DEVICE void store(const FwdParams& params, const FwdTile& tile, const SeqlenInfo& seqlen, AccO& acc_o,
                                Softmax& softmax, SharedStorage& smem) {
    typename Traits::TiledMmaO tiled_mma;
    auto thr_mma = tiled_mma.get_thread_slice(Traits::o_thread(threadIdx.x));
    Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
    Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
    constexpr int kRows = decltype(size<0>(o_rc))::value;
    float lse[kRows];
    softmax.finalize(o_rc, params.softmax_scale, lse);

    const KvCacheRows cache{params, tile.bidb, tile.bidh, 0};
    if constexpr (kWarpsN == 1) {
      CUTE_UNROLL
      for (int i = 0; i < kRows; ++i) {
        const int r = tile.m_block * kBlockM + get<0>(cO(i, 0));
        if (r >= seqlen.q) continue;
        const int64_t row = cache.accum_row(tile.split, r);
        if (get<1>(cO(i, 0)) == 0) params.lse_accum[row] = lse[i];
        float* o = params.o_accum + row * params.headdim;
        // Columns come in adjacent pairs (the m16n8 accumulator's); headdim is a multiple of 8.
        CUTE_UNROLL
        for (int j = 0; j < size<1>(o_rc); j += 2) {
          const int col = get<1>(cO(i, j));
          if (col < params.headdim) *reinterpret_cast<float2*>(o + col) = make_float2(o_rc(i, j), o_rc(i, j + 1));
        }
      }
    } else {
      // Each warp's O and L to shared memory: O in K's buffer, L in Q's (every warp has read both
      // for the last time before the barrier that follows the last S = Q K^T).
      static_assert(sizeof(smem.k) >= kWarpsN * kBlockM * kHeadDim * sizeof(float), "O of every warp in K's space");
      static_assert(sizeof(smem.q) >= kWarpsN * kBlockM * sizeof(float), "L of every warp in Q's space");
      float* o_s = reinterpret_cast<float*>(smem.k.data());  // (warp, row, col)
      float* lse_s = reinterpret_cast<float*>(smem.q.data());  // (warp, row)
      stage_partial<kBlockM, kHeadDim>(o_rc, cO, lse, threadIdx.x / 32, o_s, lse_s);
      __syncthreads();
      const int row0 = tile.m_block * kBlockM;
      merge_staged_partials<kWarpsN, kHeadDim, Traits::kNThreads>(
          threadIdx.x, o_s, lse_s, kWarpsN, kBlockM, min(kBlockM, seqlen.q - row0), params.headdim,
          [&](int r, float l, int c, const float4& o) {
            const int64_t row = cache.accum_row(tile.split, row0 + r);
            if (c == 0) params.lse_accum[row] = l;
            *reinterpret_cast<float4*>(params.o_accum + row * params.headdim + c) = o;
          });
    }
  }
};

}  // namespace flashcute::sm80
