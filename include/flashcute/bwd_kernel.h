// flashcute — the backward kernels: FlashAttention-2, Algorithm 2, in three stages.
//
//   1. flashcute_bwd_preprocess_kernel: D = rowsum(dO * O) - dLSE and L * log2(e) in fp32, padded
//      to whole query blocks; the dQ accumulator cleared.
//   2. flashcute_bwd_kernel: one CTA per key/value block j (and batch, kv head), parallel over
//      seqlen_k. K_j and V_j stay in shared memory, dK_j and dV_j in registers, while the CTA
//      walks the query blocks i that see block j (for every query head of the kv head's group):
//          S = Q_i K_j^T;  P = exp(S - L_i)         (recomputed from the saved LSE; masked)
//          dP = dO_i V_j^T;  dS = P * (dP - D_i)
//          dV_j += P^T dO_i;  dQ_i += dS K_j  (fp32 atomics; per-split in deterministic mode);
//          dK_j += dS^T Q_i
//   3. flashcute_bwd_convert_dq_kernel: dQ = scale * sum of the accumulator splits, in the input type.
#pragma once

#include <cute/tensor.hpp>

#include "kernel_traits.h"
#include "mask.h"
#include "params.h"
#include "utils.h"

namespace flashcute {

using namespace cute;

// kBlockM query rows x kBlockN keys per step; the three GEMM shapes get their own warp layouts:
// S, dP (M x N) with kAtomM_SdP warps along M; dK, dV (N x D) with kAtomN_dKV along N; dQ (M x D)
// with kAtomM_dQ along M.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, int kAtomM_SdP, int kAtomN_dKV, int kAtomM_dQ,
          typename Element_>
struct BwdKernelTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;

  using Fwd = KernelTraits<kHeadDim, kBlockM, kBlockN, 4, Element>;  // shared layouts and copy atoms
  using MmaAtom = typename Fwd::MmaAtom;
  template <int kAtomM>
  using TiledMmaOf = TiledMMA<MmaAtom, Layout<Shape<Int<kAtomM>, Int<kNWarps / kAtomM>, _1>>,
                              Tile<Int<16 * kAtomM>, Int<16 * kNWarps / kAtomM>, _16>>;
  using TiledMmaSdP = TiledMmaOf<kAtomM_SdP>;
  using TiledMmadKV = TiledMmaOf<kAtomN_dKV>;
  using TiledMmadQ = TiledMmaOf<kAtomM_dQ>;

  // Q, dO: (kBlockM, D); K, V: (kBlockN, D); transposed views for the dK, dV and dQ GEMMs.
  using SmemLayoutQ = typename Fwd::SmemLayoutQ;
  using SmemLayoutKV = typename Fwd::SmemLayoutKV;
  using SmemLayoutQt = decltype(composition(SmemLayoutQ{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockM>>{},
                                                                        GenRowMajor{})));
  using SmemLayoutQtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutQt{}));
  using SmemLayoutKt = decltype(composition(SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{},
                                                                         GenRowMajor{})));
  using SmemLayoutKtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutKt{}));
  // P and dS: (kBlockM, kBlockN), written from registers, read as is (dQ) and transposed (dK, dV).
  static constexpr int kPBlockN = kBlockN >= 64 ? 64 : 32;
  using SmemLayoutAtomPdS = decltype(composition(
      Swizzle<kPBlockN == 64 ? 3 : 2, 3, 3>{}, Layout<Shape<_8, Int<kPBlockN>>, Stride<Int<kPBlockN>, _1>>{}));
  using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(composition(SmemLayoutPdS{}, make_layout(Shape<Int<kBlockN>, Int<kBlockM>>{},
                                                                            GenRowMajor{})));
  using SmemLayoutPdStNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutPdSt{}));

  using SmemCopyAtom = typename Fwd::SmemCopyAtom;
  using SmemCopyAtomT = typename Fwd::SmemCopyAtomT;
  using SmemCopyAtomPdS = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<32>, Element>;
  using SmemCopyAtomO = typename Fwd::SmemCopyAtomO;

  static constexpr int kGmemThreadsPerRow = Fwd::kGmemThreadsPerRow;
  using GmemLayoutAtom = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopy = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<Fwd::kGmemElemsPerAccess>>>{}));
  using GmemTiledCopyStore = decltype(make_tiled_copy(
      Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<Fwd::kGmemElemsPerAccess>>>{}));

  static constexpr int kSmemQSize = kBlockM * kHeadDim * sizeof(Element);
  static constexpr int kSmemKSize = kBlockN * kHeadDim * sizeof(Element);
  static constexpr int kSmemPSize = kBlockM * kBlockN * sizeof(Element);
  static_assert(kBlockM * kHeadDim % (kNThreads * 4) == 0, "dQ fragments go out in 16-byte atomics");
  static constexpr int kSmemRowsSize = 2 * kBlockM * sizeof(float);  // L and D of the block's rows
  // Q, dO (and their L, D) double-buffered (the next block loads during the whole step) when
  // that fits in the 163 KB an sm80 CTA can have; single-buffered otherwise (d = 256).
  static constexpr int kStagesQdO =
      2 * (2 * kSmemQSize + kSmemRowsSize) + 2 * kSmemKSize + 2 * kSmemPSize <= 163 * 1024 ? 2 : 1;
  static constexpr int kSmemSize =
      kStagesQdO * (2 * kSmemQSize + kSmemRowsSize) + 2 * kSmemKSize + 2 * kSmemPSize;  // Q dO K V P dS L D
};

