// flashcute — the CPU backend: FlashAttention-2 (Dao 2023) written out in plain C++.
//
// The same algorithm as the CUDA kernels, one tile at a time, float32 accumulation:
//   forward  = Algorithm 1: Q tiles x K/V tiles, online softmax in base 2 with the
//              scale folded into scale_log2, one final rescale of O, LSE kept;
//   backward = Algorithm 2: P recomputed from LSE, D = rowsum(dO * O),
//              dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dK += dS^T Q, dQ += dS K.
// It is the reference implementation of the algorithm that CI can run, and the
// backend of machines without a GPU.
#include "backends.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace flashcute {
namespace {

constexpr int kBlockM = 64;  // query rows per tile
constexpr int kBlockN = 64;  // key rows per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <typename T>
inline const T* row_ptr(const void* base, const Strides& s, int b, int i, int h) {
  return static_cast<const T*>(base) + b * s.batch + i * s.row + h * s.head;
}
template <typename T>
inline T* row_ptr(void* base, const Strides& s, int b, int i, int h) {
  return static_cast<T*>(base) + b * s.batch + i * s.row + h * s.head;
}

// Copies rows [r0, r1) of head h into a dense float tile of `d` columns.
template <typename T>
void load_tile(float* dst, const void* base, const Strides& s, int b, int h, int r0, int r1, int d) {
  for (int r = r0; r < r1; ++r) {
    const T* src = row_ptr<T>(base, s, b, r, h);
    float* out = dst + (r - r0) * d;
    for (int c = 0; c < d; ++c) out[c] = static_cast<float>(src[c]);
  }
}

inline float dot(const float* a, const float* b, int d) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int c = 0; c < d; ++c) acc += a[c] * b[c];
  return acc;
}

inline void axpy(float* y, float a, const float* x, int d) {
  for (int c = 0; c < d; ++c) y[c] += a * x[c];
}

// Block-sparse masks: which key blocks one query block attends, as a byte per key block,
// rebuilt only when the (b, h, query block) changes. keys() is nullptr for dense attention.
class SparseRow {
 public:
  explicit SparseRow(const BlockSparse& s) : s_(s), map_(s.enabled() ? s.num_kv_blocks : 0) {}
  // The key-block map of query row i of (b, h).
  const uint8_t* keys(int b, int h, int i) {
    if (!s_.enabled()) return nullptr;
    const int64_t r = s_.row(b, h) * s_.num_q_blocks + i / s_.block_m;
    if (r != cached_) {
      cached_ = r;
      std::fill(map_.begin(), map_.end(), 0);
      const int num = std::min(std::max(s_.kv_num[r], 0), s_.num_kv_blocks);
      for (int e = 0; e < num; ++e) {
        const int j = s_.kv_idx[r * s_.num_kv_blocks + e];
        if (j >= 0 && j < s_.num_kv_blocks) map_[j] = 1;
      }
    }
    return map_.data();
  }
  // Is key column c kept by the map?
  bool kept(const uint8_t* keys, int c) const { return keys == nullptr || keys[c / s_.block_n] != 0; }

 private:
  const BlockSparse& s_;
  std::vector<uint8_t> map_;
  int64_t cached_ = -1;
};

// Causal, bottom-right aligned: query i sees keys j <= i + (sk - sq).
// The last key (exclusive) that query row i sees.
inline int key_end(const FwdParams& p, int i) {
  if (!p.causal) return p.seqlen_k;
  return std::max(0, std::min(p.seqlen_k, i + p.seqlen_k - p.seqlen_q + 1));
}

