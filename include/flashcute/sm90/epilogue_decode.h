// flashcute — the sm90 decoding epilogue: the end of Algorithm 1 for one split, then the merge of
// a query tile's splits inside its cluster (split-KV without a combine kernel).
//
//   each warp:  O_w /= l_w;  L_w = m_w * scale + log l_w          (its keys of every tile)
//   the CTA:    (O_s, L_s) = merge over its warps                  (shared memory)
//   cluster:    L = log sum_s exp(L_s);  O = sum_s exp(L_s - L) O_s  (distributed shared memory:
//               rank r of the cluster reads every split's rows for its slice of O's elements)
//
// The merge rules are common/epilogue.h's, as the combine kernel's. Merging inside clusters of up
// to 8 splits cost 1.8 us over a bare TMA read of the cache, where the combine kernel's tail alone
// was 2.8 us (H200, b 1, GQA 32/8, 32k: BENCHMARKS.md, session 47).
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_conversion.h>

#include "flashcute/common/epilogue.h"
#include "flashcute/common/kvcache.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/sm80/utils.h"

namespace flashcute::sm90 {

using namespace cute;

// ld.shared::cluster of `local`'s counterpart in the shared memory of the cluster's CTA `rank`.
template <typename T>
CUTE_DEVICE T load_from_cluster_rank(const T* local, int rank) {
  static_assert(sizeof(T) == 4 || sizeof(T) == 16);
  uint32_t addr;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(addr) : "r"(cute::cast_smem_ptr_to_uint(local)), "r"(rank));
  T v;
  if constexpr (sizeof(T) == 4) {
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr));
  } else {
    asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                 : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                 : "r"(addr));
  }
  return v;
}

template <typename Mainloop>
struct EpilogueDecode {
  using Element = typename Mainloop::Element;
  using Merge = typename Mainloop::Merge;
  static constexpr int kBlockM = Mainloop::kBlockM;
  static constexpr int kHeadDim = Mainloop::kHeadDim;
  static constexpr int kWarps = Mainloop::kConsumerWarps;
  static constexpr int kThreads = Mainloop::kNumMmaThreads;
  static constexpr int kMaxSplits = 8;  // a portable cluster

  // Consumers (thread_idx counts them from 0): this split's (O, L) into merge.o / merge.lse. The rings' space is free once every
  // consumer warp has read its last tile (the first barrier; the producer's copies have all been
  // waited for by then).
  template <typename AccO, typename Softmax>
  static CUTE_DEVICE void split_partial(const FwdParams& p, AccO& acc_o, Softmax& softmax, Merge& merge,
                                        int thread_idx) {
    const int tidx = thread_idx, warp = tidx / 32;
    typename Mainloop::Mma::TiledMmaO tiled_mma_o;
    Tensor tOcO = tiled_mma_o.get_thread_slice(tidx % 32).partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO = make_tensor(tOcO.data(), sm80::acc_rowcol(tOcO.layout()));
    Tensor o_rc = make_tensor(acc_o.data(), sm80::acc_rowcol(acc_o.layout()));
    float lse[Mainloop::kRows];
    softmax.finalize(o_rc, p.softmax_scale, lse);
    cutlass::arch::NamedBarrier::sync(kThreads, Mainloop::kBarrierConsumers);
    stage_partial<kBlockM, kHeadDim>(o_rc, cO, lse, warp, &merge.o_warp[0][0][0], &merge.lse_warp[0][0]);
    cutlass::arch::NamedBarrier::sync(kThreads, Mainloop::kBarrierConsumers);
    merge_staged_partials<kWarps, kBlockM, kHeadDim, kThreads>(
        tidx, &merge.o_warp[0][0][0], &merge.lse_warp[0][0], kBlockM,
        [&](int r, float l, bool first, int c0, auto const& o) {
          if (first) merge.lse[r] = l;
          CUTE_UNROLL
          for (int k = 0; k < int(sizeof(o) / sizeof(o[0])); ++k) *reinterpret_cast<float4*>(&merge.o[r][c0 + 4 * k]) = o[k];
        });
  }

  // Consumers, after a cluster barrier: this CTA's slice of the tile's O elements (float4
  // columns), merged over the cluster's splits, to out and (column 0) lse. rows: the tile's
  // packed rows inside the sequence.
  static CUTE_DEVICE void cluster_merge(const FwdParams& p, const FwdTile& tile, const SeqlenInfo& seqlen,
                                        const Merge& merge, int thread_idx) {
    const int splits = int(cute::cluster_shape().x), rank = int(cute::block_rank_in_cluster());
    constexpr int kUnits = kBlockM * kHeadDim / 4;
    const int per_rank = (kUnits + splits - 1) / splits;
    const KvCacheRows cache{p, tile.bidb, tile.bidh, 0};
    const int rows = seqlen.q - tile.m_block * kBlockM;
    for (int u = rank * per_rank + thread_idx; u < min(kUnits, (rank + 1) * per_rank); u += kThreads) {
      const int r = u / (kHeadDim / 4), c = u % (kHeadDim / 4) * 4;
      if (r >= rows || c >= p.headdim) continue;
      float lse_s[kMaxSplits];
      float m = -INFINITY;
      CUTE_UNROLL
      for (int s = 0; s < kMaxSplits; ++s) {
        lse_s[s] = s < splits ? load_from_cluster_rank(&merge.lse[r], s) : -INFINITY;
        m = fmaxf(m, lse_s[s]);
      }
      float sum = 0.f;
      CUTE_UNROLL
      for (int s = 0; s < kMaxSplits; ++s) sum += partial_weight(lse_s[s], m);
      const float lse = merged_lse(m, sum);
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      CUTE_UNROLL
      for (int s = 0; s < kMaxSplits; ++s) {
        const float w = partial_weight(lse_s[s], lse);
        if (w != 0.f) add_weighted(acc, w, load_from_cluster_rank(reinterpret_cast<const float4*>(&merge.o[r][c]), s));
      }
      const int q_row = tile.m_block * kBlockM + r;
      cutlass::NumericArrayConverter<Element, float, 4> convert;
      *reinterpret_cast<cutlass::Array<Element, 4>*>(static_cast<Element*>(p.o) + cache.q_row(p.o_stride, q_row) + c) =
          convert(reinterpret_cast<const cutlass::Array<float, 4>&>(acc));
      if (c == 0) p.lse[cache.accum_row(0, q_row)] = lse;
    }
  }
};

}  // namespace flashcute::sm90
