// flashcute — the sm80 backward main loop: FlashAttention-2, Algorithm 2, for one key tile j.
//
// K_j and V_j stay in shared memory, dK_j and dV_j in registers, while the CTA walks the query
// tiles i that see tile j (for every query head of the kv head's group), as the mask policy's
// cursor lists them:
//
//   S = Q_i K_j^T;  S = mod(S), masked;  P = exp(S - L_i)    (recomputed from the saved LSE)
//   dropout: keep regenerated (common/dropout.h)
//   dP = dO_i V_j^T;  dS = P * (keep dP / (1 - p) - D_i), times mod'(S)
//   dV_j += (P keep / (1 - p))^T dO_i;  dQ_i += dS K_j  (fp32 atomics; per-split in deterministic mode);
//   dK_j += dS^T Q_i
//
// Q_i and dO_i (with their L and D rows) are double-buffered where shared memory allows: the
// next step's tiles load during this one.
#pragma once

#include <cute/tensor.hpp>

#include "flashcute/common/bwd_pre_post.h"
#include "flashcute/common/dropout.h"
#include "flashcute/common/mask.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/score_mod.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/softmax.h"
#include "flashcute/common/utils.h"
#include "flashcute/sm80/traits.h"
#include "flashcute/sm80/utils.h"

namespace flashcute::sm80 {

using namespace cute;

template <typename Traits_, typename Mask_, bool kScoreMod_, bool kDropout_>
struct MainloopBwd {
  using Traits = Traits_;
  using Mask = Mask_;
  static constexpr bool kScoreMod = kScoreMod_;  // the kernel has softcap's and ALiBi's code
  static constexpr bool kDropout = kDropout_;    // the kernel has dropout's code
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kNThreads = Traits::kNThreads;
  static constexpr int kStages = Traits::kStagesQdO;

  // Q, dO (and their L, D rows) in kStages buffers; K, V; P and dS.
  struct SharedStorage {
    cute::array_aligned<Element, kStages * cute::cosize_v<typename Traits::SmemLayoutQ>> q;
    cute::array_aligned<Element, kStages * cute::cosize_v<typename Traits::SmemLayoutQ>> dout;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutKV>> k;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutKV>> v;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutPdS>> p;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutPdS>> ds;
    cute::array_aligned<float, kStages * kBlockM> lse;
    cute::array_aligned<float, kStages * kBlockM> dsum;
  };

  // This thread's dK or dV accumulator, cleared.
  using AccDKV = decltype(partition_fragment_C(typename Traits::TiledMmadKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  static CUTE_DEVICE AccDKV make_acc_dkv() {
    AccDKV acc = partition_fragment_C(typename Traits::TiledMmadKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    clear(acc);
    return acc;
  }

  // Algorithm 2's loop for key tile n_block of tile.bidh_kv; dQ goes to split `split` of the
  // accumulator.
  CUTE_DEVICE void run(const BwdParams& params, const DqAccumShape& dq_acc, const BwdTile& tile, int n_block, int split,
                       const SeqlenInfo& seqlen, AccDKV& acc_dk, AccDKV& acc_dv, SharedStorage& smem) const {
    const int tidx = threadIdx.x;
    const int h_per_kv = params.h_per_kv();
    const Mask mask(params, seqlen, kBlockM, kBlockN);

    // ---- Shared memory.
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});  // stage 0 of kStages
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutKV{});
    Tensor sP = make_tensor(make_smem_ptr(smem.p.data()), typename Traits::SmemLayoutPdS{});
    Tensor sdS = make_tensor(make_smem_ptr(smem.ds.data()), typename Traits::SmemLayoutPdS{});
    float* sLse = smem.lse.data();    // (kStages, kBlockM)
    float* sDsum = smem.dsum.data();  // (kStages, kBlockM)
    Tensor sQt = make_tensor(sQ.data(), typename Traits::SmemLayoutQt{});
    Tensor sQtNoSwizzle = make_tensor(sQ.data().get(), typename Traits::SmemLayoutQtNoSwizzle{});
    Tensor sdOt = make_tensor(sdO.data(), typename Traits::SmemLayoutQt{});
    Tensor sdOtNoSwizzle = make_tensor(sdO.data().get(), typename Traits::SmemLayoutQtNoSwizzle{});
    Tensor sKt = make_tensor(sK.data(), typename Traits::SmemLayoutKt{});
    Tensor sKtNoSwizzle = make_tensor(sK.data().get(), typename Traits::SmemLayoutKtNoSwizzle{});
    Tensor sPt = make_tensor(sP.data(), typename Traits::SmemLayoutPdSt{});
    Tensor sPtNoSwizzle = make_tensor(sP.data().get(), typename Traits::SmemLayoutPdStNoSwizzle{});
    Tensor sdSt = make_tensor(sdS.data(), typename Traits::SmemLayoutPdSt{});
    Tensor sdStNoSwizzle = make_tensor(sdS.data().get(), typename Traits::SmemLayoutPdStNoSwizzle{});

    // ---- Global -> shared copies (zero-filled past seqlen and headdim: those rows and columns
    // then contribute exact zeros to every GEMM).
    typename Traits::GmemTiledCopy gmem_copy;
    auto gmem_thr = gmem_copy.get_thread_slice(tidx);
    Tensor tQsQ = gmem_thr.partition_D(sQ);
    Tensor tdOsdO = gmem_thr.partition_D(sdO);
    Tensor tKsK = gmem_thr.partition_D(sK);
    Tensor tVsV = gmem_thr.partition_D(sV);
    Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    Tensor col_ok = column_predicate(tQcQ, params.headdim);

    // ---- MMAs: S and dP; dK and dV; dQ.
    typename Traits::TiledMmaSdP mma_sdp;
    auto thr_sdp = mma_sdp.get_thread_slice(tidx);
    Tensor tSrQ = thr_sdp.partition_fragment_A(sQ);
    Tensor tSrK = thr_sdp.partition_fragment_B(sK);
    Tensor tdPrdO = thr_sdp.partition_fragment_A(sdO);
    Tensor tdPrV = thr_sdp.partition_fragment_B(sV);
    typename Traits::TiledMmadKV mma_dkv;
    auto thr_dkv = mma_dkv.get_thread_slice(tidx);
    Tensor tdKrdSt = thr_dkv.partition_fragment_A(sdStNoSwizzle);
    Tensor tdKrQt = thr_dkv.partition_fragment_B(sQtNoSwizzle);
    Tensor tdVrPt = thr_dkv.partition_fragment_A(sPtNoSwizzle);
    Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOtNoSwizzle);
    typename Traits::TiledMmadQ mma_dq;
    auto thr_dq = mma_dq.get_thread_slice(tidx);
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKtNoSwizzle);

