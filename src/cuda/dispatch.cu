// flashcute — picks the kernel instance for a call: the smallest head dim of this build
// that holds the call's head dim (the kernels zero-pad the rest), in the call's dtype.
#include <cutlass/numeric_types.h>

#include <stdexcept>
#include <string>

#include "backends.h"
#include "flashcute/launch.h"
#include "flashcute_instances.h"

namespace flashcute {

int cuda_kernel_headdim(int headdim, DType dtype) {
  int best = 0;
#define FLASHCUTE_PICK(D, ELEMENT, DTYPE) \
  if (dtype == DType::DTYPE && D >= headdim && (best == 0 || D < best)) best = D;
  FLASHCUTE_FOR_EACH_INSTANCE(FLASHCUTE_PICK)
#undef FLASHCUTE_PICK
  return best;
}

// Runs STATEMENT with ELEMENT and D bound to the instance that serves (headdim, dtype).
#define FLASHCUTE_WITH_INSTANCE(headdim, dtype, STATEMENT)                         \
  do {                                                                           \
    const int kernel_dim_ = cuda_kernel_headdim(headdim, dtype);                 \
    FLASHCUTE_FOR_EACH_INSTANCE(FLASHCUTE_IF_INSTANCE_##STATEMENT)                \
    throw std::invalid_argument("flashcute: no CUDA kernel for headdim " +       \
                                std::to_string(headdim) + " in this build");     \
  } while (0)

#ifdef FLASHCUTE_TUNING
bool run_fwd_tuning(const FwdParams& params, DType dtype, cudaStream_t stream);  // src/cuda/tuning.cu
#endif

void run_fwd_cuda(const FwdParams& params, DType dtype, void* stream) {
#ifdef FLASHCUTE_TUNING
  if (run_fwd_tuning(params, dtype, static_cast<cudaStream_t>(stream))) return;
#endif
#define FLASHCUTE_IF_INSTANCE_FWD(D, ELEMENT, DTYPE)                                 \
  if (dtype == DType::DTYPE && kernel_dim_ == D) {                                \
    return run_fwd<ELEMENT, D>(params, static_cast<cudaStream_t>(stream));        \
  }
  FLASHCUTE_WITH_INSTANCE(params.headdim, dtype, FWD);
}

BwdWorkspace bwd_workspace_cuda(const BwdParams& params, DType dtype, int num_sms) {
#define FLASHCUTE_IF_INSTANCE_WORKSPACE(D, ELEMENT, DTYPE)                           \
  if (dtype == DType::DTYPE && kernel_dim_ == D) return bwd_workspace<ELEMENT, D>(params, num_sms);
  FLASHCUTE_WITH_INSTANCE(params.headdim, dtype, WORKSPACE);
}

void run_bwd_stage_cuda(BwdStage stage, const BwdParams& params, const BwdWorkspace& workspace, DType dtype,
                        void* stream) {
#define FLASHCUTE_IF_INSTANCE_BWD(D, ELEMENT, DTYPE)                                              \
  if (dtype == DType::DTYPE && kernel_dim_ == D) {                                             \
    return run_bwd_stage<ELEMENT, D>(stage, params, workspace, static_cast<cudaStream_t>(stream)); \
  }
  FLASHCUTE_WITH_INSTANCE(params.headdim, dtype, BWD);
}

}  // namespace flashcute
