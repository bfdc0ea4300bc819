// flashcute — the parameter block shared by the CPU backend and the CUDA kernels.
//
// Plain data only (no torch types), so the same struct is filled once by the op
// and read by either backend. Tensors are (batch, seqlen, heads, headdim) with
// arbitrary int64 strides and a unit stride on headdim; packed variable-length tensors
// are (total, heads, headdim), i.e. batch 1 and a batch stride of 0, with cu_seqlens.
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

  // Outputs: out (b, sq, h, d) in q's dtype; lse (b, h, sq) float32, contiguous ((h, total_q)
  // for packed variable-length batches).
  void* o = nullptr;
  Strides o_stride;
  float* lse = nullptr;

  int batch = 0;     // number of sequences
  int seqlen_q = 0;  // per sequence (the maximum over sequences when cu_seqlens_q is set)
  int seqlen_k = 0;
  int nheads = 0;
  int nheads_kv = 0;
  int headdim = 0;

  // Scores (SPEC score pipeline). The kernels keep raw q.k in their accumulators; a score
  // modification (softcap, ALiBi: common/score_mod.h) turns them into "softmax units", which the
  // softmax multiplies by softmax_scale_log2 (exp2) or softmax_scale (LSE, natural log).
  float scale = 1.f;               // the user's scale of q.k (gradients: dQ = scale dS K)
  float softmax_scale = 1.f;       // softmax units -> natural-log units: scale, or 1 with softcap
  float softmax_scale_log2 = 1.f;  // softmax_scale * log2(e)
  float softcap = 0.f;             // c > 0: s = c tanh(scale q.k / c), in softmax units; 0: off
  // ALiBi: s -= slope[b, h] |p_i - j|, slope from alibi_slopes[b * alibi_batch_stride + h]
  // (float32; stride 0 for (h,) slopes), times alibi_scale into softmax units (1 / scale, or 1
  // with softcap). nullptr: off.
  const float* alibi_slopes = nullptr;
  int64_t alibi_batch_stride = 0;
  float alibi_scale = 1.f;
  // Dropout (step 6; common/dropout.h): rng_state = (seed, offset), int64 on the params' device;
  // nullptr: off. A score is kept iff its random byte <= dropout_threshold, and kept ones are
  // scaled by dropout_scale = 1 / (1 - p); dropout_keep = 1 - p (the backward's D is scaled by it).
  const int64_t* rng_state = nullptr;
  uint32_t dropout_threshold = 255;
  float dropout_scale = 1.f;
  float dropout_keep = 1.f;

  // Which keys a query row sees (common/mask_rules.h): bottom-right aligned window (L, R), -1
  // unbounded; causal is R = 0 (set by the op, which also keeps `causal` for reference).
  bool causal = false;
  int window_left = -1;
  int window_right = -1;
  BlockSparse sparse;  // block-sparse layout; disabled: dense

  // Packed variable-length batches (common/seqlen.h): sequence b owns rows
  // [cu_seqlens_q[b], cu_seqlens_q[b + 1]) of q (and likewise k, v); values are clamped to
  // [0, total_*], so no device-side value leads outside the tensors. nullptr: padded batches.
  const int* cu_seqlens_q = nullptr;
  const int* cu_seqlens_k = nullptr;
  int total_q = 0;  // rows of the packed q (and out, lse)
  int total_k = 0;  // rows of the packed k, v

  // KV cache (attention_with_kvcache): k, v are the cache, seqlen_k its capacity per sequence.
  // Sequence b has its first cache_seqlens[b] + seqlen_new positions (clamped to [0, seqlen_k]):
  // cache_seqlens == nullptr: every position. Paged (block_table != nullptr): position t of
  // sequence b is row t % page_size of page block_table[b * block_table_stride + t / page_size]
  // (k_stride.batch is the page stride; ids clamped to [0, num_pages)), seqlen_k = max_pages *
  // page_size.
  const int* cache_seqlens = nullptr;
  int seqlen_new = 0;
  const int* block_table = nullptr;
  int64_t block_table_stride = 0;
  int page_size = 0;
  int num_pages = 0;
  // GQA packing: the kernel's query rows are (position, head) pairs, row r of the query heads
  // [h0, h0 + pack_gqa) being position r / pack_gqa of head h0 + r % pack_gqa, so a CTA reads its
  // K/V head once for all of them. 1: one query head per CTA.
  int pack_gqa = 1;
  // Split-KV: the key tiles of a query tile split in num_splits ranges, each CTA writing its
  // float32 O (normalised within the split) to o_accum (num_splits, batch, nheads, seqlen_q,
  // headdim) and its lse to lse_accum (num_splits, batch, nheads, seqlen_q), which a combine
  // kernel merges into o and lse.
  int num_splits = 1;
  float* o_accum = nullptr;
  float* lse_accum = nullptr;

  // The GPU's SM count (set by the dispatcher): the grid of persistent kernels. 0: one CTA per tile.
  int num_sms = 0;

  // Query head h reads key/value head h / h_per_kv (GQA/MQA).
  FLASHCUTE_HOST_DEVICE int h_per_kv() const { return nheads / nheads_kv; }
  FLASHCUTE_HOST_DEVICE bool is_varlen() const { return cu_seqlens_q != nullptr; }
  FLASHCUTE_HOST_DEVICE bool has_window() const { return window_left >= 0 || window_right >= 0; }
  FLASHCUTE_HOST_DEVICE bool has_dropout() const { return rng_state != nullptr; }
  FLASHCUTE_HOST_DEVICE bool has_score_mod() const { return softcap > 0.f || alibi_slopes != nullptr; }
  // A plain call: no dropout and no score modification (the kernels without their code serve it).
  FLASHCUTE_HOST_DEVICE bool is_plain() const { return !has_dropout() && !has_score_mod(); }
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
  // on padded rows) comes with it; the float32 dQ accumulator (CUDA; see common/bwd_pre_post.h).
  float* dsum = nullptr;
  float* lse_log2 = nullptr;
  const float* dlse = nullptr;  // optional gradient of lse (lse's layout, contiguous): D -= dlse
  float* dq_accum = nullptr;
  // CUDA: the persistent backward's tile counter (common/scheduler.h), zeroed by the preprocess.
  int* tile_counter = nullptr;

  bool deterministic = false;
};

}  // namespace flashcute
