// flashcute — entry points of the two backends, called by the op (src/ops.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "flashcute/params.h"

#ifdef FLASHCUTE_WITH_CUDA
#include "flashcute/launch.h"
#endif

namespace flashcute {

enum class DType { kFloat32, kFloat16, kBFloat16 };

void run_fwd_cpu(const FwdParams& params, DType dtype);
void run_bwd_cpu(const BwdParams& params, DType dtype);

// The kernel family setting (flashcute.kernels): 0 = auto, 80 = sm80, 90 = sm90 (src/ops.cpp).
int kernel_family();

#ifdef FLASHCUTE_WITH_CUDA
// Defined in src/cuda/dispatch.cu: dispatch to the instances of this build. device_arch is the
// GPU's compute capability as 10 * major + minor; `stream` is a cudaStream_t.
// The forward returns the family that ran (80 or 90).
int run_fwd_cuda(const FwdParams& params, DType dtype, int device_arch, int num_sms, void* stream);
BwdWorkspace bwd_workspace_cuda(const BwdParams& params, DType dtype, int device_arch, int num_sms);
void run_bwd_stage_cuda(BwdStage stage, const BwdParams& params, const BwdWorkspace& workspace, DType dtype,
                        void* stream);
// The smallest instantiated forward head dim >= headdim for dtype (either family), or 0 when this
// build has none.
int cuda_kernel_headdim(int headdim, DType dtype);
// The kernel families (80, 90) this build has forward kernels of that run on device_arch (10 *
// major + minor; 0: any).
std::vector<int64_t> cuda_kernel_families(int device_arch);
// KV cache: fills params.pack_gqa and params.num_splits (requested: 0 = heuristic, or forced)
// for the kernel that will run, and returns its family: 80, the sm80 KV-cache kernel, writing
// o_accum / lse_accum, then the combine kernel (src/cuda/kvcache.cu), writing out and lse; 90,
// the sm90 decoding kernel, writing out and lse itself.
int kvcache_plan_cuda(FwdParams& params, DType dtype, int device_arch, int num_sms, int requested_splits);
void run_kvcache_cuda(const FwdParams& params, DType dtype, int arch, void* stream);
// KV cache, chunked prefill on sm90 GPUs: whether the sm90 forward (run_fwd_cuda) serves the call
// (dispatch.cu) instead of the KV-cache kernel.
bool kvcache_on_sm90_cuda(const FwdParams& params, DType dtype, int device_arch, int num_sms, int requested_splits);
#endif

}  // namespace flashcute
