// flashcute — packed variable-length batches: the rows outside every sequence. The kernels write
// only rows inside sequences; out (and lse) and the gradients of the rows past cu_seqlens[-1]
// (SPEC: out 0, lse -inf, zero gradients) are set here, reading the bounds on the device (no
// host sync). One thread per (row, head); threads of rows inside [cu[0], cu[n]) return at once.
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"

namespace flashcute {
namespace {

__global__ void __launch_bounds__(256)
    flashcute_varlen_clear_kernel(char* t, int64_t row_stride, int64_t head_stride, int elem_bytes, int64_t total,
                                  int64_t heads, int64_t headdim, const int* cu, int64_t n, float* lse) {
  const int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;  // row * heads + head
  if (idx >= total * heads) return;
  const int64_t row = idx / heads, head = idx % heads;
  const int64_t begin = max(cu[0], 0), end = max(int64_t(cu[n]), begin);
  if (row >= begin && row < end) return;
  char* dst = t + (row * row_stride + head * head_stride) * elem_bytes;
  for (int64_t c = 0; c < headdim * elem_bytes; c += 2) *reinterpret_cast<uint16_t*>(dst + c) = 0;  // 16-bit dtypes
  if (lse != nullptr) lse[head * total + row] = -INFINITY;
}

}  // namespace

void run_varlen_clear(void* t, int64_t row_stride, int64_t head_stride, int elem_bytes, int64_t total, int64_t heads,
                      int64_t headdim, const int* cu, int64_t n, float* lse, cudaStream_t stream) {
  if (total == 0 || heads == 0) return;
  const int64_t threads = total * heads;
  launch_kernel(&flashcute_varlen_clear_kernel, dim3((threads + 255) / 256), 256, 0, stream, static_cast<char*>(t),
                row_stride, head_stride, elem_bytes, total, heads, headdim, cu, n, lse);
}

}  // namespace flashcute
