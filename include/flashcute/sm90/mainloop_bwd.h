// flashcute — the sm90 backward main loop: FlashAttention-2's Algorithm 2 for one key tile j on
// Hopper, split between a producer warp that moves tiles and two consumer warpgroups.
//
// Producer (load): K_j and V_j once, by TMA; then, for every (query head of the kv head's group,
// query tile i) the mask policy's cursor lists, Q_i and dO_i into a stage of a kStages-deep ring,
// and L_i and D_i into the same stage by the whole warp, with ordinary loads and stores. (Bulk
// copies of L_i and D_i made compute-sanitizer's racecheck report every read of them as racing
// with the copies, which it does not see complete on the mbarrier; loaded by the consumers at each
// step's start instead, their L2 latency was 3-8% of the consumers' stall samples.)
//
// Consumers (mma): warpgroup w owns keys 64w .. 64w + 63 of the tile: their columns of S and dP,
// their rows of dK_j and dV_j (in registers for the whole loop). One step on tile i:
//
//   S = Q_i K_j^T;  dP = dO_i V_j^T                       (both issued at once, wgmma SS)
//   S = mod(S), masked;  P = exp(S - L_i)                  (recomputed from the saved LSE)
//   dropout: keep regenerated (common/dropout.h)
//   dS = P * (keep dP / (1 - p) - D_i), times mod'(S)
//   P, dS -> shared memory; both warpgroups sync (dQ needs every key's dS)
//   dQ_i = dS K_j  (the head dim split between the warpgroups);  dV_j += P^T dO_i;  dK_j += dS^T Q_i
//   dQ_i -> shared memory (fp32, thread order) -> one bulk reduction into the global accumulator
//
// The dQ GEMM is issued first, so its result is staged while the dV and dK GEMMs still run; the
// bulk reduction drains during the next step (it is waited for before the next staging).
//
// Swapped (Traits::kSwapSdP, the dense kernels without dropout; FlashAttention-3's SdP_swapAB):
// warpgroup w computes S^T = K_j Q_i^T and dP^T = V_j dO_i^T for its keys (rows of the
// accumulator), so P^T and dS^T are the register A operands of dV_j += P^T dO_i (issued as soon as
// P is, under dS's computation) and dK_j += dS^T Q_i; only dS goes to shared memory (transposed
// stmatrix), for dQ. L_i and D_i, one per query column, are read from the stage where used.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flashcute/common/bwd_pre_post.h"
#include "flashcute/common/dropout.h"
#include "flashcute/common/mask.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/score_mod.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/softmax.h"
#include "flashcute/common/utils.h"
#include "flashcute/sm90/traits.h"
#include "flashcute/sm90/utils.h"

namespace flashcute::sm90 {

using namespace cute;

// Named barriers of the backward (user ids; CUTLASS reserves the ones below them).
enum class BwdBarrier : uint32_t {
  kPdSReady = 0,
  kdQStaged = 1,
  kEpilogueWG0 = 2,
  kEpilogueWG1 = 3,
  kLoopDone = 4,      // release_kv()
  kEpilogueDone = 5,  // both warpgroups have read their staged dK, dV (the next tile stores P, dS)
};

// Per-row statistics (L_i or D_i) of a stage, read where used: row r of a (query row, key col)
// coordinate view -> the stage's value of its query row.
template <typename Coords>
struct StageRows {
  const float* stage;
  Coords const& c;
  CUTE_DEVICE float operator[](int r) const { return stage[get<0>(c(r, 0))]; }
};

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
  static constexpr int kStages = Traits::kStages;
  static constexpr int kNThreads = Traits::kNThreads;
  static constexpr int kNumMmaThreads = Traits::kNumMmaThreads;
  static constexpr bool kSwapSdP = Traits::kSwapSdP;  // S^T, dP^T: P^T, dS^T feed dV, dK from registers
  static_assert(!(kSwapSdP && (kDropout || kScoreMod)), "dropout's draws and the score modifications take S's rows");
  using TiledMmaSdP = typename Traits::TiledMmaSdP;
  using TiledMmadKV = typename Traits::TiledMmadKV;
  using TiledMmadQ = typename Traits::TiledMmadQ;

