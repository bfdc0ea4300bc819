// flashcute — the KV cache's small kernels: appending new tokens in place, and combining the
// split-KV partials of the KV-cache forward (flash-decoding) into out and lse.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "flashcute/common/epilogue.h"
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"

namespace flashcute {
namespace {

// One 16-bit element (the CUDA dtypes) per thread (new tokens are few): position
// cache_seqlens[b] + t of sequence b, through the page table when paged. Positions outside the
// cache, and page ids outside it, are dropped (the wrapper raises for them where it checks the
// values, python/flashcute/api.py); nothing is ever written out of bounds.
__global__ void flashcute_kvcache_append_kernel(const KvAppend a) {
  dependents_may_launch();  // the attention kernel (it waits for this one's writes)
  const int64_t total = a.batch * a.seqlen_new * a.heads * a.headdim;
  for (int64_t x = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; x < total; x += int64_t(gridDim.x) * blockDim.x) {
    const int64_t c = x % a.headdim, h = (x / a.headdim) % a.heads, t = (x / a.headdim / a.heads) % a.seqlen_new,
                  b = x / a.headdim / a.heads / a.seqlen_new;
    const int64_t pos = int64_t(a.cache_seqlens[b]) + t;
    if (pos < 0 || pos >= a.capacity) continue;
    int64_t page = b;
    if (a.block_table != nullptr) {
      page = a.block_table[b * a.block_table_stride + pos / a.page_size];
      if (page < 0 || page >= a.num_pages) continue;
    }
    const int64_t slot = pos % a.page_size;
    for (int i = 0; i < 2; ++i) {
      const Strides& s = a.src_stride[i];
      const Strides& d = a.dst_stride[i];
      static_cast<uint16_t*>(a.dst[i])[page * d.batch + slot * d.row + h * d.head + c] =
          static_cast<const uint16_t*>(a.src[i])[b * s.batch + t * s.row + h * s.head + c];
    }
  }
}

// The combine's CTA: 256 threads, each summing one float4 column of O over a subset of the
// splits, about kPrefetch of them: one row (b, h, i) per CTA for many splits, several rows for
// few. The splits' partials are in L2 (just written): what costs is their latency, so each thread
// issues its first kPrefetch loads before the lse round trip, and the two overlap. Measured on
// the H100 (d128, 32 query heads, torch profiler): 3.1-3.7 us up to 33 splits (32 to 1024 rows),
// 4.3 at 128 (cuDNN's reduction: 2.0-3.9). The former kernel, a warp per row walking the splits
// one after another, took 5 / 9 / 16 / 30 us for 16 / 32 / 64 / 128 splits: more than the
// attention itself in MQA decoding.
constexpr int kCombineThreads = 256;
constexpr int kPrefetch = 8;  // float4 loads per thread issued before the weights are known

struct CombineShape {
  int cols;            // float4 columns of a row (headdim / 4)
  int groups_per_row;  // thread groups (cols threads each) per row, each over every groups_per_row-th split
  int rows_per_cta;    // rows of one CTA
  FLASHCUTE_HOST_DEVICE CombineShape(int headdim, int num_splits) {
    cols = headdim / 4;
    const int groups = kCombineThreads / cols;
    const int want = (num_splits + kPrefetch - 1) / kPrefetch;  // groups that cover the splits in one prefetch
    groups_per_row = want < 1 ? 1 : (want > groups ? groups : want);
    rows_per_cta = groups / groups_per_row;
  }
};

template <typename T>
__device__ void store4(T* out, float4 v);
template <>
__device__ void store4<__half>(__half* out, float4 v) {
  __half2* o = reinterpret_cast<__half2*>(out);
  o[0] = __floats2half2_rn(v.x, v.y);
  o[1] = __floats2half2_rn(v.z, v.w);
}
template <>
__device__ void store4<__nv_bfloat16>(__nv_bfloat16* out, float4 v) {
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out);
  o[0] = __floats2bfloat162_rn(v.x, v.y);
  o[1] = __floats2bfloat162_rn(v.z, v.w);
}

// FA2's combine: lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s (splits with
// lse_s = -inf, which saw no key, weigh 0; no key at all: O = 0, lse = -inf).
// (__launch_bounds__ with a CTA count: with only the thread count, ptxas 13.0 held the sm_90 code
// to 32 registers and spilled.)
template <typename T>
__global__ void __launch_bounds__(kCombineThreads, 3) flashcute_kvcache_combine_kernel(const __grid_constant__ FwdParams p) {
  constexpr int kMaxSplits = 256;  // the op's limit on num_splits
  // exp(lse_s - lse) of (row of the CTA, split): rows_per_cta * splits is at most kMaxSplits (one
  // row) or groups * kPrefetch (several; headdim >= 8: at most kCombineThreads / 2 groups).
  __shared__ float weight[cute::max(kMaxSplits, kCombineThreads / 2 * kPrefetch)];
  __shared__ float4 part[kCombineThreads];   // each thread's sum over its splits
  wait_for_previous_grid();                  // the attention kernel's partials
  const int64_t rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  const int splits = p.num_splits;
  const CombineShape shape(p.headdim, splits);
  const int64_t row0 = int64_t(blockIdx.x) * shape.rows_per_cta;

  // Thread (r, g, c): float4 column c of row r, over splits g, g + groups_per_row, ...
  const int group = threadIdx.x / shape.cols, c = threadIdx.x % shape.cols;
  const int r = group / shape.groups_per_row, g = group % shape.groups_per_row;
  const int64_t row = row0 + r;
  const bool active = r < shape.rows_per_cta && row < rows;
  const float4* o_s = reinterpret_cast<const float4*>(p.o_accum) + row * shape.cols + c;  // split s at o_s[s * rows * cols]
  const int64_t split_stride = rows * shape.cols;

  // 1. The first partials of this thread, in flight during 2.
  float4 o[kPrefetch];
  CUTE_UNROLL
  for (int k = 0; k < kPrefetch; ++k) {
    const int s = g + k * shape.groups_per_row;
    if (active && s < splits) o[k] = o_s[s * split_stride];
  }

  // 2. A warp per row: lse over the splits (all of a lane's loads issued at once), the weights.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int w = warp; w < shape.rows_per_cta && row0 + w < rows; w += kCombineThreads / 32) {
    const float* lse_s = p.lse_accum + row0 + w;  // split s at lse_s[s * rows]
    float l[kMaxSplits / 32];
    float m = -INFINITY;
    CUTE_UNROLL
    for (int k = 0; k < kMaxSplits / 32; ++k) {
      const int s = lane + 32 * k;
      l[k] = s < splits ? lse_s[s * rows] : -INFINITY;
      m = fmaxf(m, l[k]);
    }
    for (int x = 16; x > 0; x /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, x));
    float sum = 0.f;
    CUTE_UNROLL
    for (int k = 0; k < kMaxSplits / 32; ++k) sum += partial_weight(l[k], m);
    for (int x = 16; x > 0; x /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, x);
    const float lse = merged_lse(m, sum);
    CUTE_UNROLL
    for (int k = 0; k < kMaxSplits / 32; ++k) {
      const int s = lane + 32 * k;
      if (s < splits) weight[w * splits + s] = partial_weight(l[k], lse);
    }
    if (lane == 0) p.lse[row0 + w] = lse;  // lse (batch, nheads, seqlen_q) is row-major like the partials
  }
  __syncthreads();

  // 3. The weighted sum over this thread's splits: the prefetched ones, then the rest.
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (active) {
    CUTE_UNROLL
    for (int k = 0; k < kPrefetch; ++k) {
      const int s = g + k * shape.groups_per_row;
      if (s < splits) add_weighted(acc, weight[r * splits + s], o[k]);
    }
#pragma unroll 8
    for (int s = g + kPrefetch * shape.groups_per_row; s < splits; s += shape.groups_per_row) {
      add_weighted(acc, weight[r * splits + s], o_s[s * split_stride]);
    }
  }
  part[threadIdx.x] = acc;
  __syncthreads();

  // 4. The row's first group adds the other groups' sums and writes O.
  if (!active || g != 0) return;
  for (int k = 1; k < shape.groups_per_row; ++k) add_weighted(acc, 1.f, part[threadIdx.x + k * shape.cols]);
  const int64_t i = row % p.seqlen_q, h = (row / p.seqlen_q) % p.nheads, b = row / p.seqlen_q / p.nheads;
  store4(static_cast<T*>(p.o) + b * p.o_stride.batch + i * p.o_stride.row + h * p.o_stride.head + 4 * c, acc);
}

}  // namespace