// The fp32 dQ accumulator: (splits, batch, nheads, seqlen_q rounded to 128, kernel head dim).
// Each (kBlockM, headdim) tile of it is stored in the main kernel's thread order, not row-major:
// the fragment values i .. i+3 of thread t (in the dQ GEMM's accumulator layout) lie at
// (i / 4) * kNThreads * 4 + t * 4, so one 16-byte atomic per thread covers 512 contiguous bytes
// per warp. The convert kernel reads it back with the same thread layout.
// D and L (params.dsum, params.lse_log2) are (batch, nheads, seqlen_rounded).
struct DqAccumShape {
  int seqlen_rounded;
  int headdim;
  int batch;
  int nheads;
  // Offset of the (seqlen_rounded, headdim) slab of one split, batch and head.
  CUTE_HOST_DEVICE int64_t offset(int split, int b, int h) const {
    return ((int64_t(split) * batch + b) * nheads + h) * int64_t(seqlen_rounded) * headdim;
  }
  // Offset of the D and L rows of one batch and head.
  CUTE_HOST_DEVICE int64_t rows_offset(int b, int h) const { return (int64_t(b) * nheads + h) * seqlen_rounded; }
};

// ---- Stage 1: per row, D = rowsum(dO * O) - dLSE and L * log2(e); the dQ accumulator cleared.
// Each thread takes 8 columns (16-byte loads), kHeadDim / 8 threads (a power of two) per row.
// Rows run to seqlen_rounded, so the main loop reads whole blocks without checks: rows past
// seqlen_q, and rows that saw no key in the forward (L = -inf), get L = +inf (P = 0) and D = 0.
template <int kHeadDim>
struct PreprocessShape {
  static constexpr int kThreads = 256;
  static constexpr int kThreadsPerRow = kHeadDim <= 32 ? 4 : kHeadDim <= 64 ? 8 : kHeadDim <= 128 ? 16 : 32;
  static constexpr int kRowsPerCta = kThreads / kThreadsPerRow;  // divides 128, so seqlen_rounded
};

