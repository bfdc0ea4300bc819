// flashcute — the KV cache's small kernels: appending new tokens in place, and combining the
// split-KV partials of the KV-cache forward (flash-decoding) into out and lse.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "flashcute/common/utils.h"
#include "flashcute/launch.h"

namespace flashcute {
namespace {

// One 16-bit element (the CUDA dtypes) per thread (new tokens are few): position
// cache_seqlens[b] + t of sequence b, through the page table when paged. Positions outside the
// cache, and page ids outside it, are dropped (the wrapper raises for them where it checks the
// values, python/flashcute/api.py); nothing is ever written out of bounds.
__global__ void flashcute_kvcache_append_kernel(const KvAppend a) {
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

template <typename T>
__device__ T from_float(float x);
template <>
__device__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

// One warp per (batch, head, query row): lse = log sum_s exp(lse_s), O = sum_s exp(lse_s - lse) O_s
// (FA2's combine; splits with lse_s = -inf, which saw no key, weigh 0; no key at all: O = 0,
// lse = -inf).
template <typename T>
__global__ void flashcute_kvcache_combine_kernel(const FwdParams p) {
  constexpr int kWarps = 4;
  const int64_t rows = int64_t(p.batch) * p.nheads * p.seqlen_q;
  const int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const float* lse_s = p.lse_accum + row;  // split s at lse_s[s * rows]
  float m = -INFINITY;
  for (int s = lane; s < p.num_splits; s += 32) m = fmaxf(m, lse_s[s * rows]);
  for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float sum = 0.f;
  if (m != -INFINITY) {
    for (int s = lane; s < p.num_splits; s += 32) sum += expf(lse_s[s * rows] - m);
  }
  for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, o);
  const float lse = sum > 0.f ? m + logf(sum) : -INFINITY;
  if (lane == 0) p.lse[row] = lse;  // lse (batch, nheads, seqlen_q) is row-major like the partials

  const int i = row % p.seqlen_q, h = (row / p.seqlen_q) % p.nheads, b = row / p.seqlen_q / p.nheads;
  T* out = static_cast<T*>(p.o) + b * p.o_stride.batch + i * p.o_stride.row + h * p.o_stride.head;
  for (int c = lane * 4; c < p.headdim; c += 128) {
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s = 0; s < p.num_splits && lse != -INFINITY; ++s) {
      const float w = expf(lse_s[s * rows] - lse);
      if (w == 0.f) continue;
      const float4 o = *reinterpret_cast<const float4*>(p.o_accum + (s * rows + row) * p.headdim + c);
      acc.x += w * o.x;
      acc.y += w * o.y;
      acc.z += w * o.z;
      acc.w += w * o.w;
    }
    out[c] = from_float<T>(acc.x);
    out[c + 1] = from_float<T>(acc.y);
    out[c + 2] = from_float<T>(acc.z);
    out[c + 3] = from_float<T>(acc.w);
  }
}

}  // namespace

void run_kvcache_append(const KvAppend& a, cudaStream_t stream) {
  const int64_t total = a.batch * a.seqlen_new * a.heads * a.headdim;
  if (total == 0) return;
  const int64_t blocks = std::min<int64_t>((total + 255) / 256, 65535);
  launch_kernel(&flashcute_kvcache_append_kernel, dim3(blocks), 256, 0, stream, a);
}

void run_kvcache_combine(const FwdParams& params, bool bf16, cudaStream_t stream) {
  const int64_t rows = int64_t(params.batch) * params.nheads * params.seqlen_q;
  const dim3 grid((rows + 3) / 4);
  if (bf16) {
    launch_kernel(&flashcute_kvcache_combine_kernel<__nv_bfloat16>, grid, 128, 0, stream, params);
  } else {
    launch_kernel(&flashcute_kvcache_combine_kernel<__half>, grid, 128, 0, stream, params);
  }
}

}  // namespace flashcute
