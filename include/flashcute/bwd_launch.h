// flashcute — backward launch: tile shapes per head dim, the three stages, checks.
#pragma once

#include "bwd_kernel.h"
#include "launch.h"

namespace flashcute {

// 8 warps; per head dim (kBlockM, kBlockN) and the warp layouts of the S/dP, dK/dV and dQ GEMMs.
template <int kHeadDim, typename Element>
struct BwdConfig;
template <typename E> struct BwdConfig<32, E> { using Traits = BwdKernelTraits<32, 128, 128, 8, 4, 4, 4, E>; };
template <typename E> struct BwdConfig<64, E> { using Traits = BwdKernelTraits<64, 128, 128, 8, 4, 4, 4, E>; };
template <typename E> struct BwdConfig<96, E> { using Traits = BwdKernelTraits<96, 64, 128, 8, 2, 4, 4, E>; };
template <typename E> struct BwdConfig<128, E> { using Traits = BwdKernelTraits<128, 64, 128, 8, 2, 4, 2, E>; };
template <typename E> struct BwdConfig<192, E> { using Traits = BwdKernelTraits<192, 64, 64, 8, 4, 2, 2, E>; };
template <typename E> struct BwdConfig<256, E> { using Traits = BwdKernelTraits<256, 64, 64, 8, 4, 2, 2, E>; };

template <typename Element, int kHeadDim>
BwdWorkspace bwd_workspace(const BwdParams& params, int num_sms) {
  using Traits = typename BwdConfig<kHeadDim, Element>::Traits;
  BwdWorkspace ws;
  ws.seqlen_rounded = ceil_div(params.seqlen_q, 128) * 128;
  ws.headdim = kHeadDim;
  ws.num_splits = 1;
  if (params.deterministic) {
    // Enough CTAs to fill the GPU, each owning one dQ split; at most 16 splits of memory.
    const int num_n_blocks = ceil_div(params.seqlen_k, Traits::kBlockN);
    const int ctas = params.batch * params.nheads_kv;
    ws.num_splits = std::max(1, std::min({num_n_blocks, ceil_div(num_sms, std::max(ctas, 1)), 16}));
  }
  return ws;
}

template <typename Element, int kHeadDim>
void run_bwd_stage(BwdStage stage, const BwdParams& params, const BwdWorkspace& ws, cudaStream_t stream) {
  using Traits = typename BwdConfig<kHeadDim, Element>::Traits;
  const DqAccumShape acc{ws.seqlen_rounded, ws.headdim, params.batch, params.nheads};
  if (stage == BwdStage::kPreprocess) {
    using Pre = PreprocessShape<kHeadDim>;
    const dim3 grid(ws.seqlen_rounded / Pre::kRowsPerCta * params.batch * params.nheads);
    flashcute_bwd_preprocess_kernel<Element, kHeadDim><<<grid, Pre::kThreads, 0, stream>>>(params, acc, ws.num_splits);
  } else if (stage == BwdStage::kMain) {
    check_sparse_tiles(params.sparse, Traits::kBlockM, Traits::kBlockN);
    auto launch = [&](auto kernel) {
      constexpr int kSmem = Traits::kSmemSize;
      if (kSmem > 48 * 1024) {
        FLASHCUTE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
      }
      const int num_n_blocks = ceil_div(params.seqlen_k, Traits::kBlockN);
      const dim3 grid((params.deterministic ? ws.num_splits : num_n_blocks) * params.batch * params.nheads_kv);
      kernel<<<grid, Traits::kNThreads, kSmem, stream>>>(params, acc);
    };
    with_mask_policy(params, [&](auto mask) {
      launch(&flashcute_bwd_kernel<Traits, typename decltype(mask)::type>);
    });
  } else {
    const dim3 grid(ceil_div(params.seqlen_q, Traits::kBlockM) * params.batch * params.nheads);
    flashcute_bwd_convert_dq_kernel<Traits><<<grid, Traits::kNThreads, 0, stream>>>(params, acc, ws.num_splits);
  }
  FLASHCUTE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashcute
