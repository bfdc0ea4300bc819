// flashcute — the host-side entry points of the CUDA kernels, one per (element, head dim).
// Light on purpose: no CuTe kernels here, so the dispatcher compiles quickly. The template
// bodies live in fwd_launch.h and bwd_launch.h and are instantiated in generated units (one per
// head dim and dtype; see cmake/instantiations.cmake).
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flashcute {

template <typename Element, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream);

// The backward's fp32 dQ accumulator: (num_splits, batch, nheads, seqlen_rounded, headdim)
// floats, allocated by the caller (no need to clear it: the preprocess stage does).
struct BwdWorkspace {
  int seqlen_rounded = 0;  // seqlen_q rounded up to the kernels' query blocks
  int headdim = 0;         // the kernel's head dim (>= params.headdim)
  int num_splits = 1;      // > 1 only in deterministic mode
  int64_t numel(const FwdParams& p) const {
    return int64_t(num_splits) * p.batch * p.nheads * int64_t(seqlen_rounded) * headdim;
  }
};

template <typename Element, int kHeadDim>
BwdWorkspace bwd_workspace(const BwdParams& params, int num_sms);

// The backward's three stages, launched one by one by the op (which names each in Nsight and
// the torch profiler).
enum class BwdStage { kPreprocess, kMain, kConvertDq };

template <typename Element, int kHeadDim>
void run_bwd_stage(BwdStage stage, const BwdParams& params, const BwdWorkspace& workspace, cudaStream_t stream);

// The block-mask transpose stage (block_mask.h): map is a cleared byte buffer of
// mask_rows * num_kv_blocks * num_q_blocks; kv_num/kv_idx in, q_num/q_idx out (layouts in params.h).
void run_block_mask_transpose(const int* kv_num, const int* kv_idx, uint8_t* map, int* q_num, int* q_idx,
                              int64_t mask_rows, int num_q_blocks, int num_kv_blocks, cudaStream_t stream);

}  // namespace flashcute