    // Shared -> register copies (ldmatrix; transposing for the ^T views).
    auto copy_sdp_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_sdp);
    auto thr_sdp_a = copy_sdp_a.get_thread_slice(tidx);
    Tensor tSsQ = thr_sdp_a.partition_S(sQ);
    Tensor tdPsdO = thr_sdp_a.partition_S(sdO);
    auto copy_sdp_b = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, mma_sdp);
    auto thr_sdp_b = copy_sdp_b.get_thread_slice(tidx);
    Tensor tSsK = thr_sdp_b.partition_S(sK);
    Tensor tdPsV = thr_sdp_b.partition_S(sV);
    auto copy_dkv_a = make_tiled_copy_A(typename Traits::SmemCopyAtomT{}, mma_dkv);
    auto thr_dkv_a = copy_dkv_a.get_thread_slice(tidx);
    Tensor tdKsdSt = thr_dkv_a.partition_S(sdSt);
    Tensor tdVsPt = thr_dkv_a.partition_S(sPt);
    auto copy_dkv_b = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dkv);
    auto thr_dkv_b = copy_dkv_b.get_thread_slice(tidx);
    Tensor tdKsQt = thr_dkv_b.partition_S(sQt);
    Tensor tdVsdOt = thr_dkv_b.partition_S(sdOt);
    auto copy_dq_a = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, mma_dq);
    auto thr_dq_a = copy_dq_a.get_thread_slice(tidx);
    Tensor tdQsdS = thr_dq_a.partition_S(sdS);
    auto copy_dq_b = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, mma_dq);
    auto thr_dq_b = copy_dq_b.get_thread_slice(tidx);
    Tensor tdQsKt = thr_dq_b.partition_S(sKt);
    // Registers -> shared for P and dS.
    auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_sdp);
    auto thr_pds = copy_pds.get_thread_slice(tidx);
    Tensor tPsP = thr_pds.partition_D(sP);
    Tensor tdSsdS = thr_pds.partition_D(sdS);

    // (row, col) of each S / dP element in its tile.
    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cS = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
    constexpr int kRowsS = decltype(size<0>(cS))::value;

    // A view of a Q or dO partition in the buffer of step `step` (Q and dO alternate between
    // kStages buffers, so that the next step's blocks load while this one computes).
    auto in_stage = [&](auto const& t, int step) __attribute__((always_inline)) {
      auto r = t;
      if (kStages > 1 && step % 2 == 1) r.data() = r.data() + size(sQ);
      return r;
    };

    // K_j and V_j: loaded once, kept in shared memory for the whole loop.
    __syncthreads();  // the previous key tile's last reads of sK/sV (its epilogue) are done
    const int rows_k = seqlen.k - n_block * kBlockN;
    Tensor gK = local_tile(head_tensor<Element, kHeadDim>(params.k, params.k_stride, tile.bidb, tile.bidh_kv, seqlen.k,
                                                          seqlen.k_offset),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
    Tensor gV = local_tile(head_tensor<Element, kHeadDim>(params.v, params.v_stride, tile.bidb, tile.bidh_kv, seqlen.k,
                                                          seqlen.k_offset),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
    copy_tile<true>(gmem_copy, gmem_thr.partition_S(gK), tKsK, tKcK, col_ok, rows_k);
    copy_tile<true>(gmem_copy, gmem_thr.partition_S(gV), tVsV, tKcK, col_ok, rows_k);

    // The steps: every (query head of this kv head, query block that sees key block j), as the
    // policy's cursor walks them.
    auto cur = mask.q_cursor(tile.bidb, tile.bidh_kv * h_per_kv, h_per_kv, n_block);

    auto load_q_do = [&](int step, int head, int m_block) __attribute__((always_inline)) {
      const int rows_q = seqlen.q - m_block * kBlockM;
      Tensor gQ = local_tile(head_tensor<Element, kHeadDim>(params.q, params.q_stride, tile.bidb, head, seqlen.q,
                                                            seqlen.q_offset),
                             Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
      Tensor gdO = local_tile(head_tensor<Element, kHeadDim>(params.dout, params.do_stride, tile.bidb, head, seqlen.q,
                                                             seqlen.q_offset),
                              Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
      copy_tile<true>(gmem_copy, gmem_thr.partition_S(gQ), in_stage(tQsQ, step), tQcQ, col_ok, rows_q);
      copy_tile<true>(gmem_copy, gmem_thr.partition_S(gdO), in_stage(tdOsdO, step), tQcQ, col_ok, rows_q);
      // L and D of the block's rows, 16 bytes per thread (padded to whole blocks by stage 1).
      constexpr int kRowChunks = kBlockM / 4;
      if (tidx < 2 * kRowChunks) {
        const int chunk = tidx % kRowChunks, stage = kStages > 1 ? step % 2 : 0;
        const bool is_d = tidx >= kRowChunks;
        const float* src = (is_d ? params.dsum : params.lse_log2) + dq_acc.rows_offset(tile.bidb, head, seqlen) +
                           m_block * kBlockM + chunk * 4;
        float* dst = (is_d ? sDsum : sLse) + stage * kBlockM + chunk * 4;
        SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>::copy(*reinterpret_cast<const cute::uint128_t*>(src),
                                                         *reinterpret_cast<cute::uint128_t*>(dst));
      }
      cp_async_fence();
    };
    if (cur.valid()) load_q_do(0, cur.head(), cur.tile());

    // One step on query block m_block of query head `head`; `next`: the cursor at the next step;
    // is_masked: the tile holds masked scores.
    auto step_fn = [&](int step, int head, int m_block, auto const& next, auto is_masked)
                       __attribute__((always_inline)) {

      cp_async_wait<0>();
      __syncthreads();  // Q_i, dO_i, L_i, D_i (and K_j, V_j) have landed; every warp is done with step - 1

      // L_i (log2 units) and D_i of this thread's rows (past seqlen_q: L = +inf, so P = 0 there).
      float lse_log2[kRowsS], dsum[kRowsS];
      {
        const int stage = kStages > 1 ? step % 2 : 0;
        CUTE_UNROLL
        for (int i = 0; i < kRowsS; ++i) {
          lse_log2[i] = sLse[stage * kBlockM + get<0>(cS(i, 0))];
          dsum[i] = sDsum[stage * kBlockM + get<0>(cS(i, 0))];
        }
      }
      // Double-buffered: the next Q_i, dO_i load into the other buffer during this whole step.
      if (kStages > 1 && next.valid()) load_q_do(step + 1, next.head(), next.tile());

      // S = Q_i K_j^T;  P = exp(scale * S - L), masked. P goes to shared memory (for dV) while
      // dP = dO_i V_j^T runs.
      Tensor acc_s = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      gemm_ss(mma_sdp, acc_s, tSrQ, tSrK, in_stage(tSsQ, step), tSsK, copy_sdp_a, copy_sdp_b, thr_sdp_a, thr_sdp_b);
      Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      if constexpr (kScoreMod) {
        ScoreMod(params, seqlen, tile.bidb, head).premask(s_rc, cS, m_block * kBlockM, n_block * kBlockN);
      }
      if constexpr (decltype(is_masked)::value) mask.apply(s_rc, cS, m_block * kBlockM, n_block * kBlockN);
      recompute_p(s_rc, lse_log2, params.softmax_scale_log2);
      Tensor rP = convert_fragment<Element>(acc_s);
      // Dropout: the forward's keep regenerated: P * keep for dV; P marked for keep * dP below.
      if constexpr (kDropout) {
        if (params.has_dropout()) {
          const DropoutMap dropout(params, tile.bidb, head);
          Tensor p_rc = make_tensor(rP.data(), acc_rowcol(rP.layout()));
          dropout.apply_signed(p_rc, s_rc, dropout.draw_all(cS, m_block * kBlockM, n_block * kBlockN));
        }
      }
      copy(copy_pds, thr_pds.retile_S(rP), tPsP);

      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_dp);
      gemm_ss(mma_sdp, acc_dp, tdPrdO, tdPrV, in_stage(tdPsdO, step), tdPsV, copy_sdp_a, copy_sdp_b, thr_sdp_a,
              thr_sdp_b);
      // dS = P * (dP - D), to shared memory (for dK and dQ). Dropout: dS = P * (keep dP - (1 - p) D)
      // (D was scaled by 1 - p in stage 1; dQ, dK are scaled by 1 / (1 - p) at the end).
      Tensor dp_rc = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
      softmax_grad<kDropout>(dp_rc, s_rc, dsum);
      if constexpr (kScoreMod) {
        ScoreMod(params, seqlen, tile.bidb, head)
            .grad(dp_rc, s_rc, cS, m_block * kBlockM, n_block * kBlockN, lse_log2, params.softmax_scale_log2);
      }
      Tensor rdS = convert_fragment<Element>(acc_dp);
      copy(copy_pds, thr_pds.retile_S(rdS), tdSsdS);
      __syncthreads();

      // dQ_i += dS K_j, added to the fp32 accumulator (scaled by `scale` in stage 3).
      auto accumulate_dq = [&]() __attribute__((always_inline)) {
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        clear(acc_dq);
        gemm_ss(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_dq_a, copy_dq_b, thr_dq_a, thr_dq_b);
        // The tile is stored in thread order (see DqAccumShape): vector or scalar atomics
        // (Traits::kDqAccumVector), each warp's covering contiguous bytes. Atomic adds in both
        // modes: in deterministic mode only this CTA adds to its split, and one thread's
        // reductions to one address apply in program order, so the sums are reproducible.
        constexpr int kVector = Traits::kDqAccumVector;
        float* dq_tile = params.dq_accum + dq_acc.offset(split, tile.bidb, head, seqlen) + int64_t(m_block) * kBlockM * kHeadDim;
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dq); i += kVector) {
          float* dst = dq_tile + dq_accum_value<kVector, Traits::kNThreads>(i) + dq_accum_thread<kVector>(tidx);
          if constexpr (kVector == 4) {
            atomicAdd(reinterpret_cast<float4*>(dst),
                      make_float4(acc_dq(i), acc_dq(i + 1), acc_dq(i + 2), acc_dq(i + 3)));
          } else {
            atomicAdd(dst, acc_dq(i));
          }
        }
      };

      // dV_j += P^T dO_i;  dQ_i += dS K_j;  dK_j += dS^T Q_i. The dQ reductions drain while the
      // dK GEMM runs.
      gemm_ss(mma_dkv, acc_dv, tdVrPt, tdVrdOt, tdVsPt, in_stage(tdVsdOt, step), copy_dkv_a, copy_dkv_b, thr_dkv_a,
              thr_dkv_b);
      if constexpr (kStages > 1) accumulate_dq();
      gemm_ss(mma_dkv, acc_dk, tdKrdSt, tdKrQt, tdKsdSt, in_stage(tdKsQt, step), copy_dkv_a, copy_dkv_b, thr_dkv_a,
              thr_dkv_b);
      if constexpr (kStages == 1) {
        if (next.valid()) {
          __syncthreads();                                   // every warp is done with sQ and sdO
          load_q_do(step + 1, next.head(), next.tile());  // the next Q, dO load while dQ_i is accumulated
        }
        accumulate_dq();
      }
    };

    CUTE_NO_UNROLL
    for (int step = 0; cur.valid(); ++step) {
      const int head = cur.head(), m_block = cur.tile();
      cur.advance();
      if (mask.needs_mask(m_block, n_block)) {
        step_fn(step, head, m_block, cur, cute::true_type{});
      } else {
        step_fn(step, head, m_block, cur, cute::false_type{});
      }
    }
    cp_async_wait<0>();  // nothing may still be landing in shared memory
  }
};

}  // namespace flashcute::sm80
