// flashcute — the CPU backend: FlashAttention-2 (Dao 2023) written out in plain C++.
//
// The same algorithm as the CUDA kernels, one tile at a time, float32 accumulation:
//   forward  = Algorithm 1: Q tiles x K/V tiles, online softmax in base 2, one final rescale
//              of O, LSE kept;
//   backward = Algorithm 2: P recomputed from LSE, D = rowsum(dO * O),
//              dV += P^T dO, dP = dO V^T, dS = P * (dP - D), dK += dS^T Q, dQ += dS K;
//   dropout  = the kernels' keep mask (common/dropout.h): O += P keep V / (1 - p) (l counts every
//              score), dV += (P keep / (1 - p))^T dO, dS = P * (keep dP / (1 - p) - D).
// Which keys a row sees comes from common/mask_rules.h and the sequence bounds from
// common/seqlen.h, the same code the CUDA kernels run, so the backends cannot disagree. It is
// the reference implementation of the algorithm that CI can run, and the backend of machines
// without a GPU.
#include "backends.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "flashcute/common/dropout.h"
#include "flashcute/common/kvcache.h"
#include "flashcute/common/mask_rules.h"
#include "flashcute/common/seqlen.h"

namespace flashcute {
namespace {

constexpr int kBlockM = 64;  // query rows per tile
constexpr int kBlockN = 64;  // key rows per tile
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row r (of the packed or padded tensor) of head h of sequence b.
template <typename T>
inline const T* row_ptr(const void* base, const Strides& s, int b, int64_t r, int h) {
  return static_cast<const T*>(base) + b * s.batch + r * s.row + h * s.head;
}
template <typename T>
inline T* row_ptr(void* base, const Strides& s, int b, int64_t r, int h) {
  return static_cast<T*>(base) + b * s.batch + r * s.row + h * s.head;
}

// Copies rows [r0, r1) into a dense float tile of `d` columns; row_offset(r): the element offset
// of row r in base.
template <typename T, typename RowOffset>
void load_rows(float* dst, const void* base, int r0, int r1, int d, RowOffset&& row_offset) {
  for (int r = r0; r < r1; ++r) {
    const T* src = static_cast<const T*>(base) + row_offset(r);
    float* out = dst + (r - r0) * d;
    for (int c = 0; c < d; ++c) out[c] = static_cast<float>(src[c]);
  }
}

// Rows [r0, r1) (of the sequence starting at row `offset`) of head h.
template <typename T>
void load_tile(float* dst, const void* base, const Strides& s, int b, int offset, int h, int r0, int r1, int d) {
  load_rows<T>(dst, base, r0, r1, d, [&](int r) { return b * s.batch + (int64_t(offset) + r) * s.row + h * s.head; });
}

// Rows [r0, r1) of a KV cache's sequence b and kv head h: contiguous, or through the page table
// (common/kvcache.h, the rule the CUDA kernels use).
template <typename T>
void load_cache_tile(float* dst, const void* base, const Strides& s, const FwdParams& p, int b, int h, int r0, int r1,
                     int d) {
  const KvCacheRows cache{p, b, 0, h};
  load_rows<T>(dst, base, r0, r1, d, [&](int r) { return cache.kv_row(s, r); });
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

// The score of (row i, key j) of one (sequence, head), SPEC score pipeline steps 1-3, in
// natural-log units: z = scale q.k; softcap c: z = c tanh(z / c); ALiBi: z -= slope |p_i - j|.
// t_out (softcap only): tanh(scale q.k / c), for the backward's 1 - t^2.
struct Scores {
  const FwdParams& p;
  float slope;  // ALiBi slope of this (sequence, head); 0: off
  int diag_offset;
  float operator()(float qk, int i, int j, float* t_out = nullptr) const {
    float z = p.scale * qk;
    if (p.softcap > 0.f) {
      const float t = std::tanh(z / p.softcap);
      if (t_out) *t_out = t;
      z = p.softcap * t;
    }
    if (slope != 0.f) z -= slope * std::abs(float(i + diag_offset - j));
    return z;
  }
  static Scores of(const FwdParams& p, const SeqlenInfo& s, int b, int h) {
    const float slope = p.alibi_slopes ? p.alibi_slopes[b * p.alibi_batch_stride + h] : 0.f;
    return Scores{p, slope, s.k - s.q};
  }
};

// Dropout's keep mask of one (sequence, head); every score kept without dropout.
struct Keep {
  const FwdParams& p;
  DropoutMap map;
  Keep(const FwdParams& p_, int b, int h) : p(p_), map(p_, b, h) {}
  bool operator()(int i, int j) const { return !p.has_dropout() || map.keep(i, j); }
};

MaskRules rules_of(const FwdParams& p, const SeqlenInfo& s) {
  return MaskRules{s.q, s.k, p.window_left, p.window_right};
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
      const SeqlenInfo seq = SeqlenInfo::with_cache(p, b);  // the forward serves KV-cache calls too
      const int m0 = m_block * kBlockM;
      if (m0 >= seq.q) continue;
      const int m1 = std::min(seq.q, m0 + kBlockM);
      const int rows = m1 - m0;
      const int h_kv = h / p.h_per_kv();
      const MaskRules rules = rules_of(p, seq);
      const Scores score = Scores::of(p, seq, b, h);
      const Keep keep(p, b, h);

      load_tile<T>(q_tile.data(), p.q, p.q_stride, b, seq.q_offset, h, m0, m1, d);
      std::fill(acc_o.begin(), acc_o.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), kNegInf);
      std::fill(row_sum.begin(), row_sum.end(), 0.f);

      // Tile ranges: key tiles outside every row's key range are never read.
      const int n_begin = rules.col_begin(m0) / kBlockN * kBlockN;
      const int n_end = rules.col_end(m1 - 1);
      for (int n0 = n_begin; n0 < n_end; n0 += kBlockN) {
        const int n1 = std::min(n_end, n0 + kBlockN);
        if (p.block_table != nullptr) {
          load_cache_tile<T>(k_tile.data(), p.k, p.k_stride, p, b, h_kv, n0, n1, d);
          load_cache_tile<T>(v_tile.data(), p.v, p.v_stride, p, b, h_kv, n0, n1, d);
        } else {
          load_tile<T>(k_tile.data(), p.k, p.k_stride, b, seq.k_offset, h_kv, n0, n1, d);
          load_tile<T>(v_tile.data(), p.v, p.v_stride, b, seq.k_offset, h_kv, n0, n1, d);
        }

        for (int r = 0; r < rows; ++r) {
          const int i = m0 + r;
          float* s_row = s.data() + r * kBlockN;
          const int c0 = std::max(rules.col_begin(i), n0) - n0;  // mask (window, sequence bounds)
          const int c1 = std::min(rules.col_end(i), n1) - n0;
          const uint8_t* keys = sparse.keys(b, h, i);  // mask (block-sparse)
          // Scores in units of log2; -inf where masked.
          float m_new = row_max[r];
          for (int c = c0; c < c1; ++c) {
            const int j = n0 + c;
            s_row[c] = sparse.kept(keys, j) ? kLog2e * score(dot(&q_tile[r * d], &k_tile[c * d], d), i, j) : kNegInf;
            m_new = std::max(m_new, s_row[c]);
          }
          if (m_new == kNegInf) continue;  // no visible key yet for this row
          // Online softmax: rescale what was accumulated under the old max.
          const float rescale = std::exp2(row_max[r] - m_new);
          row_max[r] = m_new;
          row_sum[r] *= rescale;
          float* o_row = &acc_o[r * d];
          for (int c = 0; c < d; ++c) o_row[c] *= rescale;
          // P = exp2(S - m); l += rowsum(P); O += P keep V
          for (int c = c0; c < c1; ++c) {
            if (s_row[c] == kNegInf) continue;
            const float pc = std::exp2(s_row[c] - m_new);
            row_sum[r] += pc;
            if (keep(i, n0 + c)) axpy(o_row, pc, &v_tile[c * d], d);
          }
        }
      }

      // Epilogue: O *= 1 / (l (1 - p)) once; LSE = m * ln 2 + ln l. Rows with no key: O = 0, LSE = -inf.
      float* lse = p.lse + seq.lse_offset(p, b, h);
      for (int r = 0; r < rows; ++r) {
        const float l = row_sum[r];
        const float inv = l > 0.f ? p.dropout_scale / l : 0.f;
        T* out = row_ptr<T>(p.o, p.o_stride, b, int64_t(seq.q_offset) + m0 + r, h);
        for (int c = 0; c < d; ++c) out[c] = static_cast<T>(acc_o[r * d + c] * inv);
        lse[m0 + r] = l > 0.f ? row_max[r] * kLn2 + std::log(l) : kNegInf;
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
  // D has lse's layout.
  at::parallel_for(0, int64_t(p.batch) * p.nheads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int b = bh / p.nheads, h = bh % p.nheads;
      const SeqlenInfo seq(p, b);
      const int64_t base = seq.lse_offset(p, b, h);
      for (int i = 0; i < seq.q; ++i) {
        const T* o = row_ptr<T>(p.o, p.o_stride, b, int64_t(seq.q_offset) + i, h);
        const T* g = row_ptr<T>(p.dout, p.do_stride, b, int64_t(seq.q_offset) + i, h);
        float acc = 0.f;
        for (int c = 0; c < d; ++c) acc += static_cast<float>(o[c]) * static_cast<float>(g[c]);
        p.dsum[base + i] = acc - (p.dlse ? p.dlse[base + i] : 0.f);
      }
    }
  });

