// flashcute — the sm90 forward main loop: FlashAttention-2's Algorithm 1 on Hopper, split
// between a producer warp that moves tiles and consumer warpgroups that compute.
//
// Producer (load): Q, then K_j and V_j of the key tiles the mask policy lists, by TMA into
// GMMA-swizzled shared memory, through kStages-deep rings of mbarriers (sm90/utils.h). V_j is
// issued after K_{j+1}: the consumers need it only once S_{j+1} is under way. Q has a ring of
// one stage, released as soon as the tile's last S GEMM is done: a persistent CTA's next tile
// (Q, and K_0 as soon as a K stage is free) loads under the last softmax, the last O += P V and
// the epilogue.
//
// Consumers (mma): each warpgroup owns 64 rows of S and O. Software-pipelined by one tile, so
// the softmax of tile j runs while the tensor cores work on tile j - 1's O += P V:
//
//   S_0 = Q K_0^T; S_0 = mod(S_0), masked; softmax (m, l, P_0); P_0 *= keep (dropout)
//   for each further tile j:   issue S_j = Q K_j^T;  issue O += P_{j-1} V_{j-1}      (async wgmma)
//                              wait for S_j;  S_j = mod(S_j), masked;  m, l, P_j;  P_j *= keep
//                              wait for O;  O *= e^(m_old - m)
//   O += P_last V_last
//
// With two or three consumer warpgroups the GEMM issue goes round between them (named
// barriers), so one warpgroup's softmax runs under the others' GEMMs (FlashAttention-3's
// ping-pong).
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

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

// Named barriers of the forward (user ids; CUTLASS reserves the ones below them).
// One of each per consumer warpgroup (up to three): kSchedulerWG0 + w, kEpilogueWG0 + w.
enum class FwdBarrier : uint32_t { kSchedulerWG0 = 0, kEpilogueWG0 = 3 };

template <typename Traits_, typename Mask_, bool kFeatures_>
struct MainloopFwd {
  using Traits = Traits_;
  using Mask = Mask_;
  using Element = typename Traits::Element;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kBlockN = Traits::kBlockN;
  static constexpr int kHeadDim = Traits::kHeadDim;
  static constexpr int kStages = Traits::kStages;
  static constexpr int kNThreads = Traits::kNThreads;
  static constexpr int kNumMmaWarpGroups = Traits::kNumMmaWarpGroups;
  static_assert(kNumMmaWarpGroups <= int(FwdBarrier::kEpilogueWG0) - int(FwdBarrier::kSchedulerWG0),
                "one scheduler barrier per consumer warpgroup below the epilogue's");
  // Ping-pong between the consumer warpgroups (FA3 measured it for head dims up to 128).
  static constexpr bool kPingPong = kNumMmaWarpGroups >= 2 && kHeadDim <= 128;
  // Whether the kernel has the code of dropout, softcap and ALiBi (run-time branches), or is one
  // for plain calls only (fwd_launch.h). Tiles of keys not a multiple of 32 (176, 112, 80) have
  // plain kernels only: dropout's draws cover 32 adjacent columns of a warp's rows
  // (common/dropout.h).
  static constexpr bool kFeatures = kFeatures_;
  static_assert(!kFeatures || kBlockN % 32 == 0, "dropout's draw blocks are 32 keys wide");
  // The softmax's row max in 4 interleaved chains at d128 and in the 192-row tiles (d <= 64), one
  // elsewhere; its row sum in 2 chains at d64 and d128 (common/softmax.h). Measured on the H200
  // (bf16, 16k tokens, 3 alternating rounds). d128, 4 chains against one: non-causal 512-16384
  // tokens -1.1..-3.1%, causal -0.8..+0.7% (session 30; 8 against 4: -0.9..+1.9%). The 192-row d64
  // tile (plain calls' twins), 4 max and 2 sum chains against one of each: d64 non-causal
  // 512-16384 and causal 16k -1.2..-6.6% in the same rounds (the ratio to cuDNN +1.4..+6.5%);
  // d64's 128-row tile (short causal calls) with 2 or 4 max chains +3.7..+5.7% slower, so one; 2
  // sum chains at d128 median -0.4 / -0.8% in two runs, at d64's 128-row tile within 0.5%
  // (docs/NOTES.md, session 46). Not measured: other head dims (d32's 192-row tile has 4 max
  // chains by this rule), and the 192-row kernels with the features' code (calls with dropout,
  // softcap or ALiBi; windows with a left edge), which take the same counts.
  static constexpr int kSoftmaxMaxChains = kHeadDim == 128 || kBlockM == 192 ? 4 : 1;
  static constexpr int kSoftmaxSumChains = kHeadDim == 64 || kHeadDim == 128 ? 2 : 1;
  using TiledMmaQK = typename Traits::TiledMmaQK;
  using TiledMmaPV = typename Traits::TiledMmaPV;

