// flashcute — flashcute.dropout_mask on the GPU: the keep mask that the kernels apply, element by
// element from common/dropout.h's map (one thread per score; for tests and debugging).
#include "flashcute/common/dropout.h"
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"

namespace flashcute {
namespace {

__global__ void __launch_bounds__(256)
    flashcute_dropout_mask_kernel(bool* keep, const int64_t* rng_state, int64_t nheads, int64_t seqlen_q,
                                  int64_t seqlen_k, int64_t total, uint32_t threshold) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // ((b * h + h) * sq + i) * sk + j
  if (idx >= total) return;
  const int64_t j = idx % seqlen_k, i = idx / seqlen_k % seqlen_q, bh = idx / seqlen_k / seqlen_q;
  const DropoutMap map{uint64_t(rng_state[0]), uint64_t(rng_state[1]), bh, threshold};
  keep[idx] = map.keep(int(i), int(j));
}

}  // namespace

void run_dropout_mask(bool* keep, const int64_t* rng_state, int64_t batch, int64_t nheads, int64_t seqlen_q,
                      int64_t seqlen_k, uint32_t threshold, cudaStream_t stream) {
  const int64_t total = batch * nheads * seqlen_q * seqlen_k;
  if (total == 0) return;
  launch_kernel(&flashcute_dropout_mask_kernel, dim3((total + 255) / 256), 256, 0, stream, keep, rng_state, nheads,
                seqlen_q, seqlen_k, total, threshold);
}

}  // namespace flashcute
