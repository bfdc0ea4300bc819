// flashcute — the host-side entry points of the CUDA kernels, one per (kernel family, element,
// head dim). Light on purpose: no CuTe kernels here, so the dispatcher compiles quickly. The
// template bodies live in each family's launchers (sm80/fwd_launch.h, sm80/bwd_launch.h,
// sm90/fwd_launch.h, sm90/bwd_launch.h) and are instantiated in generated units, one per family, head dim and dtype
// (cmake/instantiations.cmake); src/cuda/dispatch.cu holds the table of what a build has.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace flashcute {

// The backward's fp32 dQ accumulator: (num_splits, batch, nheads, seqlen_rounded, headdim)
// floats, allocated by the caller (no need to clear it: the preprocess stage does).
struct BwdWorkspace {
  int seqlen_rounded = 0;  // seqlen_q rounded up to the kernels' query blocks (packed: total rows, padded)
  int headdim = 0;         // the kernel's head dim (>= params.headdim)
  int num_splits = 1;      // > 1 only in deterministic mode
  int arch = 80;           // the kernel family the dispatcher picked: every stage runs its kernels
  // Floats of D (and of L): (batch, nheads, seqlen_rounded); batch 1 for packed batches.
  int64_t rows_numel(const FwdParams& p) const {
    return int64_t(p.is_varlen() ? 1 : p.batch) * p.nheads * seqlen_rounded;
  }
  // Floats of the dQ accumulator.
  int64_t numel(const FwdParams& p) const { return int64_t(num_splits) * rows_numel(p) * headdim; }
};

// The backward's three stages, launched one by one by the op (which names each in Nsight and
// the torch profiler).
enum class BwdStage { kPreprocess, kMain, kConvertDq };

namespace sm80 {
template <typename Element, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
BwdWorkspace bwd_workspace(const BwdParams& params, int num_sms);
template <typename Element, int kHeadDim>
void run_bwd_stage(BwdStage stage, const BwdParams& params, const BwdWorkspace& workspace, cudaStream_t stream);
}  // namespace sm80

namespace sm90 {
template <typename Element, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
BwdWorkspace bwd_workspace(const BwdParams& params, int num_sms);
template <typename Element, int kHeadDim>
void run_bwd_stage(BwdStage stage, const BwdParams& params, const BwdWorkspace& workspace, cudaStream_t stream);
}  // namespace sm90

// KV cache: the KV-cache forward of one (element, head dim) (sm80/fwd_launch.h; sm90: the
// decoding kernel, sm90/decode_launch.h), its tile shape (for the split heuristic), and the
// kernels of src/cuda/kvcache.cu: the append of new tokens and the combine of the sm80 kernel's
// split-KV partials into out (params.o, float16 or bfloat16) and lse.
namespace sm80 {
template <typename Element, int kHeadDim>
void run_fwd_kvcache(const FwdParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
void kvcache_tiles(const FwdParams& params, int& block_m, int& block_n, int& ctas_per_sm);
}  // namespace sm80
namespace sm90 {
template <typename Element, int kHeadDim>
void run_fwd_kvcache(const FwdParams& params, cudaStream_t stream);
template <typename Element, int kHeadDim>
void kvcache_tiles(const FwdParams& params, int& block_m, int& block_n, int& ctas_per_sm);
}  // namespace sm90

struct KvAppend {
  const int* cache_seqlens = nullptr;
  const int* block_table = nullptr;  // nullptr: contiguous (page = batch index)
  int64_t block_table_stride = 0;
  int64_t page_size = 0;  // contiguous: the capacity
  int64_t capacity = 0;
  int64_t num_pages = 0;
  int64_t batch = 0, seqlen_new = 0, heads = 0, headdim = 0;
  const void* src[2] = {nullptr, nullptr};  // k, v: (batch, seqlen_new, heads, headdim)
  void* dst[2] = {nullptr, nullptr};        // k_cache, v_cache
  Strides src_stride[2], dst_stride[2];
};
void run_kvcache_append(const KvAppend& a, cudaStream_t stream);
void run_kvcache_combine(const FwdParams& params, bool bf16, cudaStream_t stream);

// The block-mask transpose stage (block_mask.h): map is a cleared byte buffer of
// mask_rows * num_kv_blocks * num_q_blocks; kv_num/kv_idx in, q_num/q_idx out (layouts in params.h).
void run_block_mask_transpose(const int* kv_num, const int* kv_idx, uint8_t* map, int* q_num, int* q_idx,
                              int64_t mask_rows, int num_q_blocks, int num_kv_blocks, cudaStream_t stream);

// Packed batches: rows of a (total, heads, headdim) tensor outside [cu[0], cu[n]) set to zero and,
// when lse (heads, total) is given, lse = -inf there (src/cuda/varlen.cu). cu is read on the device.
void run_varlen_clear(void* t, int64_t row_stride, int64_t head_stride, int elem_bytes, int64_t total, int64_t heads,
                      int64_t headdim, const int* cu, int64_t n, float* lse, cudaStream_t stream);

// flashcute.dropout_mask: keep (batch, nheads, seqlen_q, seqlen_k) bytes from common/dropout.h's map,
// rng_state (seed, offset) read on the device (src/cuda/dropout.cu).
void run_dropout_mask(bool* keep, const int64_t* rng_state, int64_t batch, int64_t nheads, int64_t seqlen_q,
                      int64_t seqlen_k, uint32_t threshold, cudaStream_t stream);

}  // namespace flashcute
