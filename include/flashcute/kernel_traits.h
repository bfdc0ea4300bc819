// flashcute — compile-time shape of a kernel: tiles, warps, shared-memory layouts, copy
// atoms and the tiled MMA, for one head dim and element type.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

namespace flashcute {

using namespace cute;

template <int kHeadDim_, int kBlockM_, int kBlockN_, int kNWarps_, typename Element_>
struct KernelTraits {
  using Element = Element_;
  using ElementAccum = float;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBlockM_;  // query rows per CTA
  static constexpr int kBlockN = kBlockN_;  // key rows per main-loop step
  static constexpr int kNWarps = kNWarps_;
  static constexpr int kNThreads = kNWarps * 32;
  static_assert(kHeadDim % 32 == 0, "instantiated head dims are multiples of 32");
  static_assert(kBlockM % (16 * kNWarps) == 0, "each warp owns whole 16-row slabs of S");

  // Tensor-core MMA m16n8k16 with fp32 accumulators; warps stacked along M, so a warp
  // owns whole rows of S and the softmax never crosses warps.
  using MmaAtom = std::conditional_t<std::is_same_v<Element, cutlass::half_t>,
                                     MMA_Atom<SM80_16x8x16_F32F16F16F32_TN>,
                                     MMA_Atom<SM80_16x8x16_F32BF16BF16F32_TN>>;
  using TiledMma = TiledMMA<MmaAtom, Layout<Shape<Int<kNWarps>, _1, _1>>, Tile<Int<16 * kNWarps>, _16, _16>>;

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

  static constexpr int kSmemQSize = kBlockM * kHeadDim * sizeof(Element);
  static constexpr int kSmemKVSize = 2 * kBlockN * kHeadDim * sizeof(Element);  // sK and sV
  static constexpr int kSmemSize = kSmemQSize + kSmemKVSize;
};

}  // namespace flashcute
