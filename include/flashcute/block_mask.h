// flashcute — the block-mask transpose stage: from the key-major lists of a block-sparse mask
// (for each query block, the key blocks it attends) to the query-major lists the backward walks
// (for each key block, the query blocks that attend it, ascending). Run once per mask.
//
//   1. flashcute_block_mask_scatter_kernel: a (rows, num_kv_blocks, num_q_blocks) byte map,
//      cleared by the caller, gets a 1 at (r, j, i) for every listed (i, j).
//   2. flashcute_block_mask_compact_kernel: one warp per (r, j) compacts its row of the map
//      into q_idx (ascending, zero-padded) and q_num.
// r runs over the mask's (batch, head) rows.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace flashcute {

// One CTA per (r, i): its listed key blocks, out-of-range ones ignored.
__global__ void __launch_bounds__(128)
    flashcute_block_mask_scatter_kernel(const int* kv_num, const int* kv_idx, uint8_t* map, int num_q_blocks,
                                        int num_kv_blocks) {
  const int64_t row = blockIdx.x;  // r * num_q_blocks + i
  const int64_t r = row / num_q_blocks;
  const int i = row % num_q_blocks;
  const int num = min(max(kv_num[row], 0), num_kv_blocks);
  for (int e = threadIdx.x; e < num; e += blockDim.x) {
    const int j = kv_idx[row * num_kv_blocks + e];
    if (j >= 0 && j < num_kv_blocks) map[(r * num_kv_blocks + j) * num_q_blocks + i] = 1;
  }
}

// One warp per (r, j): ballots over 32 query blocks at a time keep the order.
__global__ void __launch_bounds__(128)
    flashcute_block_mask_compact_kernel(const uint8_t* map, int* q_num, int* q_idx, int64_t rows, int num_q_blocks) {
  const int64_t row = int64_t(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;  // r * num_kv_blocks + j
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const uint8_t* src = map + row * num_q_blocks;
  int* dst = q_idx + row * num_q_blocks;
  int count = 0;
  for (int base = 0; base < num_q_blocks; base += 32) {
    const int i = base + lane;
    const bool kept = i < num_q_blocks && src[i] != 0;
    const unsigned ballot = __ballot_sync(0xffffffffu, kept);
    if (kept) dst[count + __popc(ballot & ((1u << lane) - 1))] = i;
    count += __popc(ballot);
  }
  for (int k = count + lane; k < num_q_blocks; k += 32) dst[k] = 0;
  if (lane == 0) q_num[row] = count;
}

}  // namespace flashcute
