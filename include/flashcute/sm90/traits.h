// flashcute — the sm90 family's compile-time shapes (Hopper: wgmma, TMA, warp specialisation):
// tiles, GMMA-swizzled shared-memory layouts, the tiled warpgroup MMAs and the TMA copy types,
// for one head dim and element type, and the configuration each head dim runs with.
#pragma once

#include <algorithm>

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/builders/sm90_common.inl>
#include <cutlass/numeric_types.h>

#include "flashcute/sm80/traits.h"

namespace flashcute::sm90 {

using namespace cute;

// One producer warpgroup (a single warp issues every TMA copy) and kBlockM / 64 consumer
// warpgroups, each owning 64 whole rows of S and O. K and V flow through kStages-deep rings.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, typename Element_>
struct FwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr int kNumMmaWarpGroups = kBlockM / 64;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * 128;
  static constexpr int kNThreads = kNumMmaThreads + 128;
  static_assert(kBlockM % 64 == 0 && kNumMmaWarpGroups <= 3);
  // setmaxnreg budgets. They must add up to no more than the registers the CTA was launched
  // with (launch bounds (kNThreads, 1): 168 per thread for 384 threads, 128 for 512), or the
  // consumers' increase waits forever: 24 * 128 + 240 * 256 = 168 * 384.
  static constexpr int kProducerRegs = kNumMmaWarpGroups == 2 ? 24 : 32;
  static constexpr int kConsumerRegs = kNumMmaWarpGroups == 2 ? 240 : 160;
  static_assert(kProducerRegs * 128 + kConsumerRegs * kNumMmaThreads <= 65536 / kNThreads / 8 * 8 * kNThreads);

  // S = Q K^T reads both operands from shared memory (SS); O += P V takes P from registers (RS)
  // and reads V in its natural (keys, headdim) layout as an MN-major operand: no transpose.
  using TileShapeQK = Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>;
  using TileShapePV = Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>;
  using AtomLayout = Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>;
  using TiledMmaQK = decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, TileShapeQK>(), AtomLayout{}));
  using TiledMmaPV = decltype(make_tiled_mma(
      GMMA::rs_op_selector<Element, Element, float, TileShapePV, GMMA::Major::K, GMMA::Major::MN>(), AtomLayout{}));
  // One wgmma per k-step spans each GEMM's N (176, 112 and 80 need the extended shapes,
  // CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED, which cmake/instantiations.cmake sets for d >= 128).
  static_assert(size<1>(typename TiledMmaQK::AtomShape_MNK{}) == kBlockN &&
                size<1>(typename TiledMmaPV::AtomShape_MNK{}) == kHeadDim);

  // Shared memory, in the GMMA swizzle atoms TMA writes and wgmma reads.
  using SmemLayoutAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                      Int<kBlockM>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                      Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemLayoutAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutAtomVt = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::MN, Element,
                                                                                       Int<kHeadDim>, Int<kBlockN>>());
  using SmemLayoutVt = decltype(tile_to_shape(SmemLayoutAtomVt{},
                                              Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{}));
  using SmemLayoutO = SmemLayoutQ;  // the epilogue's O: its own buffer or Q's space (kPersistent)
  using SmemCopyAtomO = Copy_Atom<SM90_U32x4_STSM_N, Element>;

  // Global tensors as TMA sees them: (rows, headdim, heads, batch), V transposed (headdim, rows, ...).
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQK = Stride<int64_t, _1, int64_t, int64_t>;
  using StrideVt = Stride<_1, int64_t, int64_t, int64_t>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                                   ShapeQKV{}, StrideQK{}),
                                      SmemLayoutQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                                   ShapeQKV{}, StrideQK{}),
                                      take<0, 2>(SmemLayoutK{}), Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  using TmaV = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                                   ShapeQKV{}, StrideVt{}),
                                      take<0, 2>(SmemLayoutVt{}), Shape<Int<kHeadDim>, Int<kBlockN>>{}, _1{}));
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);

  // Persistent CTAs (common/scheduler.h) where the epilogue's O fits in a buffer of its own beside
  // Q and the K/V rings (d <= 128: 192 KB at d128), so that the next tile's Q lands while O is
  // stored; above, O reuses Q's space and each CTA computes one tile.
  static constexpr bool kPersistent =
      (2 * cosize_v<SmemLayoutQ> + cosize_v<SmemLayoutK> + cosize_v<SmemLayoutVt>) * sizeof(Element) + 1024 <=
      227 * 1024;

  // Epilogue: each consumer warpgroup stores its 64 rows of O with 16-byte accesses.
  static constexpr int kGmemElemsPerAccess = 16 / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = (kHeadDim % 64 == 0 ? 64 : 32) / kGmemElemsPerAccess;
  using GmemTiledCopyO = decltype(make_tiled_copy(
      Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{},
      Layout<Shape<Int<128 / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>, Stride<Int<kGmemThreadsPerRow>, _1>>{},
      Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));
};