  // Main loop, parallel over (sequence, kv head): each task owns dK/dV of its kv head and
  // dQ of the query heads of its group, so no two tasks write the same memory and the
  // result does not depend on the thread count.
  at::parallel_for(0, int64_t(p.batch) * p.nheads_kv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> k_tile(kBlockN * d), v_tile(kBlockN * d);
    std::vector<float> q_tile(kBlockM * d), do_tile(kBlockM * d);
    std::vector<float> dk, dv, dq;
    std::vector<float> pj(kBlockN), dsj(kBlockN);
    SparseRow sparse(p.sparse);

    for (int64_t task = begin; task < end; ++task) {
      const int b = task / p.nheads_kv, h_kv = task % p.nheads_kv;
      const SeqlenInfo seq(p, b);
      const MaskRules rules = rules_of(p, seq);
      dk.assign(size_t(seq.k) * d, 0.f);
      dv.assign(size_t(seq.k) * d, 0.f);

      for (int h = h_kv * hpk; h < (h_kv + 1) * hpk; ++h) {
        dq.assign(size_t(seq.q) * d, 0.f);
        const float* lse = p.lse + seq.lse_offset(p, b, h);
        const float* dsum = p.dsum + seq.lse_offset(p, b, h);
        const Scores score = Scores::of(p, seq, b, h);
        const Keep keep(p, b, h);

        for (int n0 = 0; n0 < seq.k; n0 += kBlockN) {  // parallel axis of Algorithm 2
          const int n1 = std::min(seq.k, n0 + kBlockN);
          load_tile<T>(k_tile.data(), p.k, p.k_stride, b, seq.k_offset, h_kv, n0, n1, d);
          load_tile<T>(v_tile.data(), p.v, p.v_stride, b, seq.k_offset, h_kv, n0, n1, d);

          // Row ranges: query rows that see none of this tile are skipped.
          const int m_begin = rules.row_begin(n0), m_end = rules.row_end(n1 - 1);
          for (int m0 = m_begin / kBlockM * kBlockM; m0 < m_end; m0 += kBlockM) {
            const int m1 = std::min(m_end, m0 + kBlockM);
            load_tile<T>(q_tile.data(), p.q, p.q_stride, b, seq.q_offset, h, m0, m1, d);
            load_tile<T>(do_tile.data(), p.dout, p.do_stride, b, seq.q_offset, h, m0, m1, d);

            for (int r = 0; r < m1 - m0; ++r) {
              const int i = m0 + r;
              const int c0 = std::max(rules.col_begin(i), n0) - n0;
              const int c1 = std::min(rules.col_end(i), n1) - n0;
              if (c1 <= c0 || lse[i] == kNegInf) continue;
              const float* qi = &q_tile[r * d];
              const float* doi = &do_tile[r * d];
              const float lse_log2 = lse[i] * kLog2e;
              const uint8_t* keys = sparse.keys(b, h, i);
              for (int c = c0; c < c1; ++c) {
                if (!sparse.kept(keys, n0 + c)) continue;  // outside the listed blocks: P = 0
                // P = exp(z - L), recomputed from the saved LSE
                float t = 0.f;
                const float z = score(dot(qi, &k_tile[c * d], d), i, n0 + c, &t);
                const float pij = std::exp2(z * kLog2e - lse_log2);
                // dP = dO V^T; dS = P * (keep dP / (1 - p) - D), times the softcap's 1 - t^2
                const bool kept = keep(i, n0 + c);
                pj[c] = kept ? pij * p.dropout_scale : 0.f;  // P keep / (1 - p), for dV
                dsj[c] = pij * ((kept ? dot(doi, &v_tile[c * d], d) * p.dropout_scale : 0.f) - dsum[i]);
                if (p.softcap > 0.f) dsj[c] *= 1.f - t * t;
              }
              float* dqi = &dq[size_t(i) * d];
              for (int c = c0; c < c1; ++c) {
                if (!sparse.kept(keys, n0 + c)) continue;
                axpy(&dv[size_t(n0 + c) * d], pj[c], doi, d);              // dV += P^T dO
                axpy(&dk[size_t(n0 + c) * d], p.scale * dsj[c], qi, d);    // dK += dS^T Q
                axpy(dqi, p.scale * dsj[c], &k_tile[c * d], d);            // dQ += dS K
              }
            }
          }
        }
        for (int i = 0; i < seq.q; ++i) {
          T* out = row_ptr<T>(p.dq, p.dq_stride, b, int64_t(seq.q_offset) + i, h);
          for (int c = 0; c < d; ++c) out[c] = static_cast<T>(dq[size_t(i) * d + c]);
        }
      }
      for (int j = 0; j < seq.k; ++j) {
        T* out_k = row_ptr<T>(p.dk, p.dk_stride, b, int64_t(seq.k_offset) + j, h_kv);
        T* out_v = row_ptr<T>(p.dv, p.dv_stride, b, int64_t(seq.k_offset) + j, h_kv);
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
