// flashcute — tile-size experiments (built only with -DFLASHCUTE_TUNING=ON).
//
// FLASHCUTE_FWD_TILE="M,N,W" (query rows, keys per step, warps) makes the sm80 forward of head
// dims 64 and 128 in bf16 run with that tile instead of FwdConfig's, so that
// `python -m flashcute.bench` can compare tiles in one process (docs/NOTES.md has the results).
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "backends.h"
#include "flashcute/sm80/fwd_launch.h"

namespace flashcute {

namespace {
template <int D, int M, int N, int W>
bool try_tile(const char* want, const FwdParams& params, cudaStream_t stream) {
  char name[32];
  std::snprintf(name, sizeof(name), "%d,%d,%d", M, N, W);
  if (params.headdim != D || params.sparse.enabled() || params.has_score_mod() ||
      std::strcmp(want, name) != 0) {
    return false;
  }
  using Traits = sm80::KernelTraits<D, M, N, W, cutlass::bfloat16_t>;
  if (params.has_window()) {
    sm80::launch_fwd<Traits, AttentionMask<true, false>, false>(params, stream);
  } else {
    sm80::launch_fwd<Traits, AttentionMask<false, false>, false>(params, stream);
  }
  return true;
}
}  // namespace

bool run_fwd_tuning(const FwdParams& params, DType dtype, cudaStream_t stream) {
  const char* want = std::getenv("FLASHCUTE_FWD_TILE");
  if (want == nullptr || dtype != DType::kBFloat16) return false;
  return try_tile<64, 128, 128, 4>(want, params, stream) || try_tile<64, 128, 128, 8>(want, params, stream) ||
         try_tile<128, 128, 128, 8>(want, params, stream) || try_tile<128, 128, 32, 4>(want, params, stream) ||
         try_tile<128, 64, 64, 4>(want, params, stream);
}

}  // namespace flashcute