  // The kernel's parameters: the shared parameter block and the TMA descriptors built from it on
  // the host (they must live in the kernel's __grid_constant__ parameter space).
  struct Params {
    FwdParams p;
    typename Traits::TmaQ tma_q;
    typename Traits::TmaK tma_k;
    typename Traits::TmaV tma_v;
    typename Traits::ShapeQKV shape_q, shape_k, shape_vt;
  };

  // O's own buffer (persistent CTAs) or nothing (O reuses Q's space).
  struct SmemOwnO {
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutO>, 1024> o;
  };
  struct NoSmemO {};

  struct SharedStorage {
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<typename Traits::SmemLayoutVt>, 1024> v;
    std::conditional_t<Traits::kPersistent, SmemOwnO, NoSmemO> o;
    StageRing<1> ring_q;
    StageRing<kStages> ring_k, ring_v;
  };
  static CUTE_DEVICE Element* smem_o(SharedStorage& smem) {
    if constexpr (Traits::kPersistent) {
      return smem.o.o.data();
    } else {
      return smem.q.data();
    }
  }

  // Where the rings stand, carried from tile to tile by each role of a persistent CTA: the uses
  // of Q's stage so far, and of the K and V rings (one use of each per key tile).
  struct PipelineState {
    int q = 0;
    int kv = 0;
  };

