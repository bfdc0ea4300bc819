// flashcute — the parameter block shared by the CPU backend and the CUDA kernels.
//
// Plain data only (no torch types), so the same struct is filled once by the op
// and read by either backend. Tensors are (batch, seqlen, heads, headdim) with
// arbitrary int64 strides and a unit stride on headdim.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FLASHCUTE_HOST_DEVICE __host__ __device__
#else
#define FLASHCUTE_HOST_DEVICE
#endif

namespace flashcute {

// Strides of one (batch, seqlen, heads, headdim) tensor, in elements.
struct Strides {
  int64_t batch = 0;
  int64_t row = 0;
  int64_t head = 0;
};

// A block-sparse layout (SPEC: BlockSparseMask). Query block i (block_m rows) of batch b, head h
// attends the key blocks (block_n keys each) kv_idx[b, h, i, 0 .. kv_num[b, h, i]); scores
// outside them are -inf. q_num / q_idx are the same layout transposed (for key block j, the
// query blocks that list it, ascending), which the backward walks. All int32, contiguous,
// (mask_batch, mask_heads, ...) with mask_batch in {1, batch}, mask_heads in {1, nheads}: a
// dimension of 1 broadcasts. kv_num == nullptr: dense (every block).
struct BlockSparse {
  const int* kv_num = nullptr;  // (mask_batch, mask_heads, num_q_blocks)
  const int* kv_idx = nullptr;  // (mask_batch, mask_heads, num_q_blocks, num_kv_blocks)
  const int* q_num = nullptr;   // (mask_batch, mask_heads, num_kv_blocks)
  const int* q_idx = nullptr;   // (mask_batch, mask_heads, num_kv_blocks, num_q_blocks)
  int mask_batch = 1;
  int mask_heads = 1;
  int num_q_blocks = 0;
  int num_kv_blocks = 0;
  int block_m = 0;
  int block_n = 0;

  FLASHCUTE_HOST_DEVICE bool enabled() const { return kv_num != nullptr; }
  // Index of (b, h) among the mask's (mask_batch, mask_heads) rows.
  FLASHCUTE_HOST_DEVICE int64_t row(int b, int h) const {
    return int64_t(mask_batch == 1 ? 0 : b) * mask_heads + (mask_heads == 1 ? 0 : h);
  }
};

struct FwdParams {
  // Inputs: q (b, sq, h, d); k, v (b, sk, h_kv, d).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  Strides q_stride, k_stride, v_stride;

  // Outputs: out (b, sq, h, d) in q's dtype; lse (b, h, sq) float32, contiguous.
  void* o = nullptr;
  Strides o_stride;
  float* lse = nullptr;

  int batch = 0;
  int seqlen_q = 0;
  int seqlen_k = 0;
  int nheads = 0;
  int nheads_kv = 0;
  int headdim = 0;

  float scale = 1.f;       // softmax scale applied to q·k
  float scale_log2 = 1.f;  // scale * log2(e): exp(scale*s - m) == exp2(scale_log2*s - m')
  bool causal = false;     // bottom-right aligned: key j masked for query i when j > i + sk - sq
  BlockSparse sparse;      // block-sparse layout; disabled: dense

  // Query head h reads key/value head h / h_per_kv (GQA/MQA).
  FLASHCUTE_HOST_DEVICE int h_per_kv() const { return nheads / nheads_kv; }
};

struct BwdParams : FwdParams {
  // Gradient of out (b, sq, h, d), any strides with a unit last stride.
  const void* dout = nullptr;
  Strides do_stride;

  // Gradients, in the inputs' dtype: dq (b, sq, h, d); dk, dv (b, sk, h_kv, d).
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides dq_stride, dk_stride, dv_stride;

  // Workspace: D = rowsum(dO * O), float32 (b, h, rows) contiguous, rows = sq on the CPU and
  // sq rounded up to whole query blocks on CUDA, where lse_log2 (same shape: L * log2(e), +inf
  // on padded rows) comes with it; the float32 dQ accumulator (CUDA; see bwd_kernel.h).
  float* dsum = nullptr;
  float* lse_log2 = nullptr;
  const float* dlse = nullptr;  // optional gradient of lse (b, h, sq) contiguous: D -= dlse
  float* dq_accum = nullptr;

  bool deterministic = false;
};

}  // namespace flashcute
