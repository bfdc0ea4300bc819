// flashcute — the sm90 decoding epilogue: the end of Algorithm 1 for one split, then the merge of
// a query tile's splits inside its cluster (split-KV without a combine kernel).
//
//   each warp:  O_w /= l_w;  L_w = m_w * scale + log l_w          (its keys of every tile)
//   the CTA:    (O_s, L_s) = merge over its warps                  (shared memory)
//   cluster:    L = log sum_s exp(L_s);  O = sum_s exp(L_s - L) O_s  (distributed shared memory:
//               each CTA sends row r of its (O_s, L_s) to rank r % splits by st.async, which
//               merges it once every split's bytes have landed)
//
// Both merges are common/epilogue.h's merge_staged_partials (as the sm80 partial epilogue's), on
// the combine kernel's rules. Merging inside clusters of up to 8 splits cost 1.8 us over a bare
// TMA read of the cache, where the combine kernel's tail alone was 2.8 us (H200, b 1, GQA 32/8,
// 32k: BENCHMARKS.md, session 47). Pushed rather than pulled
// (each CTA reading its slice of every split's partial over distributed shared memory between two
// cluster barriers): 8k / 32k 14.0 / 37.8 -> 13.2 / 36.8 us, b 8 8k 67.5 -> 66.7 (session 50);
// without any merge, 34.9 at 32k.
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

// The shared::cluster address of `local`'s counterpart in the cluster's CTA `rank`.
CUTE_DEVICE uint32_t cluster_address(const void* local, int rank) {
  return cute::set_block_rank(cute::cast_smem_ptr_to_uint(local), rank);
}
// st.async of 16 bytes into a cluster CTA's shared memory, counted on its transaction barrier (4
// bytes: cute::store_shared_remote).
CUTE_DEVICE void store_to_cluster(uint32_t addr, const float4& v, uint32_t barrier) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
               :
               : "r"(addr), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(barrier)
               : "memory");
}
// Waits for phase `parity` of a transaction barrier whose bytes other CTAs of the cluster wrote.
CUTE_DEVICE void wait_cluster_writes(const uint64_t* barrier, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT:\n\t"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT;\n\t"
      "}"
      :
      : "r"(cute::cast_smem_ptr_to_uint(barrier)), "r"(parity)
      : "memory");
}

template <typename Mainloop>
struct EpilogueDecode {
  using Element = typename Mainloop::Element;
  using Merge = typename Mainloop::Merge;
  using Landing = typename Mainloop::Landing;
  static constexpr int kBlockM = Mainloop::kBlockM;
  static constexpr int kHeadDim = Mainloop::kHeadDim;
  static constexpr int kWarps = Mainloop::kConsumerWarps;
  static constexpr int kThreads = Mainloop::kNumMmaThreads;
  static constexpr int kMaxSplits = Mainloop::kMaxSplits;

  // The cluster's splits and this CTA's rank among them, the tile's rows inside the sequence, and
  // the slots per rank of the landing buffers (Mainloop::Landing).
  struct Cluster {
    int splits, rank, rows, slots;
    CUTE_DEVICE Cluster(const FwdTile& tile, const SeqlenInfo& seqlen)
        : splits(int(cute::cluster_shape().x)),
          rank(int(cute::block_rank_in_cluster())),
          rows(min(kBlockM, seqlen.q - tile.m_block * kBlockM)),
          slots((kBlockM + splits - 1) / splits) {}
    CUTE_DEVICE int rows_merged_here() const { return rows > rank ? (rows - rank + splits - 1) / splits : 0; }
  };

