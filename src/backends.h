// flashcute — entry points of the two backends, called by the op (src/ops.cpp).
#pragma once

#include "flashcute/params.h"

#ifdef FLASHCUTE_WITH_CUDA
#include "flashcute/launch.h"
#endif

namespace flashcute {

enum class DType { kFloat32, kFloat16, kBFloat16 };

void run_fwd_cpu(const FwdParams& params, DType dtype);
void run_bwd_cpu(const BwdParams& params, DType dtype);

#ifdef FLASHCUTE_WITH_CUDA
// Defined in src/cuda/: dispatch to the instantiated head dims of this build.
// `stream` is a cudaStream_t.
void run_fwd_cuda(const FwdParams& params, DType dtype, void* stream);
BwdWorkspace bwd_workspace_cuda(const BwdParams& params, DType dtype, int num_sms);
void run_bwd_stage_cuda(BwdStage stage, const BwdParams& params, const BwdWorkspace& workspace, DType dtype,
                        void* stream);
// The smallest instantiated head dim >= headdim for dtype, or 0 when this build has none.
int cuda_kernel_headdim(int headdim, DType dtype);
#endif

}  // namespace flashcute