// Tiles per head dim: kBlockM query rows (64 per consumer warpgroup; the launcher picks 128 or,
// for d <= 64, 192), and as many keys per step as two stages of K and V leave room for in the
// 227 KB of shared memory.
template <int kHeadDim, typename Element, int kBlockM = 128, int kBlockN_ = 0>
struct FwdConfig {
  static constexpr int kBlockN = kBlockN_ > 0 ? kBlockN_ : kHeadDim <= 128 ? 128 : kHeadDim <= 192 ? 96 : 64;
  using Traits = FwdTraits<kHeadDim, kBlockM, kBlockN, 2, Element>;
};

// ---- Backward ------------------------------------------------------------------------------
// One producer warpgroup (warp 0 issues the TMA copies) and two consumer warpgroups. Per step
// (query tile i, kBlockM rows) each consumer warpgroup computes S and dP for its half of the
// kBlockN keys, and dK, dV of its half of the keys; the dQ GEMM splits the head dim between them.
// Q, dO (and their rows of L, D) flow through a kStages-deep ring; K and V stay resident.
// kSwapSdP (FlashAttention-3's SdP_swapAB): S^T = K Q^T and dP^T = V dO^T, so that each warpgroup
// holds P^T and dS^T of its keys in registers, the A operands of dV += P^T dO and dK += dS^T Q
// (register-sourced wgmma): P never goes to shared memory, dS only for dQ.
template <int kHeadDim_, int kBlockM_, int kBlockN_, int kStages_, typename Element_, bool kSwapSdP_ = false>
struct BwdTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kStages = kStages_;
  static constexpr bool kSwapSdP = kSwapSdP_;
  static constexpr int kNumMmaWarpGroups = 2;
  static constexpr int kNumMmaThreads = kNumMmaWarpGroups * 128;
  static constexpr int kNThreads = kNumMmaThreads + 128;
  static constexpr int kProducerRegs = 24;  // 24 * 128 + 240 * 256 <= 168 * 384, as in the forward
  static constexpr int kConsumerRegs = 240;
  static_assert(kBlockN == 64 * kNumMmaWarpGroups && kBlockM % 64 == 0);

  // S = Q K^T and dP = dO V^T: (kBlockM, kBlockN), the warpgroups side by side along the keys;
  // swapped: S^T, dP^T (kBlockN, kBlockM), the warpgroups one above the other.
  using TiledMmaSdP = std::conditional_t<
      kSwapSdP,
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kBlockM>, Int<kHeadDim>>>(),
                              Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{})),
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, _64, Int<kHeadDim>>>(),
                              Layout<Shape<_1, Int<kNumMmaWarpGroups>, _1>>{}))>;
  // dV += P^T dO and dK += dS^T Q: (kBlockN, kHeadDim), each warpgroup its own 64 keys. B (dO^T,
  // Q^T) is a transposed view of the ring's tile (MN-major); A (P^T, dS^T) is too, of the tiles
  // stored for dQ, or (swapped) the registers that hold them.
  using TiledMmadKV = std::conditional_t<
      kSwapSdP,
      decltype(make_tiled_mma(GMMA::rs_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>,
                                                   GMMA::Major::K, GMMA::Major::MN>(),
                              Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{})),
      decltype(make_tiled_mma(GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kHeadDim>, Int<kBlockM>>,
                                                   GMMA::Major::MN, GMMA::Major::MN>(),
                              Layout<Shape<Int<kNumMmaWarpGroups>, _1, _1>>{}))>;
  // dQ = dS K: (kBlockM, kHeadDim), the warpgroups side by side along the head dim; K^T is MN-major.
  using TiledMmadQ = decltype(make_tiled_mma(
      GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHeadDim / kNumMmaWarpGroups>, Int<kBlockN>>,
                           GMMA::Major::K, GMMA::Major::MN>(),
      Layout<Shape<_1, Int<kNumMmaWarpGroups>, _1>>{}));

  // Shared memory in GMMA swizzle atoms; the ^T layouts are views of the same bytes.
  using SmemLayoutAtomQ = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                      Int<kBlockM>, Int<kHeadDim>>());
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
  using SmemLayoutQt = decltype(composition(
      SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
  using SmemLayoutAtomK = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                      Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutK = decltype(tile_to_shape(SmemLayoutAtomK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutKt = decltype(composition(SmemLayoutK{},
                                            make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, Step<_2, _1>{})));
  using SmemLayoutAtomPdS = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                        Int<kBlockM>, Int<kBlockN>>());
  using SmemLayoutPdS = decltype(tile_to_shape(SmemLayoutAtomPdS{}, Shape<Int<kBlockM>, Int<kBlockN>>{}));
  using SmemLayoutPdSt = decltype(composition(SmemLayoutPdS{},
                                              make_ordered_layout(Shape<Int<kBlockN>, Int<kBlockM>>{}, Step<_2, _1>{})));
  // Registers -> shared (stmatrix): P and dS (swapped: dS^T, stored transposed into dS's tile),
  // and the epilogue's dK, dV.
  using SmemCopyAtomPdS = Copy_Atom<std::conditional_t<kSwapSdP, SM90_U16x8_STSM_T, SM90_U32x4_STSM_N>, Element>;
  using SmemCopyAtomdKV = Copy_Atom<SM90_U32x4_STSM_N, Element>;

  // TMA: Q and dO as (rows, headdim, heads, batch) into one stage; K and V once.
  using ShapeQKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideQK = Stride<int64_t, _1, int64_t, int64_t>;
  using TmaQ = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                                   ShapeQKV{}, StrideQK{}),
                                      take<0, 2>(SmemLayoutQ{}), Shape<Int<kBlockM>, Int<kHeadDim>>{}, _1{}));
  using TmaK = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                                   ShapeQKV{}, StrideQK{}),
                                      SmemLayoutK{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
  static constexpr uint32_t kBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kBytesK = kBlockN * kHeadDim * sizeof(Element);

  // dK, dV out: each warpgroup its 64 rows with 16-byte stores (as the forward's O).
  static constexpr int kGmemElemsPerAccess = 16 / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = (kHeadDim % 64 == 0 ? 64 : 32) / kGmemElemsPerAccess;
  using GmemTiledCopydKV = decltype(make_tiled_copy(
      Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{},
      Layout<Shape<Int<128 / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>, Stride<Int<kGmemThreadsPerRow>, _1>>{},
      Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));

  // What the shared dQ conversion (common/bwd_pre_post.h) reads the accumulator with: the tile
  // staged in shared memory in 16-byte vectors, then one bulk reduction.
  static constexpr int kNThreadsDq = kNumMmaThreads;
  static constexpr int kDqAccumVector = 4;
  using SmemLayoutdQ = decltype(tile_to_shape(SmemLayoutAtomQ{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemCopyAtomdQ = SmemCopyAtomdKV;
  using GmemTiledCopydQ = decltype(make_tiled_copy(
      Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{},
      Layout<Shape<Int<kNThreadsDq / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>, Stride<Int<kGmemThreadsPerRow>, _1>>{},
      Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));
};

// Backward tiles per head dim (head dims up to 128; larger ones run the sm80 backward): 64 query
// rows per step, 128 keys per CTA (FlashAttention-3's d128 tile). Kernels of d <= 64 take 128
// rows (FA3's d64 tile: half the steps, barriers and dQ reductions) at 48-232 B of spills
// (docs/PTXAS.md). H100: backward 8.5-14.6% and fwd+bwd 6.9-9.8% faster than 64 rows at d64
// (docs/NOTES.md, session 9). Dropout's kernels too since its marks are made one draw at a time
// (DropoutMap::mark_dropped; they kept 64 rows before, spilling 456-496 B at 128): their backward
// 6-15% faster at d64 (session 28). -DFLASHCUTE_SM90_BWD_D64_BLOCK_M=64 builds the 64-row tile.
#ifndef FLASHCUTE_SM90_BWD_D64_BLOCK_M
#define FLASHCUTE_SM90_BWD_D64_BLOCK_M 128
#endif
// The dense kernels without dropout's code (kDense: no causal, window or block-sparse mask)
// compute S^T and dP^T (kSwapSdP; dropout's draw layout needs S's rows in the accumulator's rows).
// Measured on the H100 (bf16, 16k tokens, 3 alternating rounds against the unswapped kernels;
// docs/NOTES.md, session 24): non-causal backward d64 -1.7..-4.2% at 1024-16384 tokens, d128 16k
// -1.3% (1024-8192 within +-1.2%). The masked kernels keep S's rows: swapped as well, the
// causal backward measured d64 +0.2..+1.1%, d128 -0.8..+0.6% (H200, 2 alternating rounds,
// 512-16384 tokens; session 30), with the d64 kernel's spills 68/76 -> 156/168 bytes.
// -DFLASHCUTE_SM90_BWD_SWAP_SDP=0 turns it off.
#ifndef FLASHCUTE_SM90_BWD_SWAP_SDP
#define FLASHCUTE_SM90_BWD_SWAP_SDP 1
#endif
template <int kHeadDim, typename Element, bool kDropout, bool kDense = false>
struct BwdConfig {
  static_assert(kHeadDim <= 128, "the sm90 backward serves head dims up to 128");
  static constexpr int kBlockM = kHeadDim <= 64 ? FLASHCUTE_SM90_BWD_D64_BLOCK_M : 64;
  using Traits = BwdTraits<kHeadDim, kBlockM, 128, 2, Element, kDense && !kDropout && FLASHCUTE_SM90_BWD_SWAP_SDP>;
};

// ---- Decoding over a KV cache (flash-decoding) ------------------------------------------------
// The KV-cache calls of up to 16 GQA-packed query rows (sm90/decode_launch.h say which): the sm80
// family's decoding tile for the math (16 rows, one warp per 32 keys of a key tile, each with its
// own softmax and O; mma.sync: a 64-row wgmma tile would do 4-16x the work for these rows) in
// kConsumerWarps warps, and a producer warp feeding K and V tiles by TMA through kStages-deep
// rings (sm90/mainloop_decode.h), so that as few as 64 CTAs stream the cache at the full rate
// (scripts/decode_roofline.cu: 4.08 TB/s from 64 CTAs, BENCHMARKS.md session 47).
template <int kHeadDim_, typename Element_>
struct DecodeTraits {
  using Element = Element_;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = 16;
  static constexpr int kBlockN = kHeadDim <= 128 ? 128 : 64;
  static constexpr int kConsumerWarps = kBlockN / 32;
  // The consumers' MMAs, shared-memory copy atoms and Q's layout: the sm80 decoding tile's.
  using Mma = sm80::KernelTraits<kHeadDim, kBlockM, kBlockN, kConsumerWarps, Element, kConsumerWarps>;

  // K and V tiles in the GMMA swizzle atoms TMA writes (for 16-bit types the same bytes as the
  // sm80 tile's XOR swizzle, which ldmatrix reads); V^T a view.
  using SmemLayoutAtomKV = decltype(cutlass::gemm::collective::detail::ss_smem_selector<GMMA::Major::K, Element,
                                                                                       Int<kBlockN>, Int<kHeadDim>>());
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  using SmemLayoutVt = decltype(composition(SmemLayoutKV{},
                                            make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  static constexpr uint32_t kBytesKV = kBlockN * kHeadDim * sizeof(Element);
  // Ring depth: as many K and V stages as about 200 KB hold, at most 4 (d128: 3 of 64 KB).
  static constexpr int kStages = std::min<int>(4, 200 * 1024 / (2 * kBytesKV));

  // The cache as TMA sees it: (rows of a page, headdim, kv heads, pages), a contiguous cache one
  // page per sequence; a tile one box.
  using ShapeKV = Shape<int32_t, int32_t, int32_t, int32_t>;
  using StrideKV = Stride<int64_t, _1, int64_t, int64_t>;
  using TmaKV = decltype(make_tma_copy(SM90_TMA_LOAD{}, make_tensor(make_gmem_ptr(static_cast<Element const*>(nullptr)),
                                                                    ShapeKV{}, StrideKV{}),
                                       SmemLayoutKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}, _1{}));
};

}  // namespace flashcute::sm90