template <typename Element, int kHeadDim>
__global__ void __launch_bounds__(PreprocessShape<kHeadDim>::kThreads)
    flashcute_bwd_preprocess_kernel(const BwdParams params, DqAccumShape acc, int num_splits) {
  constexpr float kLog2e = 1.4426950408889634f;
  constexpr int kThreadsPerRow = PreprocessShape<kHeadDim>::kThreadsPerRow;
  constexpr int kRowsPerCta = PreprocessShape<kHeadDim>::kRowsPerCta;
  const int row_blocks = acc.seqlen_rounded / kRowsPerCta;  // 1-D grid: (row block, batch, head)
  const int row = (blockIdx.x % row_blocks) * kRowsPerCta + threadIdx.x / kThreadsPerRow;
  const int c = (threadIdx.x % kThreadsPerRow) * 8;
  const int b = (blockIdx.x / row_blocks) % params.batch, h = blockIdx.x / row_blocks / params.batch;

  if (c < kHeadDim) {  // clear this row's columns c .. c+7 in every split
    for (int split = 0; split < num_splits; ++split) {
      float4* dst = reinterpret_cast<float4*>(params.dq_accum + acc.offset(split, b, h) + int64_t(row) * kHeadDim + c);
      dst[0] = dst[1] = float4{0, 0, 0, 0};
    }
  }
  float sum = 0.f;
  if (row < params.seqlen_q && c < params.headdim) {  // headdim % 8 == 0
    const Element* o = static_cast<const Element*>(params.o) + b * params.o_stride.batch +
                       row * params.o_stride.row + h * params.o_stride.head + c;
    const Element* g = static_cast<const Element*>(params.dout) + b * params.do_stride.batch +
                       row * params.do_stride.row + h * params.do_stride.head + c;
    const cutlass::Array<Element, 8> ov = *reinterpret_cast<const cutlass::Array<Element, 8>*>(o);
    const cutlass::Array<Element, 8> gv = *reinterpret_cast<const cutlass::Array<Element, 8>*>(g);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) sum += float(ov[e]) * float(gv[e]);
  }
  CUTE_UNROLL
  for (int off = kThreadsPerRow / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (c == 0) {
    float d = 0.f, l_log2 = INFINITY;
    if (row < params.seqlen_q) {
      const int64_t idx = (int64_t(b) * params.nheads + h) * params.seqlen_q + row;
      const float l = params.lse[idx];
      d = sum - (params.dlse ? params.dlse[idx] : 0.f);
      if (l != -INFINITY) l_log2 = l * kLog2e;
    }
    params.dsum[acc.rows_offset(b, h) + row] = d;
    params.lse_log2[acc.rows_offset(b, h) + row] = l_log2;
  }
}