bool chained_launch_supported(const void* kernel) {
  // FLASHCUTE_CHAINED_LAUNCH=0: plain launches (for before/after measurements in one build).
  static const bool enabled = [] {
    const char* v = std::getenv("FLASHCUTE_CHAINED_LAUNCH");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  if (!enabled) return false;
  int device = 0;
  FLASHCUTE_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, bool> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find({device, kernel});
  if (it != known.end()) return it->second;
  cudaFuncAttributes attr;
  FLASHCUTE_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  const bool ok = attr.binaryVersion >= 90 && attr.ptxVersion >= 90;
  known.emplace(std::make_pair(device, kernel), ok);
  return ok;
}

void run_kvcache_append(const KvAppend& a, cudaStream_t stream) {
  const int64_t total = a.batch * a.seqlen_new * a.heads * a.headdim;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 65535);
  launch_kernel(&flashcute_kvcache_append_kernel, dim3(blocks), 256, 0, stream, a);
}

void run_kvcache_combine(const FwdParams& params, bool bf16, cudaStream_t stream) {
  const int64_t rows = int64_t(params.batch) * params.nheads * params.seqlen_q;
  const int rows_per_cta = CombineShape(params.headdim, params.num_splits).rows_per_cta;
  const dim3 grid((rows + rows_per_cta - 1) / rows_per_cta);
  if (bf16) {
    launch_kernel_chained(&flashcute_kvcache_combine_kernel<__nv_bfloat16>, grid, kCombineThreads, 0, stream, params);
  } else {
    launch_kernel_chained(&flashcute_kvcache_combine_kernel<__half>, grid, kCombineThreads, 0, stream, params);
  }
}

}  // namespace flashcute
