// flashcute — picks the kernel instance for a call from the table of what this build has
// (flashcute_instances.h, generated): the kernel family (sm90 on sm90 GPUs for the calls it
// serves, unless flashcute.kernels("sm80") forces the other; sm80 otherwise), then the smallest
// head dim of that family that holds the call's head dim (the kernels zero-pad the rest), in
// the call's dtype.
#include <cutlass/numeric_types.h>

#include <stdexcept>
#include <string>

#include "backends.h"
#include "flashcute/launch.h"
#include "flashcute_instances.h"

namespace flashcute {
namespace {

struct FwdInstance {
  int arch;
  int headdim;
  DType dtype;
  void (*run)(const FwdParams&, cudaStream_t);
};
struct BwdInstance {
  int arch;
  int headdim;
  DType dtype;
  BwdWorkspace (*workspace)(const BwdParams&, int);
  void (*stage)(BwdStage, const BwdParams&, const BwdWorkspace&, cudaStream_t);
};

#define FLASHCUTE_FWD_ROW(A, F, D, E, T) FwdInstance{A, D, DType::T, &F::run_fwd<E, D>},
#define FLASHCUTE_BWD_ROW(A, F, D, E, T) \
  BwdInstance{A, D, DType::T, &F::bwd_workspace<E, D>, &F::run_bwd_stage<E, D>},
const FwdInstance kFwdInstances[] = {FLASHCUTE_FOR_EACH_FWD_INSTANCE(FLASHCUTE_FWD_ROW)};
const BwdInstance kBwdInstances[] = {FLASHCUTE_FOR_EACH_BWD_INSTANCE(FLASHCUTE_BWD_ROW)};
#undef FLASHCUTE_FWD_ROW
#undef FLASHCUTE_BWD_ROW

// The instance of `arch` for (headdim, dtype): the smallest head dim >= headdim, or nullptr.
template <typename Row, size_t N>
const Row* pick(const Row (&rows)[N], int arch, int headdim, DType dtype) {
  const Row* best = nullptr;
  for (const Row& r : rows) {
    if (r.arch == arch && r.dtype == dtype && r.headdim >= headdim && (best == nullptr || r.headdim < best->headdim)) {
      best = &r;
    }
  }
  return best;
}

// TMA describes q, k, v when every stride that matters is a positive multiple of 16 bytes (the
// op already copies tensors with misaligned pointers or strides; negative or zero strides, as in
// flipped or expanded views, remain).
bool tma_describes(const Strides& s, int heads, int batch) {
  auto ok = [](int64_t stride, int extent) { return extent <= 1 || (stride > 0 && (stride * 2) % 16 == 0); };
  return ok(s.row, 2) && ok(s.head, heads) && ok(s.batch, batch);
}

// The calls the sm90 forward serves (the rest run on sm80): sm_90a code runs on compute
// capability 9.0 only, and its loads are TMA copies.
bool sm90_fwd_serves(const FwdParams& p, int device_arch) {
  const int batch = p.is_varlen() ? 1 : p.batch;
  return device_arch == 90 && tma_describes(p.q_stride, p.nheads, batch) &&
         tma_describes(p.k_stride, p.nheads_kv, batch) && tma_describes(p.v_stride, p.nheads_kv, batch);
}

[[noreturn]] void no_instance(int headdim) {
  throw std::invalid_argument("flashcute: no CUDA kernel for headdim " + std::to_string(headdim) + " in this build");
}

}  // namespace

int cuda_kernel_headdim(int headdim, DType dtype) {
  const FwdInstance* r = pick(kFwdInstances, 80, headdim, dtype);
  return r != nullptr ? r->headdim : 0;
}

std::vector<int64_t> cuda_kernel_families() {
  std::vector<int64_t> families;
  for (const FwdInstance& r : kFwdInstances) {
    if (families.empty() || families.back() != r.arch) families.push_back(r.arch);
  }
  return families;
}

#ifdef FLASHCUTE_TUNING
bool run_fwd_tuning(const FwdParams& params, DType dtype, cudaStream_t stream);  // src/cuda/tuning.cu
#endif

int run_fwd_cuda(const FwdParams& params, DType dtype, int device_arch, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
#ifdef FLASHCUTE_TUNING
  if (run_fwd_tuning(params, dtype, s)) return 80;
#endif
  const FwdInstance* r = nullptr;
  if (kernel_family() != 80 && sm90_fwd_serves(params, device_arch)) r = pick(kFwdInstances, 90, params.headdim, dtype);
  if (r == nullptr) r = pick(kFwdInstances, 80, params.headdim, dtype);
  if (r == nullptr) no_instance(params.headdim);
  r->run(params, s);
  return r->arch;
}

BwdWorkspace bwd_workspace_cuda(const BwdParams& params, DType dtype, int num_sms) {
  const BwdInstance* r = pick(kBwdInstances, 80, params.headdim, dtype);
  if (r == nullptr) no_instance(params.headdim);
  return r->workspace(params, num_sms);
}

void run_bwd_stage_cuda(BwdStage stage, const BwdParams& params, const BwdWorkspace& workspace, DType dtype,
                        void* stream) {
  const BwdInstance* r = pick(kBwdInstances, 80, params.headdim, dtype);
  if (r == nullptr) no_instance(params.headdim);
  r->stage(stage, params, workspace, static_cast<cudaStream_t>(stream));
}

}  // namespace flashcute