// ---- Stage 2: the main loop, parallel over key blocks.
template <typename Traits, typename MaskPolicy>
__global__ void __launch_bounds__(Traits::kNThreads, 1)
    flashcute_bwd_kernel(const BwdParams params, DqAccumShape dq_acc) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  extern __shared__ __align__(128) char smem[];
  const int tidx = threadIdx.x;
  // A 1-D grid over (key block or split, batch, kv head), the first fastest.
  const int num_x = gridDim.x / (params.batch * params.nheads_kv);
  const int x_idx = blockIdx.x % num_x;
  const int bidb = (blockIdx.x / num_x) % params.batch;
  const int bidh_kv = blockIdx.x / num_x / params.batch;
  const int h_per_kv = params.nheads / params.nheads_kv;
  const int split = params.deterministic ? x_idx : 0;
  const MaskPolicy mask(params, kBlockM, kBlockN);
  const int num_n_blocks = ceil_div(params.seqlen_k, kBlockN);

  auto gmem = [&](const void* base, Strides s, int head, int seqlen) {
    return head_tensor<Element, kHeadDim>(base, s, bidb, head, seqlen);
  };

  // ---- Shared memory.
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  constexpr int kStages = Traits::kStagesQdO;
  Tensor sdO = make_tensor(sQ.data() + kStages * size(sQ), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sdO.data() + kStages * size(sdO), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sP = make_tensor(sV.data() + size(sV), typename Traits::SmemLayoutPdS{});
  Tensor sdS = make_tensor(sP.data() + size(sP), typename Traits::SmemLayoutPdS{});
  float* sLse = reinterpret_cast<float*>(raw_pointer_cast(sdS.data() + size(sdS)));  // (kStages, kBlockM)
  float* sDsum = sLse + kStages * kBlockM;                                               // (kStages, kBlockM)
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
  Tensor col_ok = make_tensor<bool>(make_shape(size<2>(tQsQ)));
  CUTE_UNROLL
  for (int k = 0; k < size(col_ok); ++k) col_ok(k) = get<1>(tQcQ(0, 0, k)) < params.headdim;

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

  // Deterministic mode: CTA `split` takes key blocks split, split + num_x, ... and owns
  // split `split` of the dQ accumulator (so its adds come in a fixed order). Otherwise one key
  // block per CTA, all adding into split 0.
  for (int n_block = x_idx; n_block < num_n_blocks; n_block += num_x) {
    const int rows_k = params.seqlen_k - n_block * kBlockN;

    Tensor acc_dk = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    Tensor acc_dv = partition_fragment_C(mma_dkv, Shape<Int<kBlockN>, Int<kHeadDim>>{});
    clear(acc_dk);
    clear(acc_dv);

    // K_j and V_j: loaded once, kept in shared memory for the whole loop.
    __syncthreads();  // the previous key block's last reads of sK/sV are done
    Tensor gK = local_tile(gmem(params.k, params.k_stride, bidh_kv, params.seqlen_k),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
    Tensor gV = local_tile(gmem(params.v, params.v_stride, bidh_kv, params.seqlen_k),
                           Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(n_block, 0));
    copy_tile<true>(gmem_copy, gmem_thr.partition_S(gK), tKsK, tKcK, col_ok, rows_k);
    copy_tile<true>(gmem_copy, gmem_thr.partition_S(gV), tVsV, tKcK, col_ok, rows_k);

    // The steps: every (query head of this kv head, query block that sees key block j), as the
    // policy's cursor walks them.
    auto cur = mask.q_cursor(bidb, bidh_kv * h_per_kv, h_per_kv, n_block);

    auto load_q_do = [&](int step, int head, int m_block) __attribute__((always_inline)) {
      const int rows_q = params.seqlen_q - m_block * kBlockM;
      Tensor gQ = local_tile(gmem(params.q, params.q_stride, head, params.seqlen_q),
                             Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
      Tensor gdO = local_tile(gmem(params.dout, params.do_stride, head, params.seqlen_q),
                              Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
      copy_tile<true>(gmem_copy, gmem_thr.partition_S(gQ), in_stage(tQsQ, step), tQcQ, col_ok, rows_q);
      copy_tile<true>(gmem_copy, gmem_thr.partition_S(gdO), in_stage(tdOsdO, step), tQcQ, col_ok, rows_q);
      // L and D of the block's rows, 16 bytes per thread (padded to whole blocks by stage 1).
      constexpr int kRowChunks = kBlockM / 4;
      if (tidx < 2 * kRowChunks) {
        const int chunk = tidx % kRowChunks, stage = kStages > 1 ? step % 2 : 0;
        const bool is_d = tidx >= kRowChunks;
        const float* src = (is_d ? params.dsum : params.lse_log2) + dq_acc.rows_offset(bidb, head) +
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
      if constexpr (decltype(is_masked)::value) mask.apply(s_rc, cS, m_block * kBlockM, n_block * kBlockN);
      CUTE_UNROLL
      for (int i = 0; i < kRowsS; ++i) {
        CUTE_UNROLL
        for (int j = 0; j < size<1>(s_rc); ++j) s_rc(i, j) = exp2f(s_rc(i, j) * params.scale_log2 - lse_log2[i]);
      }
      Tensor rP = convert_fragment<Element>(acc_s);
      copy(copy_pds, thr_pds.retile_S(rP), tPsP);

      Tensor acc_dp = partition_fragment_C(mma_sdp, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_dp);
      gemm_ss(mma_sdp, acc_dp, tdPrdO, tdPrV, in_stage(tdPsdO, step), tdPsV, copy_sdp_a, copy_sdp_b, thr_sdp_a,
              thr_sdp_b);
      // dS = P * (dP - D), to shared memory (for dK and dQ).
      Tensor dp_rc = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
      CUTE_UNROLL
      for (int i = 0; i < kRowsS; ++i) {
        CUTE_UNROLL
        for (int j = 0; j < size<1>(dp_rc); ++j) dp_rc(i, j) = s_rc(i, j) * (dp_rc(i, j) - dsum[i]);
      }
      Tensor rdS = convert_fragment<Element>(acc_dp);
      copy(copy_pds, thr_pds.retile_S(rdS), tdSsdS);
      __syncthreads();

      // dQ_i += dS K_j, added to the fp32 accumulator (scaled by `scale` in stage 3).
      auto accumulate_dq = [&]() __attribute__((always_inline)) {
        Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
        clear(acc_dq);
        gemm_ss(mma_dq, acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, copy_dq_a, copy_dq_b, thr_dq_a, thr_dq_b);
        // The tile is stored in thread order (see DqAccumShape): 16-byte atomics, each warp's
        // covering 512 contiguous bytes. Atomic adds in both modes: in deterministic mode only
        // this CTA adds to its split, and one thread's reductions to one address apply in
        // program order, so the sums are reproducible.
        float* dq_tile = params.dq_accum + dq_acc.offset(split, bidb, head) + int64_t(m_block) * kBlockM * kHeadDim;
        CUTE_UNROLL
        for (int i = 0; i < size(acc_dq); i += 4) {
          atomic_add4(dq_tile + (i / 4) * Traits::kNThreads * 4 + tidx * 4, acc_dq(i), acc_dq(i + 1), acc_dq(i + 2),
                      acc_dq(i + 3));
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

    // ---- Epilogue: dK_j *= scale; dK_j, dV_j to global (through shared memory, 16-byte stores).
    CUTE_UNROLL
    for (int e = 0; e < size(acc_dk); ++e) acc_dk(e) *= params.scale;
    Tensor rdK = convert_fragment<Element>(acc_dk);
    Tensor rdV = convert_fragment<Element>(acc_dv);
    __syncthreads();  // every warp is done with sK, sV (dQ GEMM)
    auto copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, mma_dkv);
    auto thr_o = copy_o.get_thread_slice(tidx);
    copy(copy_o, thr_o.retile_S(rdK), thr_o.partition_D(sK));
    copy(copy_o, thr_o.retile_S(rdV), thr_o.partition_D(sV));
    __syncthreads();
    auto store = [&](auto const& s_tile, void* base, Strides s) __attribute__((always_inline)) {
      Tensor g = local_tile(gmem(base, s, bidh_kv, params.seqlen_k), Shape<Int<kBlockN>, Int<kHeadDim>>{},
                            make_coord(n_block, 0));
      store_smem_tile(typename Traits::GmemTiledCopyStore{}, tidx, s_tile, g, tKcK, col_ok, rows_k);
    };
    store(sK, params.dk, params.dk_stride);
    store(sV, params.dv, params.dv_stride);
  }
}

// ---- Stage 3: dQ = scale * (sum of the accumulator's splits), in the input type. One CTA per
// (query block, batch, head) with the main kernel's dQ thread layout: each thread reads back the
// fragment values its counterparts added (DqAccumShape), then the tile goes out through shared
// memory as 16-byte rows.
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreads) flashcute_bwd_convert_dq_kernel(const BwdParams params,
                                                                                    DqAccumShape acc,
                                                                                    int num_splits) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNThreads = Traits::kNThreads;
  __shared__ __align__(128) Element smem[kBlockM * kHeadDim];
  const int tidx = threadIdx.x;
  const int num_m_blocks = ceil_div(params.seqlen_q, kBlockM);  // 1-D grid: (query block, batch, head)
  const int m_block = blockIdx.x % num_m_blocks;
  const int b = (blockIdx.x / num_m_blocks) % params.batch, h = blockIdx.x / num_m_blocks / params.batch;

  typename Traits::TiledMmadQ mma_dq;
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_dq);
  for (int split = 0; split < num_splits; ++split) {
    const float* src = params.dq_accum + acc.offset(split, b, h) + int64_t(m_block) * kBlockM * kHeadDim + tidx * 4;
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += 4) {
      const float4 v = *reinterpret_cast<const float4*>(src + (i / 4) * kNThreads * 4);
      acc_dq(i) += v.x;
      acc_dq(i + 1) += v.y;
      acc_dq(i + 2) += v.z;
      acc_dq(i + 3) += v.w;
    }
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) *= params.scale;
  Tensor rdQ = convert_fragment<Element>(acc_dq);

  Tensor sdQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutQ{});
  auto copy_s = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, mma_dq);
  auto thr_s = copy_s.get_thread_slice(tidx);
  copy(copy_s, thr_s.retile_S(rdQ), thr_s.partition_D(sdQ));
  __syncthreads();

  typename Traits::GmemTiledCopyStore gmem_store;
  Tensor tC = gmem_store.get_thread_slice(tidx).partition_D(
      make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor col_ok = make_tensor<bool>(make_shape(size<2>(tC)));
  CUTE_UNROLL
  for (int k = 0; k < size(col_ok); ++k) col_ok(k) = get<1>(tC(0, 0, k)) < params.headdim;
  Tensor gdQ = local_tile(head_tensor<Element, kHeadDim>(params.dq, params.dq_stride, b, h, params.seqlen_q),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  store_smem_tile(gmem_store, tidx, sdQ, gdQ, tC, col_ok, params.seqlen_q - m_block * kBlockM);
}

}  // namespace flashcute