  struct Params {
    BwdParams p;
    DqAccumShape dq_acc;
    typename Traits::TmaQ tma_q, tma_do;
    typename Traits::TmaK tma_k, tma_v;
    typename Traits::ShapeQKV shape_q, shape_k;
  };

  // The epilogue stages dK_j in P's and dS's space and dV_j in dQ's, so that the producer loads
  // the next key tile's K and V while the consumers store this one's dK and dV.
  using TileKV = cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutK>, 1024>;
  using TilePdS = cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutPdS>, 1024>;
  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutQ>, 1024> q;  // kStages
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutQ>, 1024> dout;
    TileKV k, v;
    union {
      struct {
        TilePdS p, ds;
      } pds;
      TileKV dk;  // the epilogue's
    } pds_dk;
    union {
      cute::array_aligned<float, kBlockM * kHeadDim, 1024> dq;  // in thread order (common/bwd_pre_post.h)
      TileKV dv;  // the epilogue's
    } dq_dv;
    cute::array_aligned<float, kStages * kBlockM, 16> lse_log2, dsum;  // L_i, D_i of each ring stage
    uint64_t barrier_kv, barrier_kv_empty;
    StageRing<kStages> ring;  // Q_i, dO_i (TMA), L_i, D_i (warp 0 stores)
    StageRing<1> tiles;       // the next tile index (PersistentKvTileScheduler), producer -> consumers
    int next_tile;
  };
  static_assert(2 * sizeof(TilePdS) >= sizeof(TileKV) && kBlockM * kHeadDim * sizeof(float) >= sizeof(TileKV));

  using AccDKV = decltype(partition_fragment_C(TiledMmadKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  static CUTE_DEVICE AccDKV make_acc_dkv() {
    AccDKV acc = partition_fragment_C(TiledMmadKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    clear(acc);
    return acc;
  }

  // ---- Host: the TMA descriptors of a call (as the forward's: packed batches are one batch).
  static Params to_params(const BwdParams& p, const DqAccumShape& dq_acc) {
    const bool packed = p.is_varlen();
    const int batch = packed ? 1 : p.batch;
    const int rows_q = packed ? p.total_q : p.seqlen_q, rows_k = packed ? p.total_k : p.seqlen_k;
    auto gq = tma_gmem_tensor<Element>(p.q, p.q_stride, rows_q, p.headdim, p.nheads, batch);
    auto gdo = tma_gmem_tensor<Element>(p.dout, p.do_stride, rows_q, p.headdim, p.nheads, batch);
    auto gk = tma_gmem_tensor<Element>(p.k, p.k_stride, rows_k, p.headdim, p.nheads_kv, batch);
    auto gv = tma_gmem_tensor<Element>(p.v, p.v_stride, rows_k, p.headdim, p.nheads_kv, batch);
    auto tile_q = take<0, 2>(typename Traits::SmemLayoutQ{});
    Params kp;
    kp.p = p;
    kp.dq_acc = dq_acc;
    kp.shape_q = gq.shape();
    kp.shape_k = gk.shape();
    kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gq, tile_q, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
    kp.tma_do = make_tma_copy(SM90_TMA_LOAD{}, gdo, tile_q, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
    kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gk, typename Traits::SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
    kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gv, typename Traits::SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
    return kp;
  }

  // ---- Device. Thread 0 initialises the barriers before the CTA's first __syncthreads.
  static CUTE_DEVICE void init(const Params& params, SharedStorage& smem) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_do.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    cutlass::arch::ClusterTransactionBarrier::init(&smem.barrier_kv, 1);
    cutlass::arch::ClusterBarrier::init(&smem.barrier_kv_empty, Traits::kNumMmaWarpGroups);
    // Every consumer thread releases a stage (it read L and D there with ordinary loads: one
    // release per warpgroup, ordered after them by the named barriers, is correct too, but
    // compute-sanitizer's racecheck does not follow that chain); warp 0's 32 lanes each arrive on
    // `full` after their L, D stores.
    smem.ring.init(kNumMmaThreads, /*producer_arrivals=*/1 + 32);
    smem.tiles.init(kNumMmaThreads);  // every consumer thread reads the index, then releases it
    cutlass::arch::fence_barrier_init();
  }

  // Producer: one elected lane of warp 0 issues every TMA copy of key tile n_block = tile.x, the CTA's
  // kv_use-th (deterministic mode walks several); the whole warp copies L_i and D_i into each stage
  // with ordinary loads and stores. `i` counts the ring's uses across key tiles.
  CUTE_DEVICE void load(const Params& params, const BwdTile& tile, int kv_use, const SeqlenInfo& seqlen,
                        SharedStorage& smem, int& i) const {
    const int n_block = tile.x;
    const BwdParams& p = params.p;
    const int b = p.is_varlen() ? 0 : tile.bidb;
    const int h_per_kv = p.h_per_kv();
    Tensor mK = params.tma_k.get_tma_tensor(params.shape_k)(_, _, tile.bidh_kv, b);
    Tensor mV = params.tma_v.get_tma_tensor(params.shape_k)(_, _, tile.bidh_kv, b);
    auto kv_tile = [&](auto const& m) {
      return local_tile(domain_offset(make_coord(seqlen.k_offset, _0{}), m), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                        make_coord(n_block, _0{}));
    };
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutK{});
    auto cta_q = params.tma_q.get_slice(_0{});
    auto cta_do = params.tma_do.get_slice(_0{});
    auto cta_k = params.tma_k.get_slice(_0{});
    auto cta_v = params.tma_v.get_slice(_0{});
    Tensor tQsQ = group_modes<0, 3>(cta_q.partition_D(sQ));     // (TMA, stages)
    Tensor tdOsdO = group_modes<0, 3>(cta_do.partition_D(sdO));  // (TMA, stages)
    const bool leader = cute::elect_one_sync();
    const int lane = threadIdx.x % 32;

    // K_j, V_j: once the consumers have released the previous key tile's (release_kv).
    if (leader) {
      if (kv_use > 0) cutlass::arch::ClusterBarrier::wait(&smem.barrier_kv_empty, (kv_use - 1) & 1);
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&smem.barrier_kv, 2 * Traits::kBytesK);
      copy(params.tma_k.with(smem.barrier_kv), cta_k.partition_S(kv_tile(mK)), cta_k.partition_D(sK));
      copy(params.tma_v.with(smem.barrier_kv), cta_v.partition_S(kv_tile(mV)), cta_v.partition_D(sV));
    }

    const Mask mask(p, seqlen, kBlockM, kBlockN);
    for (auto cur = mask.q_cursor(tile.bidb, tile.bidh_kv * h_per_kv, h_per_kv, n_block); cur.valid();
         cur.advance(), ++i) {
      const int head = cur.head(), m_block = cur.tile(), stage = smem.ring.stage(i);
      // L_i (log2 units) and D_i of the tile's rows (padded to whole blocks by the preprocess; past
      // seqlen_q L = +inf, so P = 0 there). Loaded by the consumers at each step's start instead,
      // their L2 latency was 3% (d128) to 8% (d64) of the consumers' stall samples (ncu); here the
      // backward is 1-6% faster (H100, docs/NOTES.md session 14).
      smem.ring.wait_empty(i);
      const int64_t rows = params.dq_acc.rows_offset(tile.bidb, head, seqlen) + int64_t(m_block) * kBlockM;
      CUTE_UNROLL
      for (int r = lane; r < kBlockM; r += 32) {
        smem.lse_log2[stage * kBlockM + r] = p.lse_log2[rows + r];
        smem.dsum[stage * kBlockM + r] = p.dsum[rows + r];
      }
      smem.ring.fill_done(i);
      if (!leader) continue;
      uint64_t& full = smem.ring.acquire(i, 2 * Traits::kBytesQ);
      auto q_tile = [&](auto const& tma, auto const& m) {
        return group_modes<0, 3>(tma.get_slice(_0{}).partition_S(
            local_tile(domain_offset(make_coord(seqlen.q_offset, _0{}), m(_, _, head, b)),
                       Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, _0{}))));
      };
      copy(params.tma_q.with(full), q_tile(params.tma_q, params.tma_q.get_tma_tensor(params.shape_q)), tQsQ(_, stage));
      copy(params.tma_do.with(full), q_tile(params.tma_do, params.tma_do.get_tma_tensor(params.shape_q)),
           tdOsdO(_, stage));
    }
  }

  // Consumers: Algorithm 2's loop for key tile n_block = tile.x (the CTA's kv_use-th); dQ goes to split
  // `split` of the accumulator. thread_idx counts the consumer threads from 0.
  CUTE_DEVICE void mma(const Params& params, const BwdTile& tile, int kv_use, int split,
                       const SeqlenInfo& seqlen, AccDKV& acc_dk, AccDKV& acc_dv, SharedStorage& smem, int thread_idx,
                       int& i) const {
    const BwdParams& p = params.p;
    const int n_block = tile.x;
    const int h_per_kv = p.h_per_kv();
    const Mask mask(p, seqlen, kBlockM, kBlockN);

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQt{});
    Tensor sdO = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQ{});
    Tensor sdOt = make_tensor(make_smem_ptr(smem.dout.data()), typename Traits::SmemLayoutQt{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sKt = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutKt{});
    Tensor sV = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutK{});
    Tensor sP = make_tensor(make_smem_ptr(smem.pds_dk.pds.p.data()), typename Traits::SmemLayoutPdS{});
    Tensor sPt = make_tensor(make_smem_ptr(smem.pds_dk.pds.p.data()), typename Traits::SmemLayoutPdSt{});
    Tensor sdS = make_tensor(make_smem_ptr(smem.pds_dk.pds.ds.data()), typename Traits::SmemLayoutPdS{});
    Tensor sdSt = make_tensor(make_smem_ptr(smem.pds_dk.pds.ds.data()), typename Traits::SmemLayoutPdSt{});

    // The GEMMs' operands: shared-memory descriptors.
    TiledMmaSdP mma_sdp;
    TiledMmadKV mma_dkv;
    TiledMmadQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(thread_idx);
    auto thr_dkv = mma_dkv.get_thread_slice(thread_idx);
    auto thr_dq = mma_dq.get_thread_slice(thread_idx);
    // S and dP take Q, dO as A and K, V as B (swapped: the other way round).
    auto frag_qdo = [&](auto const& t) {
      if constexpr (kSwapSdP) return thr_sdp.partition_fragment_B(t); else return thr_sdp.partition_fragment_A(t);
    };
    auto frag_kv = [&](auto const& t) {
      if constexpr (kSwapSdP) return thr_sdp.partition_fragment_A(t); else return thr_sdp.partition_fragment_B(t);
    };
    Tensor tSrQ = frag_qdo(sQ);     // (MMA, MMA_M or MMA_N, MMA_K, stages)
    Tensor tSrK = frag_kv(sK);
    Tensor tdPrdO = frag_qdo(sdO);  // (MMA, MMA_M or MMA_N, MMA_K, stages)
    Tensor tdPrV = frag_kv(sV);
    Tensor tdVrdOt = thr_dkv.partition_fragment_B(sdOt);  // (MMA, MMA_N, MMA_K, stages)
    Tensor tdKrQt = thr_dkv.partition_fragment_B(sQt);    // (MMA, MMA_N, MMA_K, stages)
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);
    // Registers -> shared for P and dS (stmatrix; swapped: dS^T, transposed into dS's tile).
    auto copy_pds = make_tiled_copy_C(typename Traits::SmemCopyAtomPdS{}, mma_sdp);
    auto thr_pds = copy_pds.get_thread_slice(thread_idx);
    Tensor tdSsdS = thr_pds.partition_D(cute::conditional_return<kSwapSdP>(sdSt, sdS));

    // S's and dP's accumulators, and their (query row, key col) views: the accumulator's (rows,
    // cols), or (swapped) its (cols, rows).
    using ShapeSdP = std::conditional_t<kSwapSdP, Shape<Int<kBlockN>, Int<kBlockM>>, Shape<Int<kBlockM>, Int<kBlockN>>>;
    auto qk_view = [](auto&& acc) {
      if constexpr (kSwapSdP) {
        return make_tensor(acc.data(), select<1, 0>(acc_rowcol(acc.layout())));
      } else {
        return make_tensor(acc.data(), acc_rowcol(acc.layout()));
      }
    };
    // (query, key) of each S / dP element in the tile.
    auto coord_qk = [] {
      if constexpr (kSwapSdP) {
        return make_coord_tensor(make_layout(ShapeSdP{}, make_stride(E<1>{}, E<0>{})));
      } else {
        return make_identity_tensor(ShapeSdP{});
      }
    };
    Tensor tScS = thr_sdp.partition_C(coord_qk());
    Tensor cS = qk_view(tScS);
    constexpr int kRowsS = decltype(size<0>(cS))::value;

    cutlass::arch::ClusterBarrier::wait(&smem.barrier_kv, kv_use & 1);  // K_j, V_j have landed

    // One step on query tile m_block of query head `head`; is_masked: the tile holds masked scores.
    auto step = [&](int head, int m_block, auto is_masked) __attribute__((always_inline)) {
      const int stage = smem.ring.stage(i);
      const int row0 = m_block * kBlockM, col0 = n_block * kBlockN;
      smem.ring.wait_full(i);
      // L_i and D_i of this thread's query rows: in registers, or (swapped: a quarter of the tile's
      // rows each) read from the stage where they are used.
      float lse_rows[kSwapSdP ? 1 : kRowsS], dsum_rows[kSwapSdP ? 1 : kRowsS];
      if constexpr (!kSwapSdP) {
        CUTE_UNROLL
        for (int r = 0; r < kRowsS; ++r) {
          lse_rows[r] = smem.lse_log2[stage * kBlockM + get<0>(cS(r, 0))];
          dsum_rows[r] = smem.dsum[stage * kBlockM + get<0>(cS(r, 0))];
        }
      }
      const StageRows<decltype(cS)> lse_stage{smem.lse_log2.data() + stage * kBlockM, cS};
      const StageRows<decltype(cS)> dsum_stage{smem.dsum.data() + stage * kBlockM, cS};
      auto const& lse_log2 = cute::conditional_return<kSwapSdP>(lse_stage, lse_rows);
      auto const& dsum = cute::conditional_return<kSwapSdP>(dsum_stage, dsum_rows);
      // S = Q_i K_j^T and dP = dO_i V_j^T (swapped: S^T = K_j Q_i^T, dP^T = V_j dO_i^T), issued together.
      Tensor acc_s = partition_fragment_C(mma_sdp, ShapeSdP{});
      Tensor acc_dp = partition_fragment_C(mma_sdp, ShapeSdP{});
      if constexpr (kSwapSdP) {
        gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_sdp, tSrK, tSrQ(_, _, _, stage), acc_s);
        gemm<true, -1>(mma_sdp, tdPrV, tdPrdO(_, _, _, stage), acc_dp);
      } else {
        gemm<true, -1>(mma_sdp, tSrQ(_, _, _, stage), tSrK, acc_s);
        gemm<true, -1>(mma_sdp, tdPrdO(_, _, _, stage), tdPrV, acc_dp);
      }
      warpgroup_wait<1>();  // S is ready; dP still runs

      // P = exp(scale * mod(S) - L), masked, to shared memory for dV (dropout: P * keep, and P's
      // sign marks the dropped scores for dS below); swapped: dV_j += P^T dO_i from registers, which
      // runs under dS's computation.
      Tensor s_rc = qk_view(acc_s);
      if constexpr (kScoreMod) ScoreMod(p, seqlen, tile.bidb, head).premask(s_rc, cS, row0, col0);
      if constexpr (decltype(is_masked)::value) mask.apply(s_rc, cS, row0, col0);
      recompute_p(s_rc, lse_log2, p.softmax_scale_log2);
      if constexpr (kSwapSdP) {
        Tensor rP = convert_fragment<Element>(acc_s);
        gemm<false, -1>(mma_dkv, make_tensor(rP.data(), acc_as_A(rP.layout())), tdVrdOt(_, _, _, stage), acc_dv);
        warpgroup_wait<1>();  // dP is ready; dV still runs
      } else {
        Tensor tPsP = thr_pds.partition_D(sP);
        if constexpr (kDropout) {
          if (p.has_dropout()) DropoutMap(p, tile.bidb, head).mark_dropped(s_rc, cS, row0, col0);
        }
        store_converted</*kRelu=*/kDropout>(copy_pds, thr_pds.retile_S(acc_s), tPsP);  // dropout: P * keep
        warpgroup_wait<0>();
      }

      // dS = P * (dP - D) (dropout: P * (keep dP - (1 - p) D); D was scaled by 1 - p in stage 1),
      // to shared memory for dQ and dK (swapped: for dQ; dK takes it from registers).
      Tensor dp_rc = qk_view(acc_dp);
      softmax_grad<kDropout>(dp_rc, s_rc, dsum);
      if constexpr (kScoreMod) {
        ScoreMod(p, seqlen, tile.bidb, head).grad(dp_rc, s_rc, cS, row0, col0, lse_log2, p.softmax_scale_log2);
      }
      auto rdS = [&] {
        if constexpr (kSwapSdP) {
          Tensor r = convert_fragment<Element>(acc_dp);
          copy(copy_pds, thr_pds.retile_S(r), tdSsdS);
          return r;
        } else {
          store_converted(copy_pds, thr_pds.retile_S(acc_dp), tdSsdS);
          return cute::tuple<>{};
        }
      }();
      // The previous step's dQ reduction has read the staging buffer (it drained during this step).
      if (thread_idx == 0) bulk_wait_all();
      cutlass::arch::fence_view_async_shared();  // P and dS visible to wgmma
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(BwdBarrier::kPdSReady));

      // dQ_i = dS K_j (this warpgroup's half of the head dim);  dV_j += P^T dO_i;  dK_j += dS^T Q_i.
      Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
      gemm<true, -1>(mma_dq, tdQrdS, tdQrKt, acc_dq);
      if constexpr (kSwapSdP) {
        gemm<false, -1>(mma_dkv, make_tensor(rdS.data(), acc_as_A(rdS.layout())), tdKrQt(_, _, _, stage), acc_dk);
        warpgroup_wait<1>();  // dQ is ready (and dV); dK still runs
      } else {
        gemm<false, -1>(mma_dkv, thr_dkv.partition_fragment_A(sPt), tdVrdOt(_, _, _, stage), acc_dv);
        gemm<false, -1>(mma_dkv, thr_dkv.partition_fragment_A(sdSt), tdKrQt(_, _, _, stage), acc_dk);
        warpgroup_wait<2>();  // dQ is ready; dV and dK still run
      }

      // dQ_i -> shared memory in thread order (16-byte stores, conflict-free) -> one bulk reduction
      // of the whole tile into the accumulator.
      static_assert(Traits::kDqAccumVector == 4, "the tile is staged in 16-byte vectors");
      float* sdq = smem.dq_dv.dq.data() + dq_accum_thread<4>(thread_idx);
      CUTE_UNROLL
      for (int e = 0; e < size(acc_dq); e += 4) {
        *reinterpret_cast<float4*>(sdq + dq_accum_value<4, kNumMmaThreads>(e)) =
            make_float4(acc_dq(e), acc_dq(e + 1), acc_dq(e + 2), acc_dq(e + 3));
      }
      cutlass::arch::fence_view_async_shared();
      cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(BwdBarrier::kdQStaged));
      if (thread_idx == 0) {
        float* dq_tile = p.dq_accum + params.dq_acc.offset(split, tile.bidb, head, seqlen) +
                         int64_t(m_block) * kBlockM * kHeadDim;
        bulk_reduce_add_f32(dq_tile, smem.dq_dv.dq.data(), kBlockM * kHeadDim * sizeof(float));
      }
      warpgroup_wait<0>();
      smem.ring.release(i, true);  // Q_i, dO_i, L_i, D_i are read
      ++i;
    };

    CUTE_NO_UNROLL
    for (auto cur = mask.q_cursor(tile.bidb, tile.bidh_kv * h_per_kv, h_per_kv, n_block); cur.valid(); cur.advance()) {
      if (mask.needs_mask(cur.tile(), n_block)) {
        step(cur.head(), cur.tile(), cute::true_type{});
      } else {
        step(cur.head(), cur.tile(), cute::false_type{});
      }
    }
  }

  // Consumers, after mma(): once both warpgroups' GEMMs are done with K_j, V_j, P and dS, and the
  // last dQ reduction has read its staging buffer, K_j and V_j are released to the producer (the
  // next tile's loads) and the epilogue may stage dK_j, dV_j in P's, dS's and dQ's space.
  static CUTE_DEVICE void release_kv(SharedStorage& smem, int thread_idx) {
    if (thread_idx == 0) bulk_wait_all();
    cutlass::arch::NamedBarrier::sync(kNumMmaThreads, uint32_t(BwdBarrier::kLoopDone));
    if (thread_idx % 128 == 0) cutlass::arch::ClusterBarrier::arrive(&smem.barrier_kv_empty);
  }
};

}  // namespace flashcute::sm90