template <typename T>
void fwd_impl(const FwdParams& p) {
  const int d = p.headdim;
  const int num_m_blocks = (p.seqlen_q + kBlockM - 1) / kBlockM;
  const int64_t total = int64_t(p.batch) * p.nheads * num_m_blocks;

  at::parallel_for(0, total, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q_tile(kBlockM * d), k_tile(kBlockN * d), v_tile(kBlockN * d);
    std::vector<float> acc_o(kBlockM * d), s(kBlockM * kBlockN);
    std::vector<float> row_max(kBlockM), row_sum(kBlockM);
    SparseRow sparse(p.sparse);

    for (int64_t task = begin; task < end; ++task) {
      const int m_block = task % num_m_blocks;
      const int h = (task / num_m_blocks) % p.nheads;
      const int b = task / (int64_t(num_m_blocks) * p.nheads);
      const int h_kv = h / p.h_per_kv();
      const int m0 = m_block * kBlockM;
      const int m1 = std::min(p.seqlen_q, m0 + kBlockM);
      const int rows = m1 - m0;

      load_tile<T>(q_tile.data(), p.q, p.q_stride, b, h, m0, m1, d);
      std::fill(acc_o.begin(), acc_o.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);

      // Causal block skipping: key blocks past the last row's diagonal are never read.
      const int n_end = key_end(p, m1 - 1);
      for (int n0 = 0; n0 < n_end; n0 += kBlockN) {
        const int n1 = std::min(n_end, n0 + kBlockN);
        const int cols = n1 - n0;
        load_tile<T>(k_tile.data(), p.k, p.k_stride, b, h_kv, n0, n1, d);
        load_tile<T>(v_tile.data(), p.v, p.v_stride, b, h_kv, n0, n1, d);

        for (int r = 0; r < rows; ++r) {
          float* s_row = s.data() + r * kBlockN;
          const int visible = std::min(cols, key_end(p, m0 + r) - n0);  // mask (diagonal blocks)
          const uint8_t* keys = sparse.keys(b, h, m0 + r);               // mask (block-sparse)
          // S = Q K^T, in units of log2: scale_log2 * q.k; -inf where masked
          float m_new = row_max[r];
          for (int c = 0; c < visible; ++c) {
            s_row[c] = sparse.kept(keys, n0 + c) ? p.scale_log2 * dot(&q_tile[r * d], &k_tile[c * d], d) : kNegInf;
            m_new = std::max(m_new, s_row[c]);
          }
          if (m_new == kNegInf) continue;  // no visible key yet for this row
          // Online softmax: rescale what was accumulated under the old max.
          const float rescale = std::exp2(row_max[r] - m_new);
          row_max[r] = m_new;
          row_sum[r] *= rescale;
          float* o_row = &acc_o[r * d];
          for (int c = 0; c < d; ++c) o_row[c] *= rescale;
          // P = exp2(S - m); l += rowsum(P); O += P V
          for (int c = 0; c < visible; ++c) {
            if (s_row[c] == kNegInf) continue;
            const float pc = std::exp2(s_row[c] - m_new);
            row_sum[r] += pc;
            axpy(o_row, pc, &v_tile[c * d], d);
          }
        }
      }

      // Epilogue: O /= l once; LSE = m * ln 2 + ln l. Rows with no key: O = 0, LSE = -inf.
      for (int r = 0; r < rows; ++r) {
        const float l = row_sum[r];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        T* out = row_ptr<T>(p.o, p.o_stride, b, m0 + r, h);
        for (int c = 0; c < d; ++c) out[c] = static_cast<T>(acc_o[r * d + c] * inv);
        p.lse[(int64_t(b) * p.nheads + h) * p.seqlen_q + m0 + r] =
            l > 0.f ? row_max[r] * kLn2 + std::log(l) : kNegInf;
      }
    }
  });
}