  // Consumers (thread_idx counts them from 0), after the cluster barrier that follows the CTAs'
  // barrier initialisation: this split's (O, L), its warps' partials merged in shared memory
  // (the rings' space, free once every consumer warp has read its last tile), sent row by row to
  // the CTA that merges the row (st.async: no barrier over the cluster waits for them).
  template <typename AccO, typename Softmax>
  static CUTE_DEVICE void split_partial(const FwdParams& p, const FwdTile& tile, const Cluster& cl, AccO& acc_o,
                                        Softmax& softmax, Merge& merge, Landing& landing, int thread_idx) {
    const int tidx = thread_idx, warp = tidx / 32;
    typename Mainloop::Mma::TiledMmaO tiled_mma_o;
    Tensor tOcO = tiled_mma_o.get_thread_slice(tidx % 32).partition_C(
        make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor cO = make_tensor(tOcO.data(), sm80::acc_rowcol(tOcO.layout()));
    Tensor o_rc = make_tensor(acc_o.data(), sm80::acc_rowcol(acc_o.layout()));
    float lse[Mainloop::kRows];
    softmax.finalize(o_rc, p.softmax_scale, lse);
    cutlass::arch::NamedBarrier::sync(kThreads, Mainloop::kBarrierConsumers);
    stage_partial<kBlockM, kHeadDim>(o_rc, cO, lse, warp, &merge.o_warp[0][0][0], &merge.lse_warp[0][0], cl.rows);
    cutlass::arch::NamedBarrier::sync(kThreads, Mainloop::kBarrierConsumers);
    cute::cluster_wait();  // every CTA's landing barrier is initialised
    merge_staged_partials<kWarps, kHeadDim, kThreads>(
        tidx, &merge.o_warp[0][0][0], &merge.lse_warp[0][0], kWarps, kBlockM, cl.rows, p.headdim,
        [&](int r, float l, int c, const float4& o) {
          if (cl.splits == 1) {  // the tile's only split: its partial is the result (and st.async
                                 // wants a cluster of two CTAs or more)
            write_out(p, tile, r, c, o, l);
            return;
          }
          const int owner = r % cl.splits, slot = cl.rank * cl.slots + r / cl.splits;
          const uint32_t full = cluster_address(&landing.full, owner);
          if (c == 0) {
            cute::store_shared_remote(__float_as_uint(l), cute::cast_smem_ptr_to_uint(&landing.lse[slot]),
                                      cute::cast_smem_ptr_to_uint(&landing.full), owner);
          }
          store_to_cluster(cluster_address(&landing.o[slot][c], owner), o, full);
        });
  }

  // Consumers: the rows this CTA merges (r % splits == rank), once every split's partial of them
  // has landed, to out and (column 0) lse.
  static CUTE_DEVICE void merge_rows(const FwdParams& p, const FwdTile& tile, const Cluster& cl, Landing& landing,
                                     int thread_idx) {
    if (cl.splits == 1) return;  // (written by split_partial)
    const int rows_here = cl.rows_merged_here();
    if (thread_idx == 0) {  // each split's O and L of each row, its columns below headdim
      const uint32_t row_bytes = uint32_t(p.headdim) * 4 + 4;
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&landing.full, rows_here * cl.splits * row_bytes);
    }
    wait_cluster_writes(&landing.full, 0);
    merge_staged_partials<kMaxSplits, kHeadDim, kThreads>(
        thread_idx, &landing.o[0][0], landing.lse, cl.splits, cl.slots, rows_here, p.headdim,
        [&](int j, float l, int c, const float4& o) { write_out(p, tile, j * cl.splits + cl.rank, c, o, l); });
  }

  // Columns c .. c + 3 (below headdim) of the tile's row r (in the sequence) to out, and its L to
  // lse (column 0).
  static CUTE_DEVICE void write_out(const FwdParams& p, const FwdTile& tile, int r, int c, const float4& o, float lse) {
    const KvCacheRows cache{p, tile.bidb, tile.bidh, 0};
    const int q_row = tile.m_block * kBlockM + r;
    cutlass::NumericArrayConverter<Element, float, 4> convert;
    *reinterpret_cast<cutlass::Array<Element, 4>*>(static_cast<Element*>(p.o) + cache.q_row(p.o_stride, q_row) + c) =
        convert(reinterpret_cast<const cutlass::Array<float, 4>&>(o));
    if (c == 0) p.lse[cache.accum_row(0, q_row)] = lse;
  }
};

}  // namespace flashcute::sm90
