// flashcute — the sm80 family's compile-time shapes: tiles, warps, shared-memory layouts, copy
// atoms and tiled MMAs of the forward and the backward, for one head dim and element type, and
// the configuration each head dim runs with.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace flashcute::sm80 {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename Element_, int kWarpsN_ = 1>
struct KernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per CTA
  static constexpr int kBlockN = kBlockN_;  // key rows per main-loop step
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  // Warps side by side along the keys (decoding's tile, > 1): each owns a 32-key run of every
  // key tile, with its own online softmax and O over its keys, merged in the epilogue.
  static constexpr int kWarpsN = kWarpsN_;
  static constexpr int kWarpsM = kNWarps / kWarpsN;
  static_assert(kHeadDim % 32 == 0, "instantiated head dims are multiples of 32");
  static_assert(kBlockM % (16 * kWarpsM) == 0, "each warp owns whole 16-row slabs of S");
  static_assert(kWarpsN == 1 || (kWarpsM == 1 && kBlockN == 32 * kWarpsN), "side by side: a 32-key run per warp");
  // A thread's index in the O GEMM (side by side: in its warp's own), of tidx's type.
  template <typename Index>
  static CUTE_DEVICE Index o_thread(Index tidx) { return kWarpsN == 1 ? tidx : tidx % 32; }

  // Tensor-core MMA m16n8k16 with fp32 accumulators; warps stacked along M, so a warp
  // owns whole rows of S and the softmax never crosses warps (side by side: whole rows of its
  // keys' S, and of its own O).
  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  using TiledMmaO = TiledMMA<MmaAtom, Layout<Shape<Int<kWarpsM>, _1, _1>>, Tile<Int<16 * kWarpsM>, _16, _16>>;
  using TiledMma = std::conditional_t<
      kWarpsN == 1, TiledMmaO,
      TiledMMA<MmaAtom, Layout<Shape<_1, Int<kWarpsN>, _1>>,
               Tile<_16, Layout<Shape<_8, Int<kWarpsN>, _4>, Stride<_1, _32, _8>>, _16>>>;

  // Shared memory: 8-row x 64- (or 32-) column atoms, XOR-swizzled so that the 8 rows an
  // ldmatrix reads fall in different banks.
  static constexpr int kBlockKSmem = kHeadDim % 64 == 0 ? 64 : 32;
  static constexpr int kSwizzle = kBlockKSmem == 32 ? 2 : 3;
  using SmemLayoutAtom = decltype(composition(
      Swizzle<kSwizzle, 3, 3>{}, Layout<Shape<_8, Int<kBlockKSmem>>, Stride<Int<kBlockKSmem>, _1>>{}));
  using SmemLayoutQ = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  using SmemLayoutKV = decltype(tile_to_shape(SmemLayoutAtom{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  // V^T: a transposed view of sV (no copy), read with the transposing ldmatrix.
  using SmemLayoutVt = decltype(composition(
      SmemLayoutKV{}, make_layout(Shape<Int<kHeadDim>, Int<kBlockN>>{}, GenRowMajor{})));
  using SmemLayoutVtNoSwizzle = decltype(get_nonswizzle_portion(SmemLayoutVt{}));
  using SmemLayoutO = SmemLayoutQ;

  // Shared -> registers.
  using SmemCopyAtom = Copy_Atom<SM75_U32x4_LDSM_N, Element>;
  using SmemCopyAtomT = Copy_Atom<SM75_U16x8_LDSM_T, Element>;
  using SmemCopyAtomO = Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>;

  // Global <-> shared: 16-byte accesses, a row of kBlockKSmem columns per kGmemThreadsPerRow threads;
  // loads by zero-filling cp.async (see copy_tile).
  static constexpr int kGmemElemsPerAccess = 16 / sizeof(Element);
  static constexpr int kGmemThreadsPerRow = kBlockKSmem / kGmemElemsPerAccess;
  using GmemLayoutAtom = Layout<Shape<Int<kNThreads / kGmemThreadsPerRow>, Int<kGmemThreadsPerRow>>,
                                Stride<Int<kGmemThreadsPerRow>, _1>>;
  using GmemTiledCopyQKV = decltype(make_tiled_copy(
      Copy_Atom<SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));
  using GmemTiledCopyO = decltype(make_tiled_copy(
      Copy_Atom<AutoVectorizingCopyWithAssumedAlignment<128>, Element>{}, GmemLayoutAtom{},
      Layout<Shape<_1, Int<kGmemElemsPerAccess>>>{}));
};


// Forward tiles and warps per head dim, chosen by measurement on an H200 (docs/NOTES.md,
// scripts/tile_sweep.sh): 128 query rows per CTA and 64 keys per step (128 for d = 32, FA2's
// choice, not re-measured), with 8 warps for the widest heads, whose O accumulator would not
// fit in 4 warps' registers.
template <int kHeadDim, typename Element>
struct FwdConfig {
  static constexpr int kBlockN = kHeadDim <= 32 ? 128 : 64;
  static constexpr int kNWarps = kHeadDim <= 128 ? 4 : 8;
  using Traits = KernelTraits<kHeadDim, 128, kBlockN, kNWarps, Element>;
};

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
  // S and dP: each warp's columns one run of 32 (four 8-column atoms, then the next warp's),
  // so that a thread holds whole 16 x 32 blocks of dropout's random bytes (common/dropout.h).
  static constexpr int kWarpsN_SdP = kNWarps / kAtomM_SdP;
  static_assert(kBlockN % (32 * kWarpsN_SdP) == 0, "S/dP: whole 32-column runs per warp");
  using TiledMmaSdP = TiledMMA<MmaAtom, Layout<Shape<Int<kAtomM_SdP>, Int<kWarpsN_SdP>, _1>>,
                               Tile<Int<16 * kAtomM_SdP>,
                                    Layout<Shape<_8, Int<kWarpsN_SdP>, _4>, Stride<_1, _32, _8>>, _16>>;
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
  // What the shared dQ conversion (common/bwd_pre_post.h) reads the accumulator with. The dQ
  // reductions go out in thread order: 16-byte vector atomics on sm90 (512 contiguous bytes per
  // warp), scalar ones before (no vector atomics there; 128 contiguous bytes per warp). On the
  // H100, scalar ones in this layout: 2.4-9.7% slower than vector ones (d192/d256), and 29-56%
  // faster than the sm_80 code's earlier scalar ones 16 bytes apart (docs/NOTES.md, session 17).
  // FLASHCUTE_SM80_DQ_SCALAR_ATOMICS takes the scalar ones on sm90 too (to test that path there).
  static constexpr int kNThreadsDq = kNThreads;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && !defined(FLASHCUTE_SM80_DQ_SCALAR_ATOMICS)
  static constexpr int kDqAccumVector = 4;
#else
  static constexpr int kDqAccumVector = 1;
#endif
  using SmemLayoutdQ = SmemLayoutQ;
  using SmemCopyAtomdQ = SmemCopyAtomO;
  using GmemTiledCopydQ = GmemTiledCopyStore;
  static constexpr int kSmemRowsSize = 2 * kBlockM * sizeof(float);  // L and D of the block's rows
  // Q, dO (and their L, D) double-buffered (the next block loads during the whole step) when
  // that fits in the 163 KB an sm80 CTA can have; single-buffered otherwise (d = 256).
  static constexpr int kStagesQdO =
      2 * (2 * kSmemQSize + kSmemRowsSize) + 2 * kSmemKSize + 2 * kSmemPSize <= 163 * 1024 ? 2 : 1;
  static constexpr int kSmemSize =
      kStagesQdO * (2 * kSmemQSize + kSmemRowsSize) + 2 * kSmemKSize + 2 * kSmemPSize;  // Q dO K V P dS L D
};


// Backward: 8 warps; per head dim (kBlockM, kBlockN) and the warp layouts of the S/dP, dK/dV and
// dQ GEMMs.
template <int kHeadDim, typename Element>
struct BwdConfig;
template <typename E> struct BwdConfig<32, E> { using Traits = BwdKernelTraits<32, 128, 128, 8, 4, 4, 4, E>; };
template <typename E> struct BwdConfig<64, E> { using Traits = BwdKernelTraits<64, 128, 128, 8, 4, 4, 4, E>; };
template <typename E> struct BwdConfig<96, E> { using Traits = BwdKernelTraits<96, 64, 128, 8, 2, 4, 4, E>; };
template <typename E> struct BwdConfig<128, E> { using Traits = BwdKernelTraits<128, 64, 128, 8, 2, 4, 2, E>; };
template <typename E> struct BwdConfig<192, E> { using Traits = BwdKernelTraits<192, 64, 64, 8, 4, 2, 2, E>; };
template <typename E> struct BwdConfig<256, E> { using Traits = BwdKernelTraits<256, 64, 64, 8, 4, 2, 2, E>; };

}  // namespace flashcute::sm80