template <typename T>
void bwd_impl(const BwdParams& p) {
  const int d = p.headdim;
  const int hpk = p.h_per_kv();

  // Preprocess: D = rowsum(dO * O), minus dLSE when the LSE output has a gradient
  // (d lse_i / d s_ij = P_ij, so it enters dS = P * (dP - D) with the opposite sign).
  at::parallel_for(0, int64_t(p.batch) * p.nheads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int b = bh / p.nheads, h = bh % p.nheads;
      for (int i = 0; i < p.seqlen_q; ++i) {
        const T* o = row_ptr<T>(p.o, p.o_stride, b, i, h);
        const T* g = row_ptr<T>(p.dout, p.do_stride, b, i, h);
        float acc = 0.f;
        for (int c = 0; c < d; ++c) acc += static_cast<float>(o[c]) * static_cast<float>(g[c]);
        const int64_t idx = bh * p.seqlen_q + i;
        p.dsum[idx] = acc - (p.dlse ? p.dlse[idx] : 0.f);
      }
    }
  });

  // Main loop, parallel over (batch, kv head): each task owns dK/dV of its kv head and
  // dQ of the query heads of its group, so no two tasks write the same memory and the
  // result does not depend on the thread count.
  at::parallel_for(0, int64_t(p.batch) * p.nheads_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> k_tile(kBlockN * d), v_tile(kBlockN * d);
    std::vector<float> q_tile(kBlockM * d), do_tile(kBlockM * d);
    std::vector<float> dk(size_t(p.seqlen_k) * d), dv(size_t(p.seqlen_k) * d);
    std::vector<float> dq(size_t(p.seqlen_q) * d);
    std::vector<float> pj(kBlockN), dsj(kBlockN);
    SparseRow sparse(p.sparse);

    for (int64_t task = begin; task < end; ++task) {
      const int b = task / p.nheads_kv, h_kv = task % p.nheads_kv;
      std::fill(dk.begin(), dk.end(), 0.f);
      std::fill(dv.begin(), dv.end(), 0.f);

      for (int h = h_kv * hpk; h < (h_kv + 1) * hpk; ++h) {
        std::fill(dq.begin(), dq.end(), 0.f);
        const float* lse = p.lse + (int64_t(b) * p.nheads + h) * p.seqlen_q;
        const float* dsum = p.dsum + (int64_t(b) * p.nheads + h) * p.seqlen_q;

        for (int n0 = 0; n0 < p.seqlen_k; n0 += kBlockN) {  // parallel axis of Algorithm 2
          const int n1 = std::min(p.seqlen_k, n0 + kBlockN);
          const int cols = n1 - n0;
          load_tile<T>(k_tile.data(), p.k, p.k_stride, b, h_kv, n0, n1, d);
          load_tile<T>(v_tile.data(), p.v, p.v_stride, b, h_kv, n0, n1, d);

          // Causal skipping: query rows whose last visible key is before n0 see none of this block.
          const int m_start = p.causal ? std::max(0, n0 - (p.seqlen_k - p.seqlen_q)) : 0;
          for (int m0 = (m_start / kBlockM) * kBlockM; m0 < p.seqlen_q; m0 += kBlockM) {
            const int m1 = std::min(p.seqlen_q, m0 + kBlockM);
            load_tile<T>(q_tile.data(), p.q, p.q_stride, b, h, m0, m1, d);
            load_tile<T>(do_tile.data(), p.dout, p.do_stride, b, h, m0, m1, d);

            for (int r = 0; r < m1 - m0; ++r) {
              const int i = m0 + r;
              const int visible = std::min(cols, key_end(p, i) - n0);
              if (visible <= 0 || lse[i] == kNegInf) continue;
              const float* qi = &q_tile[r * d];
              const float* doi = &do_tile[r * d];
              const float lse_log2 = lse[i] * kLog2e;
              const uint8_t* keys = sparse.keys(b, h, i);
              for (int c = 0; c < visible; ++c) {
                if (!sparse.kept(keys, n0 + c)) continue;  // outside the listed blocks: P = 0
                // P = exp(scale * q.k - L), recomputed from the saved LSE
                pj[c] = std::exp2(p.scale_log2 * dot(qi, &k_tile[c * d], d) - lse_log2);
                // dP = dO V^T; dS = P * (dP - D)
                dsj[c] = pj[c] * (dot(doi, &v_tile[c * d], d) - dsum[i]);
              }
              float* dqi = &dq[size_t(i) * d];
              for (int c = 0; c < visible; ++c) {
                if (!sparse.kept(keys, n0 + c)) continue;
                axpy(&dv[size_t(n0 + c) * d], pj[c], doi, d);              // dV += P^T dO
                axpy(&dk[size_t(n0 + c) * d], p.scale * dsj[c], qi, d);    // dK += dS^T Q
                axpy(dqi, p.scale * dsj[c], &k_tile[c * d], d);            // dQ += dS K
              }
            }
          }
        }
        for (int i = 0; i < p.seqlen_q; ++i) {
          T* out = row_ptr<T>(p.dq, p.dq_stride, b, i, h);
          for (int c = 0; c < d; ++c) out[c] = static_cast<T>(dq[size_t(i) * d + c]);
        }
      }
      for (int j = 0; j < p.seqlen_k; ++j) {
        T* out_k = row_ptr<T>(p.dk, p.dk_stride, b, j, h_kv);
        T* out_v = row_ptr<T>(p.dv, p.dv_stride, b, j, h_kv);
        for (int c = 0; c < d; ++c) {
          out_k[c] = static_cast<T>(dk[size_t(j) * d + c]);
          out_v[c] = static_cast<T>(dv[size_t(j) * d + c]);
        }
      }
    }
  });
}

template <template <typename> class Fn, typename P>
void dispatch_dtype(DType dtype, const P& params) {
  switch (dtype) {
    case DType::kFloat32: return Fn<float>::run(params);
    case DType::kFloat16: return Fn<c10::Half>::run(params);
    case DType::kBFloat16: return Fn<c10::BFloat16>::run(params);
  }
}
template <typename T> struct Fwd { static void run(const FwdParams& p) { fwd_impl<T>(p); } };
template <typename T> struct Bwd { static void run(const BwdParams& p) { bwd_impl<T>(p); } };

}  // namespace

void run_fwd_cpu(const FwdParams& params, DType dtype) { dispatch_dtype<Fwd>(dtype, params); }
void run_bwd_cpu(const BwdParams& params, DType dtype) { dispatch_dtype<Bwd>(dtype, params); }

}  // namespace flashcute