  using AccO = decltype(partition_fragment_C(TiledMmaPV{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  static constexpr int kRows = decltype(size<0>(acc_rowcol(std::declval<AccO>().layout())))::value;
  static CUTE_DEVICE AccO make_acc_o() {
    AccO acc_o = partition_fragment_C(TiledMmaPV{}, Shape<Int<kBlockM>, Int<kHeadDim>>{});
    clear(acc_o);
    return acc_o;
  }

  // ---- Host: the TMA descriptors of a call. Global tensors are (rows, headdim, heads, batch);
  // packed batches are one batch of all rows (tiles start at the sequence's offset).
  static Params to_params(const FwdParams& p) {
    const bool packed = p.is_varlen();
    const int batch = packed ? 1 : p.batch;
    const int rows_q = packed ? p.total_q : p.seqlen_q, rows_k = packed ? p.total_k : p.seqlen_k;
    auto gq = tma_gmem_tensor<Element>(p.q, p.q_stride, rows_q, p.headdim, p.nheads, batch);
    auto gk = tma_gmem_tensor<Element>(p.k, p.k_stride, rows_k, p.headdim, p.nheads_kv, batch);
    auto gv = tma_gmem_tensor<Element>(p.v, p.v_stride, rows_k, p.headdim, p.nheads_kv, batch);
    auto gvt = make_tensor(gv.data(), select<1, 0, 2, 3>(gv.layout()));  // V^T: (headdim, rows, heads, batch)
    Params kp;
    kp.p = p;
    kp.shape_q = gq.shape();
    kp.shape_k = gk.shape();
    kp.shape_vt = gvt.shape();
    kp.tma_q = make_tma_copy(SM90_TMA_LOAD{}, gq, typename Traits::SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{});
    kp.tma_k = make_tma_copy(SM90_TMA_LOAD{}, gk, take<0, 2>(typename Traits::SmemLayoutK{}),
                             Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{});
    kp.tma_v = make_tma_copy(SM90_TMA_LOAD{}, gvt, take<0, 2>(typename Traits::SmemLayoutVt{}),
                             Shape<Int<kHeadDim>, Int<kBlockN>>{}, _1{});
    return kp;
  }

  // ---- Device. Thread 0 initialises the barriers before the CTA's first __syncthreads.
  static CUTE_DEVICE void init(const Params& params, SharedStorage& smem) {
    cute::prefetch_tma_descriptor(params.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(params.tma_v.get_tma_descriptor());
    smem.ring_q.init(kNumMmaWarpGroups);
    smem.ring_k.init(kNumMmaWarpGroups);
    smem.ring_v.init(kNumMmaWarpGroups);
    cutlass::arch::fence_barrier_init();
  }

  // Producer: one elected lane of warp 0 issues every copy of the tile.
  CUTE_DEVICE void load(const Params& params, const FwdTile& tile, const SeqlenInfo& seqlen, SharedStorage& smem,
                        PipelineState& pipe) const {
    const Mask mask(params.p, seqlen, kBlockM, kBlockN);
    auto kv = mask.kv_cursor(tile.bidb, tile.bidh, tile.m_block);
    if (!kv.valid()) return;  // no key: the consumers touch no barrier either
    const int b = params.p.is_varlen() ? 0 : tile.bidb;
    const int bidh_kv = tile.bidh / params.p.h_per_kv();
    Tensor mQ = params.tma_q.get_tma_tensor(params.shape_q)(_, _, tile.bidh, b);
    Tensor mK = params.tma_k.get_tma_tensor(params.shape_k)(_, _, bidh_kv, b);
    Tensor mVt = params.tma_v.get_tma_tensor(params.shape_vt)(_, _, bidh_kv, b);
    Tensor gQ = local_tile(domain_offset(make_coord(seqlen.q_offset, _0{}), mQ), Shape<Int<kBlockM>, Int<kHeadDim>>{},
                           make_coord(tile.m_block, _0{}));
    Tensor gK = local_tile(domain_offset(make_coord(seqlen.k_offset, _0{}), mK), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                           make_coord(_, _0{}));  // (N, D, n_tiles)
    Tensor gVt = local_tile(domain_offset(make_coord(_0{}, seqlen.k_offset), mVt),
                            Shape<Int<kHeadDim>, Int<kBlockN>>{}, make_coord(_0{}, _));  // (D, N, n_tiles)
    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    auto cta_q = params.tma_q.get_slice(_0{});
    auto cta_k = params.tma_k.get_slice(_0{});
    auto cta_v = params.tma_v.get_slice(_0{});
    Tensor tQgQ = group_modes<0, 3>(cta_q.partition_S(gQ));
    Tensor tQsQ = group_modes<0, 3>(cta_q.partition_D(sQ));
    Tensor tKgK = group_modes<0, 3>(cta_k.partition_S(gK));   // (TMA, n_tiles)
    Tensor tKsK = group_modes<0, 3>(cta_k.partition_D(sK));   // (TMA, stages)
    Tensor tVgV = group_modes<0, 3>(cta_v.partition_S(gVt));  // (TMA, n_tiles)
    Tensor tVsV = group_modes<0, 3>(cta_v.partition_D(sVt));  // (TMA, stages)

    // Use i of the tile is use pipe.kv + i of the K and V rings.
    auto load_k = [&](int i, int n) {
      const int use = pipe.kv + i;
      copy(params.tma_k.with(smem.ring_k.acquire(use, Traits::kBytesKV)), tKgK(_, n), tKsK(_, smem.ring_k.stage(use)));
    };
    auto load_v = [&](int i, int n) {
      const int use = pipe.kv + i;
      copy(params.tma_v.with(smem.ring_v.acquire(use, Traits::kBytesKV)), tVgV(_, n), tVsV(_, smem.ring_v.stage(use)));
    };
    load_k(0, kv.tile());
    copy(params.tma_q.with(smem.ring_q.acquire(pipe.q, Traits::kBytesQ)), tQgQ, tQsQ);
    int i = 0, n_prev = kv.tile();
    for (kv.advance(); kv.valid(); kv.advance(), ++i) {
      load_k(i + 1, kv.tile());
      load_v(i, n_prev);
      n_prev = kv.tile();
    }
    load_v(i, n_prev);
    pipe.q += 1;
    pipe.kv += i + 1;
  }

  // Consumers, once per CTA before their first tile: the ping-pong's first turn goes to the
  // first warpgroup. (Each tile then issues as many GEMM batches from either warpgroup, so the
  // turn is back with the first one at the next tile.)
  static CUTE_DEVICE void start_consumers(int thread_idx) {
    if constexpr (kPingPong) {
      if (thread_idx < 128) cutlass::arch::NamedBarrier::arrive(2 * 128, uint32_t(FwdBarrier::kSchedulerWG0));
    }
  }

  // Consumers: Algorithm 1 over the same tiles; thread_idx counts the consumer threads from 0.
  // Returns false when the tile sees no key (O stays 0).
  template <typename Softmax>
  CUTE_DEVICE bool mma(const Params& params, const FwdTile& tile, const SeqlenInfo& seqlen, AccO& acc_o,
                       Softmax& softmax, SharedStorage& smem, int thread_idx, PipelineState& pipe) const {
    const FwdParams& p = params.p;
    const Mask mask(p, seqlen, kBlockM, kBlockN);
    auto kv = mask.kv_cursor(tile.bidb, tile.bidh, tile.m_block);
    if (!kv.valid()) return false;
    const int warp_group = thread_idx / 128;
    const bool signaling = thread_idx % 128 == 0;  // one release per warpgroup
    const int row0 = tile.m_block * kBlockM;

    Tensor sQ = make_tensor(make_smem_ptr(smem.q.data()), typename Traits::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(smem.k.data()), typename Traits::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(smem.v.data()), typename Traits::SmemLayoutVt{});
    TiledMmaQK mma_qk;
    TiledMmaPV mma_pv;
    auto thr_qk = mma_qk.get_thread_slice(thread_idx);
    auto thr_pv = mma_pv.get_thread_slice(thread_idx);
    // The shared-memory descriptors are a warpgroup's, the same for its threads. With three
    // consumer warpgroups (160 registers each) they are sliced by the warpgroup's first thread,
    // made warp-uniform, so that they live in uniform registers (as in FA3): the 192-row windowed
    // kernel's spills 120/196 -> 96/108 bytes, d64 causal 8k-16k calls 1-2% faster. With two
    // (240 registers, nothing spilled) the d128 non-causal forward measured 0-2% slower (H100,
    // two A/Bs; BENCHMARKS.md "sm90 forward, session 21").
    const int wg_thread0 = kNumMmaWarpGroups == 3
                               ? __shfl_sync(0xffffffff, thread_idx / 128, 0) * 128
                               : thread_idx;
    auto wg_qk = mma_qk.get_thread_slice(wg_thread0);
    auto wg_pv = mma_pv.get_thread_slice(wg_thread0);
    Tensor tSrQ = wg_qk.partition_fragment_A(sQ);   // smem descriptors
    Tensor tSrK = wg_qk.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, stages)
    Tensor tOrV = wg_pv.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, stages)
    Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
    Tensor cS = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
    Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
    Tensor acc_s = partition_fragment_C(mma_qk, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    static_assert(decltype(size<1>(s_rc))::value == kBlockN / 4,
                  "one wgmma spans the keys (MMA_N 1): the column pattern mask.apply_wgmma_rows reads");
    Tensor rP = make_tensor<Element>(acc_s.layout());  // P of the previous tile, the A operand of O += P V
    Tensor tOrP = make_tensor(rP.data(), acc_as_A(rP.layout()));

    // Ping-pong: a warpgroup issues its GEMMs between waiting on its barrier and signalling the
    // next one's (round the warpgroups); the first warpgroup gets the first turn.
    auto issue_begin = [&] {
      if constexpr (kPingPong) {
        cutlass::arch::NamedBarrier::sync(2 * 128, uint32_t(FwdBarrier::kSchedulerWG0) + warp_group);
      }
    };
    auto issue_end = [&] {
      if constexpr (kPingPong) {
        const int next = warp_group + 1 < kNumMmaWarpGroups ? warp_group + 1 : 0;
        cutlass::arch::NamedBarrier::arrive(2 * 128, uint32_t(FwdBarrier::kSchedulerWG0) + next);
      }
    };
    // S = mod(S) on every tile, masked where the policy says so.
    auto scores = [&](int n_block, auto is_masked) __attribute__((always_inline)) {
      if constexpr (kFeatures) {
        if (ScoreMod<>::active(p)) ScoreMod(p, seqlen, tile.bidb, tile.bidh).premask(s_rc, cS, row0, n_block * kBlockN);
      }
      if constexpr (decltype(is_masked)::value) mask.apply_wgmma_rows(s_rc, cS, row0, n_block * kBlockN);
    };

    // P in the input type for O += P V; dropout: P *= keep on the converted P, after l has counted
    // every score (O is scaled by 1 / (1 - p) at the end). (Drawing the random numbers before the
    // wait for the previous PV GEMM kept them live across it: spills in the causal variant.)
    // The map (its key schedule) is made where it is used: made once per tile, it stayed live
    // through the loop without dropout too (d64 192-row causal kernel: 156/232 bytes of spills
    // against 120/196).
    Tensor p_rc = make_tensor(rP.data(), acc_rowcol(rP.layout()));
    auto convert_p = [&](int n_block) __attribute__((always_inline)) {
      convert_fragment_into(acc_s, rP);
      if constexpr (kFeatures) {
        if (p.has_dropout()) {
          const DropoutMap dropout(p, tile.bidb, tile.bidh);
          dropout.apply(p_rc, dropout.draw_all(cS, row0, n_block * kBlockN));
        }
      }
    };
    smem.ring_q.wait_full(pipe.q);
    // Q is read by the S GEMMs only: its stage goes back once the last one is done (so a
    // persistent CTA's next Q loads under this tile's last steps: d128 512-1024 tokens 4-6.5%
    // faster on the H100 than a release after the last GEMM, docs/NOTES.md session 19). Where
    // the epilogue stages O in Q's space (not kPersistent), a CTA has one tile and its producer
    // loads no further Q.
    auto release_q_after_last_s = [&] {
      if (kv.next_tile() < 0) smem.ring_q.release(pipe.q, signaling);
    };

    // ---- The first tile: S_0 = Q K_0^T, masked; the softmax's first step.
    int i = pipe.kv;  // this tile's first use of the K and V rings
    smem.ring_k.wait_full(i);
    issue_begin();
    gemm</*kZeroInit=*/true, /*kWait=*/-1>(mma_qk, tSrQ, tSrK(_, _, _, smem.ring_k.stage(i)), acc_s);
    issue_end();
    warpgroup_wait<0>();
    smem.ring_k.release(i, signaling);
    release_q_after_last_s();
    scores(kv.tile(), cute::true_type{});
    float rescale[kRows];
    softmax.template update</*kFirst=*/true>(s_rc, p.softmax_scale_log2, rescale);
    convert_p(kv.tile());
    kv.advance();

    // ---- One step on key tile n_block (use i + 1 of the K ring; V ring use i is the previous tile's).
    auto step = [&](int n_block, auto is_masked) __attribute__((always_inline)) {
      smem.ring_k.wait_full(i + 1);
      issue_begin();
      gemm<true, -1>(mma_qk, tSrQ, tSrK(_, _, _, smem.ring_k.stage(i + 1)), acc_s);  // S_j = Q K_j^T
      smem.ring_v.wait_full(i);
      gemm<false, -1>(mma_pv, tOrP, tOrV(_, _, _, smem.ring_v.stage(i)), acc_o);   // O += P_{j-1} V_{j-1}
      issue_end();
      warpgroup_wait<1>();  // S_j is ready; the PV GEMM still runs
      smem.ring_k.release(i + 1, signaling);
      release_q_after_last_s();
      scores(n_block, is_masked);
      softmax.template update<false>(s_rc, p.softmax_scale_log2, rescale);
      warpgroup_wait<0>();  // O += P_{j-1} V_{j-1} is done: P's registers and V's stage are free
      smem.ring_v.release(i, signaling);
      softmax.rescale_o(o_rc, rescale);
      convert_p(n_block);
      ++i;
    };

    // ---- The other tiles, in runs of tiles with masked scores and runs without (the policy's
    // walk_in_runs, as in the sm80 family).
    mask.walk_in_runs(tile.m_block, kv, [&](auto is_masked) __attribute__((always_inline)) {
      step(kv.tile(), is_masked);
    });

    // ---- The last O += P V.
    smem.ring_v.wait_full(i);
    gemm<false, 0>(mma_pv, tOrP, tOrV(_, _, _, smem.ring_v.stage(i)), acc_o);
    smem.ring_v.release(i, signaling);
    pipe.q += 1;
    pipe.kv = i + 1;
    return true;
  }
};

}  // namespace flashcute::sm90
