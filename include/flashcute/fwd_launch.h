// flashcute — forward launch: tile shapes per head dim, grid, shared memory, checks.
#pragma once

#include "fwd_kernel.h"
#include "launch.h"

namespace flashcute {

// Tiles and warps per head dim for sm80/sm90, chosen by measurement on an H200 (docs/NOTES.md,
// scripts/tile_sweep.sh): 128 query rows per CTA and 64 keys per step (128 for d = 32, FA2's
// choice, not re-measured), with 8 warps for the widest heads, whose O accumulator would not
// fit in 4 warps' registers.
template <int kHeadDim, typename Element>
struct FwdConfig {
  static constexpr int kBlockN = kHeadDim <= 32 ? 128 : 64;
  static constexpr int kNWarps = kHeadDim <= 128 ? 4 : 8;
  using Traits = KernelTraits<kHeadDim, 128, kBlockN, kNWarps, Element>;
};

template <typename Traits, typename MaskPolicy>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
  check_sparse_tiles(params.sparse, Traits::kBlockM, Traits::kBlockN);
  constexpr int kSmem = Traits::kSmemSize;
  auto kernel = &flashcute_fwd_kernel<Traits, MaskPolicy>;
  if (kSmem > 48 * 1024) {
    FLASHCUTE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  }
  const dim3 grid(ceil_div(params.seqlen_q, Traits::kBlockM) * params.batch * params.nheads);
  kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(params);
  FLASHCUTE_CUDA_CHECK(cudaGetLastError());
}

template <typename Element, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  using Traits = typename FwdConfig<kHeadDim, Element>::Traits;
  with_mask_policy(params, [&](auto mask) {
    launch_fwd<Traits, typename decltype(mask)::type>(params, stream);
  });
}

}  // namespace flashcute
