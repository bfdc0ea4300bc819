// flashcute — launches the block-mask transpose stage (include/flashcute/block_mask.h).
#include "flashcute/block_mask.h"
#include "flashcute/launch.h"
#include "flashcute/common/utils.h"

namespace flashcute {

void run_block_mask_transpose(const int* kv_num, const int* kv_idx, uint8_t* map, int* q_num, int* q_idx,
                              int64_t mask_rows, int num_q_blocks, int num_kv_blocks, cudaStream_t stream) {
  if (mask_rows == 0 || num_q_blocks == 0 || num_kv_blocks == 0) return;
  flashcute_block_mask_scatter_kernel<<<dim3(mask_rows * num_q_blocks), 128, 0, stream>>>(
      kv_num, kv_idx, map, num_q_blocks, num_kv_blocks);
  FLASHCUTE_CUDA_CHECK(cudaGetLastError());
  const int64_t rows = mask_rows * num_kv_blocks;
  flashcute_block_mask_compact_kernel<<<dim3((rows + 3) / 4), 128, 0, stream>>>(map, q_num, q_idx, rows,
                                                                                  num_q_blocks);
  FLASHCUTE_CUDA_CHECK(cudaGetLastError());
}

}  // namespace flashcute
