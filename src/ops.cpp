// flashcute — the dispatcher ops: torch.ops.flashcute.attention and its backward.
//
// Checks the arguments once (every message names the argument, the value and what is
// allowed), fills the shared params struct, and calls the CPU or the CUDA backend.
// The autograd formulas are C++ (below: the backward runs on autograd's device thread without
// taking the GIL); the fake (meta) kernels are registered in Python (python/flashcute/_ops.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "backends.h"
#include "flashcute/common/dropout.h"

#ifdef FLASHCUTE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <nvtx3/nvtx3.hpp>
#endif

namespace flashcute {

namespace {
std::atomic<int> g_kernel_family{0};  // flashcute.kernels(): 0 auto, 80, 90
}  // namespace

int kernel_family() { return g_kernel_family.load(std::memory_order_relaxed); }

namespace {

constexpr int kMaxHeadDim = 256;

std::string shape_str(const at::Tensor& t) { return c10::str(t.sizes()); }
std::string dtype_str(at::ScalarType t) { return "torch." + c10::getDtypeNames(t).first; }

DType to_dtype(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: return DType::kFloat32;
  }
}

// Runs one stage (a kernel launch) under its name: an NVTX range for Nsight and a record for
// the torch profiler (flashcute::fwd, flashcute::bwd_preprocess, flashcute::bwd, ...).
template <typename Fn>
void run_stage(const char* name, Fn&& fn) {
#ifdef FLASHCUTE_WITH_CUDA
  nvtx3::scoped_range nvtx{name};
#endif
  RECORD_FUNCTION(name, std::vector<c10::IValue>());
  fn();
}

Strides strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// The CUDA kernels move rows in 16-byte pieces, and the sm90 family's TMA copies need positive
// strides: a tensor whose pointer or strides are not multiples of 16 bytes (rare: e.g. a view
// that starts mid-row), or that repeats rows through a zero stride (an expand()ed view), is
// copied to a contiguous one. (A default build has no sm80-family forward for sm90 GPUs to fall
// back on: cmake/instantiations.cmake.)
at::Tensor cuda_aligned(const at::Tensor& t) {
  if (!t.is_cuda()) return t;
  const int64_t align = 16 / t.element_size();
  bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  for (int i = 0; i < 3; ++i) ok = ok && t.stride(i) % align == 0 && (t.stride(i) > 0 || (i != 1 && t.size(i) <= 1));
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Checks q, k, v against the SPEC and returns nothing; every failure raises.
// Checks q, k, v (4-D: packed batches pass (1, total, heads, headdim) views) against the SPEC and
// returns nothing; every failure raises. The CUDA grids run over grid_seqlen query rows of
// grid_batch sequences (default: q's).
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* fn = "flashcute.attention",
               int64_t grid_seqlen = -1, int64_t grid_batch = -1) {
  TORCH_CHECK_VALUE(q.dim() == 4, fn, ": q must be 4-D (batch, seqlen_q, nheads, headdim), got shape ",
                    shape_str(q));
  TORCH_CHECK_VALUE(k.dim() == 4, fn, ": k must be 4-D (batch, seqlen_k, nheads_kv, headdim), got shape ",
                    shape_str(k));
  TORCH_CHECK_VALUE(v.dim() == 4, fn, ": v must be 4-D (batch, seqlen_k, nheads_kv, headdim), got shape ",
                    shape_str(v));
  TORCH_CHECK_VALUE(k.device() == q.device(), fn, ": k is on ", k.device(), " but q is on ", q.device(),
                    "; q, k and v must be on one device");
  TORCH_CHECK_VALUE(v.device() == q.device(), fn, ": v is on ", v.device(), " but q is on ", q.device(),
                    "; q, k and v must be on one device");

  const auto dt = q.scalar_type();
  if (q.is_cuda()) {
    TORCH_CHECK_TYPE(dt == at::kHalf || dt == at::kBFloat16, fn, ": q has dtype ", dt,
                     "; on CUDA q, k and v must be float16 or bfloat16");
  } else {
    TORCH_CHECK_VALUE(q.device().is_cpu(), fn, ": q is on ", q.device(),
                      "; flashcute runs on CUDA and CPU devices only");
    TORCH_CHECK_TYPE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, fn, ": q has dtype ", dt,
                     "; on CPU q, k and v must be float32, float16 or bfloat16");
  }
  TORCH_CHECK_TYPE(k.scalar_type() == dt, fn, ": k has dtype ", k.scalar_type(), " but q has ", dt,
                   "; q, k and v must share one dtype");
  TORCH_CHECK_TYPE(v.scalar_type() == dt, fn, ": v has dtype ", v.scalar_type(), " but q has ", dt,
                   "; q, k and v must share one dtype");

  const int64_t d = q.size(3);
  TORCH_CHECK_VALUE(d > 0 && d % 8 == 0 && d <= kMaxHeadDim, fn, ": headdim is ", d,
                    "; it must be a multiple of 8 between 8 and ", kMaxHeadDim);
  TORCH_CHECK_VALUE(k.size(0) == q.size(0) && v.size(0) == q.size(0), fn,
                    ": batch sizes differ: q ", shape_str(q), ", k ", shape_str(k), ", v ", shape_str(v));
  TORCH_CHECK_VALUE(k.size(3) == d && v.size(3) == d, fn, ": head dims differ: q ", shape_str(q), ", k ",
                    shape_str(k), ", v ", shape_str(v), "; all three must have headdim ", d);
  TORCH_CHECK_VALUE(v.size(1) == k.size(1) && v.size(2) == k.size(2), fn, ": k has shape ", shape_str(k),
                    " but v has ", shape_str(v), "; they must agree in seqlen_k and nheads_kv");
  TORCH_CHECK_VALUE(k.size(2) > 0 && q.size(2) % k.size(2) == 0, fn, ": nheads (", q.size(2),
                    ") must be a multiple of nheads_kv (", k.size(2), ")");
  TORCH_CHECK_VALUE(q.stride(3) == 1 || q.size(3) <= 1, fn, ": q.stride(-1) is ", q.stride(3),
                    "; the head dim must be contiguous (stride 1)");
  TORCH_CHECK_VALUE(k.stride(3) == 1, fn, ": k.stride(-1) is ", k.stride(3),
                    "; the head dim must be contiguous (stride 1)");
  TORCH_CHECK_VALUE(v.stride(3) == 1, fn, ": v.stride(-1) is ", v.stride(3),
                    "; the head dim must be contiguous (stride 1)");
  const int64_t int_max = std::numeric_limits<int>::max();
  TORCH_CHECK_VALUE(q.size(1) <= int_max && k.size(1) <= int_max, fn,
                    ": sequence lengths must fit in int32, got seqlen_q ", q.size(1), ", seqlen_k ", k.size(1));

#ifdef FLASHCUTE_WITH_CUDA
  if (q.is_cuda()) {
    const auto* prop = at::cuda::getDeviceProperties(q.get_device());
    TORCH_CHECK(prop->major >= 8, fn, ": the GPU ", prop->name, " has compute capability ", prop->major, ".",
                prop->minor, "; flashcute's kernels need sm80 or newer");
    // The kernels' 1-D grids hold up to (seqlen_q / 8 + 16) x batch x nheads CTAs (the backward's
    // preprocess: at least 8 rows per CTA), at most 2^31 - 1.
    const int64_t ctas = ((grid_seqlen >= 0 ? grid_seqlen : q.size(1)) / 8 + 16) *
                         (grid_batch >= 0 ? grid_batch : q.size(0)) * q.size(2);
    TORCH_CHECK_VALUE(ctas < (int64_t(1) << 31), fn, ": batch x nheads x seqlen_q is too large for one launch (",
                      ctas, " blocks of work; at most 2^31 - 1)");
    TORCH_CHECK(cuda_kernel_headdim(d, to_dtype(dt)) != 0, fn, ": headdim ", d, " in ", dt,
                " has no kernel in this build (built with FLASHCUTE_HEADDIMS/FLASHCUTE_DTYPES restricted); "
                "rebuild with the default options to get every head dim");
  }
#else
  TORCH_CHECK(!q.is_cuda(), fn, ": q is a CUDA tensor but this build of flashcute has only the CPU backend "
              "(no CUDA toolkit or a CPU-only torch at build time)");
#endif
}

void fill_fwd_params(FwdParams& p, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& out, const at::Tensor& lse, bool causal, double scale) {
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_stride = strides_of(q);
  p.k_stride = strides_of(k);
  p.v_stride = strides_of(v);
  p.o = out.data_ptr();
  p.o_stride = strides_of(out);
  p.lse = lse.data_ptr<float>();
  p.batch = q.size(0);
  p.seqlen_q = q.size(1);
  p.nheads = q.size(2);
  p.headdim = q.size(3);
  p.seqlen_k = k.size(1);
  p.nheads_kv = k.size(2);
  p.scale = static_cast<float>(scale);
  p.softmax_scale = p.scale;
  p.softmax_scale_log2 = static_cast<float>(scale * M_LOG2E);
  p.causal = causal;
  p.window_right = causal ? 0 : -1;
}

// ---- Block-sparse masks (SPEC: BlockSparseMask) -------------------------------------------

constexpr int kCudaBlockMultiple = 128;  // every CUDA kernel tile divides 128 x 128

// The query-major lists of a mask (for each key block, the query blocks that list it, ascending):
// q_num (Bm, Hm, NKV), q_idx (Bm, Hm, NKV, NQ), int32.
std::tuple<at::Tensor, at::Tensor> block_mask_transpose(const at::Tensor& kv_num_in, const at::Tensor& kv_idx_in) {
  const char* fn = "flashcute.block_mask_transpose";
  TORCH_CHECK_VALUE(kv_num_in.dim() == 3 && kv_idx_in.dim() == 4, fn,
                    ": kv_num_blocks must be 3-D and kv_indices 4-D, got shapes ", shape_str(kv_num_in), " and ",
                    shape_str(kv_idx_in));
  TORCH_CHECK_TYPE(kv_num_in.scalar_type() == at::kInt && kv_idx_in.scalar_type() == at::kInt, fn,
                   ": kv_num_blocks and kv_indices must be torch.int32, got ", dtype_str(kv_num_in.scalar_type()),
                   " and ", dtype_str(kv_idx_in.scalar_type()));
  TORCH_CHECK_VALUE(kv_idx_in.sizes().slice(0, 3) == kv_num_in.sizes(), fn, ": kv_indices has shape ",
                    shape_str(kv_idx_in), "; its first three dims must be kv_num_blocks' ", shape_str(kv_num_in));
  TORCH_CHECK_VALUE(kv_idx_in.device() == kv_num_in.device(), fn, ": kv_indices is on ", kv_idx_in.device(),
                    " but kv_num_blocks is on ", kv_num_in.device());
  const auto kv_num = kv_num_in.contiguous(), kv_idx = kv_idx_in.contiguous();
  const int64_t bm = kv_num.size(0), hm = kv_num.size(1), nq = kv_num.size(2), nkv = kv_idx.size(3);
  auto q_num = at::empty({bm, hm, nkv}, kv_num.options());
  auto q_idx = at::empty({bm, hm, nkv, nq}, kv_num.options());
  const int64_t rows = bm * hm;
  if (kv_num.is_cuda()) {
#ifdef FLASHCUTE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(kv_num.device());
    auto map = at::zeros({rows * nkv * nq}, kv_num.options().dtype(at::kByte));
    run_stage("flashcute::block_mask_transpose", [&] {
      run_block_mask_transpose(kv_num.data_ptr<int>(), kv_idx.data_ptr<int>(), map.data_ptr<uint8_t>(),
                               q_num.data_ptr<int>(), q_idx.data_ptr<int>(), rows, nq, nkv,
                               at::cuda::getCurrentCUDAStream().stream());
    });
#else
    TORCH_CHECK(false, fn, ": kv_num_blocks is a CUDA tensor but this build of flashcute has only the CPU backend");
#endif
  } else {
    run_stage("flashcute::block_mask_transpose", [&] {
      const int* num = kv_num.data_ptr<int>();
      const int* idx = kv_idx.data_ptr<int>();
      int* qn = q_num.data_ptr<int>();
      int* qi = q_idx.data_ptr<int>();
      std::vector<uint8_t> map(nkv * nq);
      for (int64_t r = 0; r < rows; ++r) {
        std::fill(map.begin(), map.end(), 0);
        for (int64_t i = 0; i < nq; ++i) {
          const int64_t n = std::min<int64_t>(std::max(num[r * nq + i], 0), nkv);
          for (int64_t e = 0; e < n; ++e) {
            const int j = idx[(r * nq + i) * nkv + e];
            if (j >= 0 && j < nkv) map[j * nq + i] = 1;
          }
        }
        for (int64_t j = 0; j < nkv; ++j) {
          int count = 0;
          int* dst = qi + (r * nkv + j) * nq;
          for (int64_t i = 0; i < nq; ++i) {
            if (map[j * nq + i]) dst[count++] = static_cast<int>(i);
          }
          std::fill(dst + count, dst + nq, 0);
          qn[r * nkv + j] = count;
        }
      }
    });
  }
  return {q_num, q_idx};
}

// The block-sparse arguments of a call, checked, and the contiguous tensors the params point into.
struct SparseArgs {
  at::Tensor kv_num, kv_idx, q_num, q_idx;
  BlockSparse params;  // disabled when the call is dense
};

// Checks the mask arguments against q and k (every failure names the argument). With
// need_q_lists, the query-major lists are computed when the caller did not pass them.
SparseArgs check_block_sparse(const at::Tensor& q, const at::Tensor& k, const std::optional<at::Tensor>& kv_num,
                              const std::optional<at::Tensor>& kv_idx, const std::optional<at::Tensor>& q_num,
                              const std::optional<at::Tensor>& q_idx, at::IntArrayRef block_size,
                              bool need_q_lists) {
  const char* fn = "flashcute.attention";
  SparseArgs args;
  const bool has_num = kv_num.has_value() && kv_num->defined();
  const bool has_idx = kv_idx.has_value() && kv_idx->defined();
  TORCH_CHECK_VALUE(has_num == has_idx, fn, ": kv_num_blocks and kv_indices must be given together (",
                    has_num ? "kv_indices" : "kv_num_blocks", " is missing)");
  if (!has_num) return args;

  TORCH_CHECK_VALUE(block_size.size() == 2 && block_size[0] > 0 && block_size[1] > 0, fn, ": block_size is ",
                    block_size, "; it must be two positive ints (query rows, keys)");
  if (q.is_cuda()) {
    TORCH_CHECK_VALUE(block_size[0] % kCudaBlockMultiple == 0 && block_size[1] % kCudaBlockMultiple == 0, fn,
                      ": block_size ", block_size, " cannot be served by the CUDA kernels; on CUDA both must be ",
                      "multiples of ", kCudaBlockMultiple);
  }
  auto check_list = [&](const at::Tensor& t, const char* name, int64_t dims) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, fn, ": ", name, " has dtype ", dtype_str(t.scalar_type()),
                     "; it must be torch.int32");
    TORCH_CHECK_VALUE(t.device() == q.device(), fn, ": ", name, " is on ", t.device(), " but q is on ", q.device());
    TORCH_CHECK_VALUE(t.dim() == dims, fn, ": ", name, " must be ", dims, "-D, got shape ", shape_str(t));
    TORCH_CHECK_VALUE(t.size(0) == 1 || t.size(0) == q.size(0), fn, ": ", name, " has shape ", shape_str(t),
                      "; its batch dim must be 1 or q's batch ", q.size(0));
    TORCH_CHECK_VALUE(t.size(1) == 1 || t.size(1) == q.size(2), fn, ": ", name, " has shape ", shape_str(t),
                      "; its head dim must be 1 or q's nheads ", q.size(2));
    return t.contiguous();
  };
  args.kv_num = check_list(*kv_num, "kv_num_blocks", 3);
  args.kv_idx = check_list(*kv_idx, "kv_indices", 4);
  TORCH_CHECK_VALUE(args.kv_idx.sizes().slice(0, 3) == args.kv_num.sizes(), fn, ": kv_indices has shape ",
                    shape_str(args.kv_idx), "; its first three dims must be kv_num_blocks' ",
                    shape_str(args.kv_num));
  const int64_t nq = args.kv_num.size(2), nkv = args.kv_idx.size(3);
  const int64_t need_q = (q.size(1) + block_size[0] - 1) / block_size[0];
  const int64_t need_k = (k.size(1) + block_size[1] - 1) / block_size[1];
  TORCH_CHECK_VALUE(nq >= need_q, fn, ": kv_num_blocks has ", nq, " query blocks; seqlen_q ", q.size(1),
                    " with block_size ", block_size, " needs at least ", need_q);
  TORCH_CHECK_VALUE(nkv >= need_k, fn, ": kv_indices has ", nkv, " key blocks per row; seqlen_k ", k.size(1),
                    " with block_size ", block_size, " needs at least ", need_k);
  TORCH_CHECK_VALUE(nq <= std::numeric_limits<int>::max() && nkv <= std::numeric_limits<int>::max(), fn,
                    ": the mask's block counts must fit in int32");

  const bool has_q = q_num.has_value() && q_num->defined() && q_idx.has_value() && q_idx->defined();
  if (has_q) {
    args.q_num = check_list(*q_num, "q_num_blocks", 3);
    args.q_idx = check_list(*q_idx, "q_indices", 4);
    const auto bm = args.kv_num.size(0), hm = args.kv_num.size(1);
    TORCH_CHECK_VALUE(args.q_num.sizes() == at::IntArrayRef({bm, hm, nkv}) &&
                          args.q_idx.sizes() == at::IntArrayRef({bm, hm, nkv, nq}),
                      fn, ": q_num_blocks ", shape_str(args.q_num), " and q_indices ", shape_str(args.q_idx),
                      " must be the transposed lists of kv_num_blocks ", shape_str(args.kv_num),
                      ": (", bm, ", ", hm, ", ", nkv, ") and (", bm, ", ", hm, ", ", nkv, ", ", nq, ")");
  } else if (need_q_lists) {
    std::tie(args.q_num, args.q_idx) = block_mask_transpose(args.kv_num, args.kv_idx);
  }

  BlockSparse& p = args.params;
  p.kv_num = args.kv_num.data_ptr<int>();
  p.kv_idx = args.kv_idx.data_ptr<int>();
  p.q_num = args.q_num.defined() ? args.q_num.data_ptr<int>() : nullptr;
  p.q_idx = args.q_idx.defined() ? args.q_idx.data_ptr<int>() : nullptr;
  p.mask_batch = args.kv_num.size(0);
  p.mask_heads = args.kv_num.size(1);
  p.num_q_blocks = nq;
  p.num_kv_blocks = nkv;
  p.block_m = block_size[0];
  p.block_n = block_size[1];
  return args;
}

double resolve_scale(std::optional<double> scale, int64_t headdim, const char* fn) {
  const double s = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(headdim));
  TORCH_CHECK_VALUE(std::isfinite(s), fn, ": scale is ", s, "; it must be finite");
  return s;
}

// ---- Windows, softcap, ALiBi (SPEC score pipeline) ----------------------------------------

// The score arguments of a call, checked.
struct ScoreArgs {
  int window_left = -1;
  int window_right = -1;
  double softcap = 0.0;
  at::Tensor alibi;  // float32, contiguous, (nheads,) or (batch, nheads); undefined: off
  double dropout_p = 0.0;
  at::Tensor rng_state;  // int64 (2,) contiguous (seed, offset); undefined: no dropout
};

// Dropout (SPEC step 6): p in [0, 1); with p > 0, rng_state an int64 (2,) tensor (seed, offset)
// on q's device (the Python API draws one from torch's generator when the caller gives none).
void check_dropout(ScoreArgs& a, const char* fn, const at::Tensor& q, double dropout_p,
                   const std::optional<at::Tensor>& rng_state) {
  TORCH_CHECK_VALUE(dropout_p >= 0.0 && dropout_p < 1.0, fn, ": dropout_p is ", dropout_p,
                    "; it must be in [0, 1)");
  a.dropout_p = dropout_p;
  if (dropout_p == 0.0) return;
  TORCH_CHECK_VALUE(rng_state.has_value() && rng_state->defined(), fn, ": dropout_p is ", dropout_p,
                    " but rng_state is None; give an int64 tensor (seed, offset) of shape (2,)");
  const at::Tensor& t = *rng_state;
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, fn, ": rng_state has dtype ", dtype_str(t.scalar_type()),
                   "; it must be torch.int64 (seed, offset)");
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == 2, fn, ": rng_state has shape ", shape_str(t),
                    "; it must be (2,): (seed, offset)");
  TORCH_CHECK_VALUE(t.device() == q.device(), fn, ": rng_state is on ", t.device(), " but q is on ", q.device());
  a.rng_state = t.contiguous();
}

// The score pipeline's arguments of a call (window, softcap, ALiBi, dropout), checked. batch: the
// number of sequences; max_q / max_k: the longest query and key sequences (windows that reach past
// them are unbounded).
ScoreArgs check_score_args(const char* fn, const at::Tensor& q, int64_t batch, int64_t nheads, bool causal,
                           int64_t window_left, int64_t window_right, double softcap,
                           const std::optional<at::Tensor>& alibi_slopes, int64_t max_q, int64_t max_k,
                           double dropout_p = 0.0, const std::optional<at::Tensor>& rng_state = std::nullopt) {
  ScoreArgs a;
  check_dropout(a, fn, q, dropout_p, rng_state);
  TORCH_CHECK_VALUE(window_left >= -1 && window_right >= -1, fn, ": window_size is (", window_left, ", ",
                    window_right, "); each side must be -1 (unbounded) or >= 0");
  // causal forces R = 0; a side that reaches past every key is unbounded (the same keys, and no
  // window arithmetic in the kernels).
  if (causal) window_right = 0;
  if (window_left >= max_k - 1) window_left = -1;
  if (window_right >= max_q - 1) window_right = -1;
  a.window_left = static_cast<int>(std::min<int64_t>(window_left, std::numeric_limits<int>::max()));
  a.window_right = static_cast<int>(std::min<int64_t>(window_right, std::numeric_limits<int>::max()));

  TORCH_CHECK_VALUE(std::isfinite(softcap) && softcap >= 0.0, fn, ": softcap is ", softcap,
                    "; it must be a finite number >= 0 (0 disables it)");
  a.softcap = softcap;

  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    const at::Tensor& t = *alibi_slopes;
    TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, fn, ": alibi_slopes has dtype ", dtype_str(t.scalar_type()),
                     "; it must be torch.float32");
    TORCH_CHECK_VALUE(t.device() == q.device(), fn, ": alibi_slopes is on ", t.device(), " but q is on ", q.device());
    TORCH_CHECK_VALUE((t.dim() == 1 && t.size(0) == nheads) || (t.dim() == 2 && t.size(0) == batch && t.size(1) == nheads),
                      fn, ": alibi_slopes has shape ", shape_str(t), "; it must be (nheads,) = (", nheads,
                      ",) or (batch, nheads) = (", batch, ", ", nheads, ")");
    TORCH_CHECK_VALUE(!t.requires_grad(), fn,
                      ": alibi_slopes requires grad; the slopes are not differentiable (pass slopes.detach())");
    a.alibi = t.contiguous();
  }
  return a;
}

void fill_score_params(FwdParams& p, const ScoreArgs& a) {
  p.window_left = a.window_left;
  p.window_right = a.window_right;
  if (a.softcap > 0.0) {
    // z = c tanh(scale q.k / c) in natural-log units: the softmax multiplies by 1 (log2 e in exp2).
    p.softcap = static_cast<float>(a.softcap);
    p.softmax_scale = 1.f;
    p.softmax_scale_log2 = static_cast<float>(M_LOG2E);
  }
  if (a.alibi.defined()) {
    p.alibi_slopes = a.alibi.data_ptr<float>();
    p.alibi_batch_stride = a.alibi.dim() == 2 ? a.alibi.size(1) : 0;
    p.alibi_scale = a.softcap > 0.0 ? 1.f : static_cast<float>(1.0 / p.scale);
  }
  if (a.rng_state.defined()) {
    p.rng_state = a.rng_state.data_ptr<int64_t>();
    p.dropout_threshold = dropout_threshold(a.dropout_p);
    p.dropout_scale = static_cast<float>(1.0 / (1.0 - a.dropout_p));
    p.dropout_keep = static_cast<float>(1.0 - a.dropout_p);
  }
}

// flashcute.dropout_mask: the keep mask (batch, nheads, seqlen_q, seqlen_k) of rng_state's device
// that a call with these arguments applies (common/dropout.h).
at::Tensor dropout_mask(const at::Tensor& rng_state, int64_t batch, int64_t nheads, int64_t seqlen_q,
                        int64_t seqlen_k, double dropout_p) {
  const char* fn = "flashcute.dropout_mask";
  TORCH_CHECK_VALUE(batch >= 0 && nheads >= 0 && seqlen_q >= 0 && seqlen_k >= 0, fn, ": batch ", batch, ", nheads ",
                    nheads, ", seqlen_q ", seqlen_q, ", seqlen_k ", seqlen_k, " must all be >= 0");
  const int64_t int_max = std::numeric_limits<int>::max();
  TORCH_CHECK_VALUE(seqlen_q <= int_max && seqlen_k <= int_max, fn, ": seqlen_q ", seqlen_q, " and seqlen_k ",
                    seqlen_k, " must fit in int32");
  ScoreArgs a;
  check_dropout(a, fn, rng_state, dropout_p, rng_state);
  auto keep = at::empty({batch, nheads, seqlen_q, seqlen_k}, rng_state.options().dtype(at::kBool));
  if (dropout_p == 0.0) return keep.fill_(true);
  const uint32_t threshold = dropout_threshold(dropout_p);
  if (keep.numel() == 0) return keep;
  if (rng_state.is_cuda()) {
#ifdef FLASHCUTE_WITH_CUDA
    TORCH_CHECK_VALUE(keep.numel() / 256 < int_max, fn, ": the mask has ", keep.numel(), " elements; at most 2^39");
    const c10::cuda::CUDAGuard guard(rng_state.device());
    run_dropout_mask(keep.data_ptr<bool>(), a.rng_state.data_ptr<int64_t>(), batch, nheads, seqlen_q, seqlen_k,
                     threshold, at::cuda::getCurrentCUDAStream().stream());
#else
    TORCH_CHECK(false, fn, ": rng_state is a CUDA tensor but this build of flashcute has only the CPU backend");
#endif
  } else {
    const int64_t* st = a.rng_state.data_ptr<int64_t>();
    bool* out = keep.data_ptr<bool>();
    at::parallel_for(0, batch * nheads * seqlen_q, 1, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const DropoutMap map{uint64_t(st[0]), uint64_t(st[1]), row / seqlen_q, threshold};
        for (int64_t j = 0; j < seqlen_k; ++j) out[row * seqlen_k + j] = map.keep(int(row % seqlen_q), int(j));
      }
    });
  }
  return keep;
}

// ---- Packed variable-length batches ------------------------------------------------------

struct VarlenArgs {
  at::Tensor cu_q, cu_k;  // int32, contiguous
  int64_t num_seqs = 0;
};

VarlenArgs check_varlen(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& cu_q,
                        const at::Tensor& cu_k, int64_t max_q, int64_t max_k) {
  VarlenArgs a;
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{cu_q, "cu_seqlens_q"},
                                std::pair<const at::Tensor&, const char*>{cu_k, "cu_seqlens_k"}}) {
    TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, fn, ": ", name, " has dtype ", dtype_str(t.scalar_type()),
                     "; it must be torch.int32");
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) >= 1, fn, ": ", name, " has shape ", shape_str(t),
                      "; it must be 1-D (num_sequences + 1,)");
    TORCH_CHECK_VALUE(t.device() == q.device(), fn, ": ", name, " is on ", t.device(), " but q is on ", q.device());
  }
  TORCH_CHECK_VALUE(cu_q.size(0) == cu_k.size(0), fn, ": cu_seqlens_q has ", cu_q.size(0), " entries and cu_seqlens_k ",
                    cu_k.size(0), "; both must be num_sequences + 1");
  const int64_t int_max = std::numeric_limits<int>::max();
  TORCH_CHECK_VALUE(max_q >= 0 && max_k >= 0 && max_q <= int_max && max_k <= int_max, fn, ": max_seqlen_q ", max_q,
                    " and max_seqlen_k ", max_k, " must be ints in [0, 2^31 - 1]");
  a.cu_q = cu_q.contiguous();
  a.cu_k = cu_k.contiguous();
  a.num_seqs = cu_q.size(0) - 1;
  if (q.is_cpu()) {
    // The values are on the host: check them (on CUDA the kernels clamp them, never reading or
    // writing outside the tensors, and checking would cost a device sync per call).
    for (const auto& [t, name, total, max_len] :
         {std::tuple<const at::Tensor&, const char*, int64_t, int64_t>{a.cu_q, "cu_seqlens_q", q.size(1), max_q},
          std::tuple<const at::Tensor&, const char*, int64_t, int64_t>{a.cu_k, "cu_seqlens_k", k.size(1), max_k}}) {
      const int* c = t.data_ptr<int>();
      TORCH_CHECK_VALUE(c[0] == 0, fn, ": ", name, "[0] is ", c[0], "; it must be 0");
      for (int64_t i = 0; i < a.num_seqs; ++i) {
        TORCH_CHECK_VALUE(c[i + 1] >= c[i], fn, ": ", name, " decreases at entry ", i + 1, " (", c[i], " -> ",
                          c[i + 1], "); it must be nondecreasing");
        TORCH_CHECK_VALUE(c[i + 1] - c[i] <= max_len, fn, ": sequence ", i, " has ", c[i + 1] - c[i], " rows (",
                          name, "), more than max_seqlen ", max_len);
      }
      TORCH_CHECK_VALUE(c[a.num_seqs] <= total, fn, ": ", name, "[-1] is ", c[a.num_seqs], " but the tensor has only ",
                        total, " rows");
    }
  }
  return a;
}

void fill_varlen_params(FwdParams& p, const VarlenArgs& a, const at::Tensor& q, const at::Tensor& k, int64_t max_q,
                        int64_t max_k) {
  p.cu_seqlens_q = a.cu_q.data_ptr<int>();
  p.cu_seqlens_k = a.cu_k.data_ptr<int>();
  p.total_q = q.size(1);
  p.total_k = k.size(1);
  p.batch = a.num_seqs;
  p.seqlen_q = max_q;
  p.seqlen_k = max_k;
  for (Strides* s : {&p.q_stride, &p.k_stride, &p.v_stride, &p.o_stride}) s->batch = 0;
}

// Rows of a packed (total, heads, headdim) tensor outside every sequence ([cu[0], cu[n])): zero
// (out and the gradients), and lse (heads, total) = -inf there.
void clear_outside_sequences(const at::Tensor& t, const at::Tensor& cu, const at::Tensor& lse) {
  if (t.is_cuda()) {
#ifdef FLASHCUTE_WITH_CUDA
    run_varlen_clear(t.data_ptr(), t.stride(0), t.stride(1), t.element_size(), t.size(0), t.size(1), t.size(2),
                     cu.data_ptr<int>(), cu.size(0) - 1, lse.defined() ? lse.data_ptr<float>() : nullptr,
                     at::cuda::getCurrentCUDAStream().stream());
#endif
    return;
  }
  const int* c = cu.data_ptr<int>();
  const int64_t n = cu.size(0) - 1, begin = std::max(0, c[0]), end = std::max<int64_t>(begin, c[n]);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (begin > 0) {
    t.narrow(0, 0, std::min(begin, t.size(0))).zero_();
    if (lse.defined()) lse.narrow(1, 0, std::min(begin, t.size(0))).fill_(neg_inf);
  }
  if (end < t.size(0)) {
    t.narrow(0, end, t.size(0) - end).zero_();
    if (lse.defined()) lse.narrow(1, end, t.size(0) - end).fill_(neg_inf);
  }
}

// ---- Running the forward and the backward ------------------------------------------------

void launch_forward(const FwdParams& p, const at::Tensor& q) {
  if (q.is_cuda()) {
#ifdef FLASHCUTE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    const auto* prop = at::cuda::getDeviceProperties(q.get_device());
    run_stage("flashcute::fwd", [&] {
      run_fwd_cuda(p, to_dtype(q.scalar_type()), prop->major * 10 + prop->minor, prop->multiProcessorCount,
                   at::cuda::getCurrentCUDAStream().stream());
    });
#endif
  } else {
    run_stage("flashcute::fwd", [&] { run_fwd_cpu(p, to_dtype(q.scalar_type())); });
  }
}

// The backward of p (inputs, out, lse, dout and gradients filled in): the three CUDA stages with
// their workspace, or the CPU backend.
void launch_backward(BwdParams& p, const at::Tensor& q, const at::Tensor& lse) {
  if (q.is_cuda()) {
#ifdef FLASHCUTE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    const auto dtype = to_dtype(q.scalar_type());
    const auto* prop = at::cuda::getDeviceProperties(q.get_device());
    p.num_sms = prop->multiProcessorCount;
    const BwdWorkspace ws = bwd_workspace_cuda(p, dtype, prop->major * 10 + prop->minor, p.num_sms);
    // D and L for whole query blocks, the dQ accumulator, then the tile counter (4 floats, so
    // that the allocation stays a whole number of 16-byte vectors): one allocation.
    const int64_t rows = ws.rows_numel(p);
    auto workspace = at::empty({2 * rows + ws.numel(p) + 4}, q.options().dtype(at::kFloat));
    p.dsum = workspace.data_ptr<float>();
    p.lse_log2 = p.dsum + rows;
    p.dq_accum = p.lse_log2 + rows;
    p.tile_counter = reinterpret_cast<int*>(p.dq_accum + ws.numel(p));
    void* stream = at::cuda::getCurrentCUDAStream().stream();
    run_stage("flashcute::bwd_preprocess", [&] { run_bwd_stage_cuda(BwdStage::kPreprocess, p, ws, dtype, stream); });
    run_stage("flashcute::bwd", [&] { run_bwd_stage_cuda(BwdStage::kMain, p, ws, dtype, stream); });
    run_stage("flashcute::bwd_convert_dq", [&] { run_bwd_stage_cuda(BwdStage::kConvertDq, p, ws, dtype, stream); });
#endif
  } else {
    auto dsum = at::empty_like(lse);  // D has lse's layout
    p.dsum = dsum.data_ptr<float>();
    run_stage("flashcute::bwd", [&] { run_bwd_cpu(p, to_dtype(q.scalar_type())); });
  }
}

// Checks the backward's extra inputs against q (4-D views) and fills them into p.
struct BwdInputs {
  at::Tensor dout, out, lse, dlse;
};
BwdInputs check_bwd_inputs(const char* fn, const at::Tensor& q, const at::Tensor& dout, const at::Tensor& out,
                           const at::Tensor& lse, const std::optional<at::Tensor>& dlse, at::IntArrayRef lse_shape) {
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), fn, ": dout ", shape_str(dout),
                    " and out ", shape_str(out), " must have q's shape ", shape_str(q));
  TORCH_CHECK_TYPE(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), fn,
                   ": dout (", dout.scalar_type(), ") and out (", out.scalar_type(), ") must have q's dtype ",
                   q.scalar_type());
  TORCH_CHECK_VALUE(dout.device() == q.device() && out.device() == q.device() && lse.device() == q.device(), fn,
                    ": dout, out and lse must be on q's device ", q.device());
  BwdInputs b;
  // The kernels read dout, out and lse through their strides; only the head dim must be unit-stride,
  // and lse / dlse are read as contiguous.
  b.dout = cuda_aligned(dout.stride(-1) == 1 ? dout : dout.contiguous());
  b.out = cuda_aligned(out.stride(-1) == 1 ? out : out.contiguous());
  b.lse = lse.to(at::kFloat).contiguous();
  TORCH_CHECK_VALUE(b.lse.sizes() == lse_shape, fn, ": lse has shape ", shape_str(lse), "; expected ", lse_shape);
  if (dlse.has_value() && dlse->defined()) {
    b.dlse = dlse->to(at::kFloat).contiguous();
    TORCH_CHECK_VALUE(b.dlse.sizes() == b.lse.sizes(), fn, ": dlse has shape ", shape_str(*dlse),
                      "; expected lse's shape ", shape_str(lse));
  }
  return b;
}

// q, k, v, dq, dk, dv, dout, out: 4-D (views); fills p's backward fields.
void fill_bwd_params(BwdParams& p, const BwdInputs& b, const at::Tensor& dout4, const at::Tensor& dq,
                     const at::Tensor& dk, const at::Tensor& dv, bool deterministic) {
  p.dout = dout4.data_ptr();
  p.do_stride = strides_of(dout4);
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_stride = strides_of(dq);
  p.dk_stride = strides_of(dk);
  p.dv_stride = strides_of(dv);
  p.dlse = b.dlse.defined() ? b.dlse.data_ptr<float>() : nullptr;
  p.deterministic = deterministic;
}

// ---- The ops ------------------------------------------------------------------------------

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q_in, const at::Tensor& k_in,
                                             const at::Tensor& v_in, bool causal, std::optional<double> scale,
                                             bool deterministic, const std::optional<at::Tensor>& kv_num_blocks,
                                             const std::optional<at::Tensor>& kv_indices,
                                             const std::optional<at::Tensor>& q_num_blocks,
                                             const std::optional<at::Tensor>& q_indices, at::IntArrayRef block_size,
                                             int64_t window_left, int64_t window_right, double softcap,
                                             const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                                             const std::optional<at::Tensor>& rng_state) {
  // deterministic and the query-major lists are used by the backward only; they are part of the
  // op so that autograd sees them.
  (void)deterministic;
  const char* fn = "flashcute.attention";
  check_qkv(q_in, k_in, v_in, fn);
  const SparseArgs sparse = check_block_sparse(q_in, k_in, kv_num_blocks, kv_indices, q_num_blocks, q_indices,
                                               block_size, /*need_q_lists=*/false);
  const ScoreArgs score = check_score_args(fn, q_in, q_in.size(0), q_in.size(2), causal, window_left, window_right,
                                           softcap, alibi_slopes, q_in.size(1), k_in.size(1), dropout_p, rng_state);
  const auto q = cuda_aligned(q_in), k = cuda_aligned(k_in), v = cuda_aligned(v_in);
  const double s = resolve_scale(scale, q.size(3), fn);
  auto out = at::empty(q.sizes(), q.options());
  auto lse = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.numel() == 0) return {out, lse};
  if (k.size(1) == 0) {  // no key at all: every row is empty
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }

  FwdParams p;
  fill_fwd_params(p, q, k, v, out, lse, causal, s);
  fill_score_params(p, score);
  p.sparse = sparse.params;
  launch_forward(p, q);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse, bool causal, double scale,
    bool deterministic, const std::optional<at::Tensor>& kv_num_blocks, const std::optional<at::Tensor>& kv_indices,
    const std::optional<at::Tensor>& q_num_blocks, const std::optional<at::Tensor>& q_indices,
    at::IntArrayRef block_size, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  const char* fn = "flashcute.attention backward";
  check_qkv(q_in, k_in, v_in, fn);
  const SparseArgs sparse = check_block_sparse(q_in, k_in, kv_num_blocks, kv_indices, q_num_blocks, q_indices,
                                               block_size, /*need_q_lists=*/q_in.is_cuda());
  const ScoreArgs score = check_score_args(fn, q_in, q_in.size(0), q_in.size(2), causal, window_left, window_right,
                                           softcap, alibi_slopes, q_in.size(1), k_in.size(1), dropout_p, rng_state);
  const auto q = cuda_aligned(q_in), k = cuda_aligned(k_in), v = cuda_aligned(v_in);
  const BwdInputs b = check_bwd_inputs(fn, q, dout, out, lse, dlse, {q.size(0), q.size(2), q.size(1)});

  auto dq = at::empty(q.sizes(), q.options());
  auto dk = at::empty(k.sizes(), k.options());
  auto dv = at::empty(v.sizes(), v.options());
  if (q.numel() == 0 || k.numel() == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }

  TORCH_CHECK_VALUE(std::isfinite(scale), fn, ": scale is ", scale, "; it must be finite");
  BwdParams p;
  fill_fwd_params(p, q, k, v, b.out, b.lse, causal, scale);
  fill_score_params(p, score);
  p.sparse = sparse.params;
  fill_bwd_params(p, b, b.dout, dq, dk, dv, deterministic);
  launch_backward(p, q, b.lse);
  return {dq, dk, dv};
}

// Packed batches: (total, heads, headdim) tensors; the kernels see (1, total, heads, headdim)
// views with sequences from cu_seqlens.
void check_packed_rank(const char* fn, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK_VALUE(q.dim() == 3, fn, ": q must be 3-D (total_q, nheads, headdim), got shape ", shape_str(q));
  TORCH_CHECK_VALUE(k.dim() == 3, fn, ": k must be 3-D (total_k, nheads_kv, headdim), got shape ", shape_str(k));
  TORCH_CHECK_VALUE(v.dim() == 3, fn, ": v must be 3-D (total_k, nheads_kv, headdim), got shape ", shape_str(v));
}

// A packed call's checked arguments, with q, k, v as the aligned (1, total, heads, headdim) views
// the kernels see.
struct PackedCall {
  at::Tensor q, k, v;
  VarlenArgs vl;
  ScoreArgs score;
};
PackedCall check_packed_call(const char* fn, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                             const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                             int64_t max_seqlen_k, bool causal, int64_t window_left, int64_t window_right,
                             double softcap, const std::optional<at::Tensor>& alibi_slopes, double dropout_p,
                             const std::optional<at::Tensor>& rng_state) {
  check_packed_rank(fn, q_in, k_in, v_in);
  const auto q4 = q_in.unsqueeze(0), k4 = k_in.unsqueeze(0), v4 = v_in.unsqueeze(0);
  PackedCall c;
  c.vl = check_varlen(fn, q4, k4, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k);
  check_qkv(q4, k4, v4, fn, max_seqlen_q, c.vl.num_seqs);
  c.score = check_score_args(fn, q_in, c.vl.num_seqs, q_in.size(1), causal, window_left, window_right, softcap,
                             alibi_slopes, max_seqlen_q, max_seqlen_k, dropout_p, rng_state);
  c.q = cuda_aligned(q4);
  c.k = cuda_aligned(k4);
  c.v = cuda_aligned(v4);
  return c;
}

std::tuple<at::Tensor, at::Tensor> attention_varlen(const at::Tensor& q_in, const at::Tensor& k_in,
                                                    const at::Tensor& v_in, const at::Tensor& cu_seqlens_q,
                                                    const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                    int64_t max_seqlen_k, bool causal, std::optional<double> scale,
                                                    bool deterministic, int64_t window_left, int64_t window_right,
                                                    double softcap, const std::optional<at::Tensor>& alibi_slopes,
                                                    double dropout_p, const std::optional<at::Tensor>& rng_state) {
  (void)deterministic;
  const char* fn = "flashcute.attention_varlen";
  const PackedCall c = check_packed_call(fn, q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, causal, window_left, window_right, softcap, alibi_slopes,
                                         dropout_p, rng_state);
  const auto &q = c.q, &k = c.k, &v = c.v;
  const VarlenArgs& vl = c.vl;
  const double s = resolve_scale(scale, q.size(3), fn);
  auto out = at::empty(q_in.sizes(), q_in.options());
  auto lse = at::empty({q_in.size(1), q_in.size(0)}, q_in.options().dtype(at::kFloat));
  if (q_in.numel() == 0) return {out, lse};
  clear_outside_sequences(out, vl.cu_q, lse);
  if (vl.num_seqs == 0 || k_in.size(0) == 0 || max_seqlen_q == 0 || max_seqlen_k == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }

  FwdParams p;
  fill_fwd_params(p, q, k, v, out.unsqueeze(0), lse, causal, s);
  fill_varlen_params(p, vl, q, k, max_seqlen_q, max_seqlen_k);
  fill_score_params(p, c.score);
  launch_forward(p, q);
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_varlen_backward(
    const at::Tensor& dout, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse,
    const at::Tensor& cu_seqlens_q, const at::Tensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool causal, double scale, bool deterministic, int64_t window_left, int64_t window_right, double softcap,
    const std::optional<at::Tensor>& alibi_slopes, double dropout_p, const std::optional<at::Tensor>& rng_state) {
  const char* fn = "flashcute.attention_varlen backward";
  const PackedCall c = check_packed_call(fn, q_in, k_in, v_in, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, causal, window_left, window_right, softcap, alibi_slopes,
                                         dropout_p, rng_state);
  const auto &q = c.q, &k = c.k, &v = c.v;
  const VarlenArgs& vl = c.vl;
  const BwdInputs b = check_bwd_inputs(fn, q_in, dout, out, lse, dlse, {q_in.size(1), q_in.size(0)});

  auto dq = at::empty(q_in.sizes(), q_in.options());
  auto dk = at::empty(k_in.sizes(), k_in.options());
  auto dv = at::empty(v_in.sizes(), v_in.options());
  if (q_in.numel() == 0 || k_in.numel() == 0 || vl.num_seqs == 0 || max_seqlen_q == 0 || max_seqlen_k == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  clear_outside_sequences(dq, vl.cu_q, at::Tensor());
  clear_outside_sequences(dk, vl.cu_k, at::Tensor());
  clear_outside_sequences(dv, vl.cu_k, at::Tensor());

  TORCH_CHECK_VALUE(std::isfinite(scale), fn, ": scale is ", scale, "; it must be finite");
  BwdParams p;
  fill_fwd_params(p, q, k, v, b.out.unsqueeze(0), b.lse, causal, scale);
  fill_varlen_params(p, vl, q, k, max_seqlen_q, max_seqlen_k);
  fill_score_params(p, c.score);
  fill_bwd_params(p, b, b.dout.unsqueeze(0), dq.unsqueeze(0), dk.unsqueeze(0), dv.unsqueeze(0), deterministic);
  for (Strides* st : {&p.do_stride, &p.dq_stride, &p.dk_stride, &p.dv_stride}) st->batch = 0;
  launch_backward(p, q, b.lse);
  return {dq, dk, dv};
}

// ---- KV cache (attention_with_kvcache) ----------------------------------------------------

// The cache layout of a call, checked: contiguous (batch, capacity, h_kv, d) or paged
// (num_pages, page_size, h_kv, d) through block_table (batch, max_pages) int32.
struct CacheArgs {
  bool paged = false;
  int64_t capacity = 0;  // positions per sequence
  int64_t page_size = 0;
  at::Tensor block_table;    // int32, unit last stride
  at::Tensor cache_seqlens;  // int32 (batch,) contiguous; undefined: the whole capacity
};

// FLASHCUTE_CHECK_DEVICE_VALUES=1: check a CUDA call's device-side lengths and page ids too.
bool device_value_checks() {
  const char* env = std::getenv("FLASHCUTE_CHECK_DEVICE_VALUES");
  if (env == nullptr || std::string(env) != "1") return false;
#ifdef FLASHCUTE_WITH_CUDA
  return c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None;
#else
  return true;
#endif
}

CacheArgs check_cache(const char* fn, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                      const std::optional<at::Tensor>& cache_seqlens, const std::optional<at::Tensor>& block_table) {
  CacheArgs c;
  TORCH_CHECK_VALUE(q.dim() == 4, fn, ": q must be 4-D (batch, seqlen_q, nheads, headdim), got shape ", shape_str(q));
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k_cache, "k_cache"},
                                std::pair<const at::Tensor&, const char*>{v_cache, "v_cache"}}) {
    TORCH_CHECK_VALUE(t.dim() == 4, fn, ": ", name,
                      " must be 4-D ((batch, capacity, nheads_kv, headdim), or (num_pages, page_size, nheads_kv, "
                      "headdim) with block_table), got shape ", shape_str(t));
  }
  TORCH_CHECK_VALUE(k_cache.sizes() == v_cache.sizes(), fn, ": k_cache has shape ", shape_str(k_cache),
                    " but v_cache has ", shape_str(v_cache), "; they must agree");
  // What check_qkv would say of "k" and "v", said of the caches.
  for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k_cache, "k_cache"},
                                std::pair<const at::Tensor&, const char*>{v_cache, "v_cache"}}) {
    TORCH_CHECK_VALUE(t.device() == q.device(), fn, ": ", name, " is on ", t.device(), " but q is on ", q.device(),
                      "; q and the caches must be on one device");
    TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), fn, ": ", name, " has dtype ", t.scalar_type(),
                     " but q has ", q.scalar_type(), "; q and the caches must share one dtype");
    TORCH_CHECK_VALUE(t.stride(3) == 1, fn, ": ", name, ".stride(-1) is ", t.stride(3),
                      "; the head dim must be contiguous (stride 1)");
  }
  const int64_t batch = q.size(0);
  c.paged = block_table.has_value() && block_table->defined();
  if (c.paged) {
    const at::Tensor& bt = *block_table;
    TORCH_CHECK_TYPE(bt.scalar_type() == at::kInt, fn, ": block_table has dtype ", dtype_str(bt.scalar_type()),
                     "; it must be torch.int32");
    TORCH_CHECK_VALUE(bt.dim() == 2 && bt.size(0) == batch, fn, ": block_table has shape ", shape_str(bt),
                      "; it must be (batch, max_pages) with batch = ", batch);
    TORCH_CHECK_VALUE(bt.device() == q.device(), fn, ": block_table is on ", bt.device(), " but q is on ", q.device());
    c.page_size = k_cache.size(1);
    TORCH_CHECK_VALUE(c.page_size > 0 && c.page_size % 16 == 0, fn, ": the page size (k_cache.shape[1]) is ",
                      c.page_size, "; it must be a positive multiple of 16");
    TORCH_CHECK_VALUE(cache_seqlens.has_value() && cache_seqlens->defined(), fn,
                      ": a paged cache (block_table given) needs cache_seqlens");
    c.block_table = bt.stride(1) == 1 ? bt : bt.contiguous();
    c.capacity = bt.size(1) * c.page_size;
  } else {
    TORCH_CHECK_VALUE(k_cache.size(0) == batch, fn, ": k_cache has shape ", shape_str(k_cache),
                      "; a contiguous cache must be (batch, capacity, nheads_kv, headdim) with batch = ", batch,
                      " (a paged cache needs block_table)");
    c.capacity = k_cache.size(1);
  }
  TORCH_CHECK_VALUE(c.capacity <= std::numeric_limits<int>::max(), fn, ": the cache capacity ", c.capacity,
                    " must fit in int32");
  const bool has_new = k_new.has_value() && k_new->defined();
  TORCH_CHECK_VALUE(has_new == (v_new.has_value() && v_new->defined()), fn, ": k and v must be given together");
  if (cache_seqlens.has_value() && cache_seqlens->defined()) {
    const at::Tensor& t = *cache_seqlens;
    TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, fn, ": cache_seqlens has dtype ", dtype_str(t.scalar_type()),
                     "; it must be torch.int32 (or a Python int)");
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == batch, fn, ": cache_seqlens has shape ", shape_str(t),
                      "; it must be (batch,) = (", batch, ",)");
    TORCH_CHECK_VALUE(t.device() == q.device(), fn, ": cache_seqlens is on ", t.device(), " but q is on ", q.device());
    c.cache_seqlens = t.contiguous();
  } else {
    TORCH_CHECK_VALUE(!has_new, fn, ": k and v (new tokens) need cache_seqlens (where to append them)");
  }
  if (has_new) {
    for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{*k_new, "k"},
                                  std::pair<const at::Tensor&, const char*>{*v_new, "v"}}) {
      TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == batch && t.size(2) == k_cache.size(2) &&
                            t.size(3) == k_cache.size(3),
                        fn, ": ", name, " has shape ", shape_str(t),
                        "; it must be (batch, seqlen_new, nheads_kv, headdim) = (", batch, ", seqlen_new, ",
                        k_cache.size(2), ", ", k_cache.size(3), ")");
      TORCH_CHECK_VALUE(t.device() == q.device(), fn, ": ", name, " is on ", t.device(), " but q is on ", q.device(),
                        "; the new tokens must be on q's device");
      TORCH_CHECK_TYPE(t.scalar_type() == q.scalar_type(), fn, ": ", name, " has dtype ", t.scalar_type(),
                       " but q has ", q.scalar_type(), "; the new tokens must have q's dtype");
    }
    TORCH_CHECK_VALUE(k_new->size(1) == v_new->size(1), fn, ": k has ", k_new->size(1), " new tokens but v has ",
                      v_new->size(1));
  }
  // The lengths and page ids: on the CPU always; on CUDA only when asked (a device sync per call,
  // which stalls an eager decode loop), never while a CUDA graph is captured. Unchecked, the
  // kernels clamp them: nothing is read or written outside the tensors.
  if (c.cache_seqlens.defined() && (q.is_cpu() || device_value_checks())) {
    const at::Tensor cs_host = c.cache_seqlens.cpu();
    const int* cs = cs_host.data_ptr<int>();
    const int64_t s_new = has_new ? k_new->size(1) : 0;
    const auto capacity_origin = [&] {  // for the overflow message: built only when the check fails
      return c.paged ? "block_table.shape[1] pages of page_size tokens = " + std::to_string(c.block_table.size(1)) +
                           " x " + std::to_string(c.page_size)
                     : std::string("k_cache.shape[1]");
    };
    for (int64_t b = 0; b < batch; ++b) {
      TORCH_CHECK_VALUE(cs[b] >= 0, fn, ": cache_seqlens[", b, "] is ", cs[b], "; it must be >= 0");
      TORCH_CHECK_VALUE(cs[b] + s_new <= c.capacity, fn, ": KV-cache overflow: cache_seqlens[", b, "] = ", cs[b],
                        " plus ", s_new, " new tokens exceeds the capacity ", c.capacity, " (", capacity_origin(),
                        ")");
    }
    if (c.paged) {
      const at::Tensor bt = c.block_table.cpu().contiguous();
      const int* t = bt.data_ptr<int>();
      for (int64_t b = 0; b < batch; ++b) {
        for (int64_t j = 0; j * c.page_size < cs[b] + s_new; ++j) {
          const int page = t[b * bt.size(1) + j];
          TORCH_CHECK_VALUE(page >= 0 && page < k_cache.size(0), fn, ": block_table[", b, ", ", j, "] = ", page,
                            " is a page in use; page ids must be in [0, ", k_cache.size(0), ")");
        }
      }
    }
  }
  return c;
}

at::TensorOptions pos_options() { return at::TensorOptions().dtype(at::kLong); }

// New tokens k_new, v_new (batch, s_new, h_kv, d) written into the cache at positions
// cache_seqlens[b] + t (through the block table when paged). CUDA: positions and page ids outside
// the cache are dropped (the kernel clamps; checked only on request).
void append_to_cache(const CacheArgs& c, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& k_new,
                     const at::Tensor& v_new) {
  if (k_new.size(1) == 0 || k_new.size(0) == 0) return;
  if (k_cache.is_cuda()) {
#ifdef FLASHCUTE_WITH_CUDA
    KvAppend a;
    a.cache_seqlens = c.cache_seqlens.data_ptr<int>();
    a.block_table = c.paged ? c.block_table.data_ptr<int>() : nullptr;
    a.block_table_stride = c.paged ? c.block_table.stride(0) : 0;
    a.page_size = c.paged ? c.page_size : c.capacity;
    a.capacity = c.capacity;
    a.num_pages = c.paged ? k_cache.size(0) : 0;
    a.batch = k_new.size(0);
    a.seqlen_new = k_new.size(1);
    a.heads = k_new.size(2);
    a.headdim = k_new.size(3);
    for (int i = 0; i < 2; ++i) {
      const at::Tensor& src = i == 0 ? k_new : v_new;
      const at::Tensor& dst = i == 0 ? k_cache : v_cache;
      a.src[i] = src.data_ptr();
      a.dst[i] = dst.data_ptr();
      a.src_stride[i] = {src.stride(0), src.stride(1), src.stride(2)};
      a.dst_stride[i] = {dst.stride(0), dst.stride(1), dst.stride(2)};
    }
    run_kvcache_append(a, at::cuda::getCurrentCUDAStream().stream());
#endif
    return;
  }
  // CPU: the values are checked (check_cache), so every position is inside the cache.
  const auto pos = c.cache_seqlens.to(at::kLong).unsqueeze(1) + at::arange(k_new.size(1), pos_options());
  at::Tensor page = at::arange(k_new.size(0), pos_options()).unsqueeze(1).expand_as(pos), slot = pos;
  if (c.paged) {
    page = c.block_table.to(at::kLong).gather(1, pos.div(c.page_size, "floor"));
    slot = pos.remainder(c.page_size);
  }
  const std::vector<std::optional<at::Tensor>> index{page.reshape(-1), slot.reshape(-1)};
  const c10::List<std::optional<at::Tensor>> indices(index);
  k_cache.index_put_(indices, k_new.reshape({-1, k_new.size(2), k_new.size(3)}));
  v_cache.index_put_(indices, v_new.reshape({-1, v_new.size(2), v_new.size(3)}));
}

std::tuple<at::Tensor, at::Tensor> attention_with_kvcache(
    const at::Tensor& q_in, at::Tensor& k_cache, at::Tensor& v_cache, const std::optional<at::Tensor>& k_new,
    const std::optional<at::Tensor>& v_new, const std::optional<at::Tensor>& cache_seqlens,
    const std::optional<at::Tensor>& block_table, bool causal, std::optional<double> scale, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi_slopes, int64_t num_splits) {
  const char* fn = "flashcute.attention_with_kvcache";
  const CacheArgs c = check_cache(fn, q_in, k_cache, v_cache, k_new, v_new, cache_seqlens, block_table);
  const int64_t batch = q_in.size(0);
  // q against the cache seen as (batch, capacity, h_kv, d) (check_qkv's rules).
  const at::Tensor kview =
      c.paged ? k_cache.narrow(0, 0, std::min<int64_t>(k_cache.size(0), 1)).expand({batch, -1, -1, -1}) : k_cache;
  TORCH_CHECK_VALUE(!c.paged || k_cache.size(0) > 0 || batch == 0, fn, ": k_cache has no pages");
  const at::Tensor vview =
      c.paged ? v_cache.narrow(0, 0, std::min<int64_t>(v_cache.size(0), 1)).expand({batch, -1, -1, -1}) : v_cache;
  check_qkv(q_in, kview, vview, fn);
  TORCH_CHECK_VALUE(num_splits >= 0 && num_splits <= 256, fn, ": num_splits is ", num_splits,
                    "; it must be 0 (heuristic), 1 (no split) or a number of splits up to 256");
  if (q_in.is_cuda()) {
    // The cache is written in place: it cannot be copied to fix an alignment the kernels need.
    for (const auto& [t, name] : {std::pair<const at::Tensor&, const char*>{k_cache, "k_cache"},
                                  std::pair<const at::Tensor&, const char*>{v_cache, "v_cache"}}) {
      TORCH_CHECK_VALUE(cuda_aligned(t).data_ptr() == t.data_ptr(), fn, ": ", name,
                        " must start at a 16-byte aligned address with strides that are multiples of 16 bytes");
    }
  }
  const ScoreArgs score = check_score_args(fn, q_in, batch, q_in.size(2), causal, window_left, window_right, softcap,
                                           alibi_slopes, q_in.size(1), c.capacity);
  const double s = resolve_scale(scale, q_in.size(3), fn);
  const bool has_new = k_new.has_value() && k_new->defined();
  auto out = at::empty(q_in.sizes(), q_in.options());
  auto lse = at::empty({batch, q_in.size(2), q_in.size(1)}, q_in.options().dtype(at::kFloat));
  if (has_new) {
    const c10::OptionalDeviceGuard guard(q_in.device());
    append_to_cache(c, k_cache, v_cache, cuda_aligned(*k_new), cuda_aligned(*v_new));
  }
  if (q_in.numel() == 0) return {out, lse};
  if (c.capacity == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  const auto q = cuda_aligned(q_in);

  // The cache as k, v of capacity positions per sequence, its pages through the block table
  // (params.h); both backends read it with the rule of common/kvcache.h.
  FwdParams p;
  fill_fwd_params(p, q, k_cache, v_cache, out, lse, causal, s);
  fill_score_params(p, score);
  p.cache_seqlens = c.cache_seqlens.defined() ? c.cache_seqlens.data_ptr<int>() : nullptr;
  p.seqlen_new = has_new ? k_new->size(1) : 0;
  p.seqlen_k = static_cast<int>(c.capacity);
  if (c.paged) {
    p.block_table = c.block_table.data_ptr<int>();
    p.block_table_stride = c.block_table.stride(0);
    p.page_size = static_cast<int>(c.page_size);
    p.num_pages = static_cast<int>(k_cache.size(0));
  }
  if (q.is_cpu()) {
    launch_forward(p, q);
    return {out, lse};
  }
#ifdef FLASHCUTE_WITH_CUDA
  const c10::cuda::CUDAGuard guard(q.device());
  const auto dtype = to_dtype(q.scalar_type());
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  const int num_sms = prop->multiProcessorCount;
  if (kvcache_on_sm90_cuda(p, dtype, prop->major * 10 + prop->minor, num_sms, static_cast<int>(num_splits))) {
    launch_forward(p, q);  // the sm90 forward over the cache's used positions
    return {out, lse};
  }
  void* stream = at::cuda::getCurrentCUDAStream().stream();
  const int arch = kvcache_plan_cuda(p, dtype, prop->major * 10 + prop->minor, num_sms, static_cast<int>(num_splits));
  if (arch == 90) {  // the sm90 decoding kernel merges its splits itself
    run_stage("flashcute::fwd_decode", [&] { run_kvcache_cuda(p, dtype, arch, stream); });
    return {out, lse};
  }
  auto accum = at::empty({int64_t(p.num_splits) * batch * p.nheads * p.seqlen_q * (p.headdim + 1)},
                         q.options().dtype(at::kFloat));
  p.o_accum = accum.data_ptr<float>();
  p.lse_accum = p.o_accum + int64_t(p.num_splits) * batch * p.nheads * p.seqlen_q * p.headdim;
  run_stage("flashcute::fwd_kvcache", [&] { run_kvcache_cuda(p, dtype, arch, stream); });
  run_stage("flashcute::fwd_combine", [&] {
    run_kvcache_combine(p, q.scalar_type() == at::kBFloat16, static_cast<cudaStream_t>(stream));
  });
#endif
  return {out, lse};
}

// Whether this build has a CUDA kernel for headdim in dtype (flashcute.sdpa asks before calling).
bool has_cuda_kernel(int64_t headdim, at::ScalarType dtype) {
#ifdef FLASHCUTE_WITH_CUDA
  if (dtype != at::kHalf && dtype != at::kBFloat16) return false;
  return headdim > 0 && headdim <= kMaxHeadDim && headdim % 8 == 0 &&
         cuda_kernel_headdim(static_cast<int>(headdim), to_dtype(dtype)) != 0;
#else
  (void)headdim;
  (void)dtype;
  return false;
#endif
}

// The process-wide kernel family (flashcute.kernels): 0 auto, 80 or 90; returns the previous one.
// Python checks the name and whether the GPU and the build have the family.
int64_t set_kernel_family(int64_t family) {
  TORCH_CHECK_VALUE(family == 0 || family == 80 || family == 90, "flashcute.kernels: family ", family,
                    " is not 0 (auto), 80 or 90");
  return g_kernel_family.exchange(static_cast<int>(family));
}

// The kernel families of this build (80 and, where it has the sm90 forward, 90) whose forward
// runs on GPUs of compute capability device_arch (10 * major + minor; 0: any GPU); empty without
// CUDA. (Without FLASHCUTE_SM80_ON_SM90 the sm80 family's forward has no sm_90 code.)
std::vector<int64_t> kernel_families(int64_t device_arch) {
#ifdef FLASHCUTE_WITH_CUDA
  return cuda_kernel_families(static_cast<int>(device_arch));
#else
  (void)device_arch;
  return {};
#endif
}

}  // namespace

// ---- Autograd ----------------------------------------------------------------------------
// The Autograd-key kernels of attention and attention_varlen: the op below autograd, then the
// backward op on the saved inputs, out and lse. In C++ rather than Python
// (torch.library.register_autograd) for host time: a Python backward node makes autograd's
// device thread run Python under the GIL; the C++ kernels took a fwd+bwd call's host time from
// 545 to 257 us on the GPU machine's host (2026-11-24; docs/NOTES.md), where a CPU-bound training
// step pays it in GPU idle time. torch.compile traces through these kernels (AOTAutograd
// records the forward and backward ops); is_traceable lets compiled autograd trace the backward.

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

template <typename Op>
auto below_autograd(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Op>();
}

// The gradients of (out, lse) as the backward ops take them: an absent dout is zeros, an absent
// dlse is none (set_materialize_grads(false) leaves both undefined).
std::pair<at::Tensor, std::optional<at::Tensor>> output_grads(const variable_list& grads, const at::Tensor& out) {
  at::Tensor dout = grads[0].defined() ? grads[0] : at::zeros_like(out);
  std::optional<at::Tensor> dlse;
  if (grads[1].defined()) dlse = grads[1];
  return {dout, dlse};
}

std::optional<at::Tensor> saved_opt(const at::Tensor& t) {
  return t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
}

// The scalar arguments that both attention ops and their backwards share, kept in the context.
struct SavedArgs {
  bool causal, deterministic;
  double scale, softcap, dropout_p;
  int64_t window_left, window_right;

  void save(AutogradContext* ctx) const {
    auto& d = ctx->saved_data;
    d["causal"] = causal;
    d["deterministic"] = deterministic;
    d["scale"] = scale;
    d["softcap"] = softcap;
    d["dropout_p"] = dropout_p;
    d["window_left"] = window_left;
    d["window_right"] = window_right;
    ctx->set_materialize_grads(false);
  }
  static SavedArgs load(AutogradContext* ctx) {
    const auto& d = ctx->saved_data;
    return {d.at("causal").toBool(),   d.at("deterministic").toBool(), d.at("scale").toDouble(),
            d.at("softcap").toDouble(), d.at("dropout_p").toDouble(),   d.at("window_left").toInt(),
            d.at("window_right").toInt()};
  }
};

// The number of inputs of an autograd Function's forward (its arguments after the context).
template <typename F>
struct ForwardInputs;
template <typename R, typename... Args>
struct ForwardInputs<R (*)(AutogradContext*, Args...)> {
  static constexpr size_t value = sizeof...(Args);
};

// One gradient per input of Function's forward: dq, dk, dv, then none.
template <typename Function>
variable_list qkv_grads(std::tuple<at::Tensor, at::Tensor, at::Tensor> g) {
  variable_list result(ForwardInputs<decltype(&Function::forward)>::value);
  std::tie(result[0], result[1], result[2]) = std::move(g);
  return result;
}

struct AttentionFunction : public torch::autograd::Function<AttentionFunction> {
  static constexpr bool is_traceable = true;

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               bool causal, std::optional<double> scale, bool deterministic,
                               const std::optional<at::Tensor>& kv_num, const std::optional<at::Tensor>& kv_idx,
                               const std::optional<at::Tensor>& q_num, const std::optional<at::Tensor>& q_idx,
                               at::IntArrayRef block_size, int64_t window_left, int64_t window_right, double softcap,
                               const std::optional<at::Tensor>& alibi, double dropout_p,
                               const std::optional<at::Tensor>& rng_state) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = below_autograd<decltype(attention)>("flashcute::attention");
    auto [out, lse] = op.call(q, k, v, causal, scale, deterministic, kv_num, kv_idx, q_num, q_idx, block_size,
                              window_left, window_right, softcap, alibi, dropout_p, rng_state);
    ctx->save_for_backward({q, k, v, out, lse, kv_num.value_or(at::Tensor()), kv_idx.value_or(at::Tensor()),
                            q_num.value_or(at::Tensor()), q_idx.value_or(at::Tensor()), alibi.value_or(at::Tensor()),
                            rng_state.value_or(at::Tensor())});
    const double scale_used = resolve_scale(scale, q.size(-1), "flashcute.attention");
    SavedArgs{causal, deterministic, scale_used, softcap, dropout_p, window_left, window_right}.save(ctx);
    ctx->saved_data["block_size"] = block_size.vec();
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const SavedArgs a = SavedArgs::load(ctx);
    auto [dout, dlse] = output_grads(grads, s[3]);
    static auto op = below_autograd<decltype(attention_backward)>("flashcute::attention_backward");
    return qkv_grads<AttentionFunction>(op.call(
        dout, s[0], s[1], s[2], s[3], s[4], dlse, a.causal, a.scale, a.deterministic, saved_opt(s[5]), saved_opt(s[6]),
        saved_opt(s[7]), saved_opt(s[8]), ctx->saved_data.at("block_size").toIntVector(), a.window_left,
        a.window_right, a.softcap, saved_opt(s[9]), a.dropout_p, saved_opt(s[10])));
  }
};

struct AttentionVarlenFunction : public torch::autograd::Function<AttentionVarlenFunction> {
  static constexpr bool is_traceable = true;

  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q, int64_t max_k,
                               bool causal, std::optional<double> scale, bool deterministic, int64_t window_left,
                               int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi,
                               double dropout_p, const std::optional<at::Tensor>& rng_state) {
    at::AutoDispatchBelowADInplaceOrView guard;
    static auto op = below_autograd<decltype(attention_varlen)>("flashcute::attention_varlen");
    auto [out, lse] = op.call(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic, window_left,
                              window_right, softcap, alibi, dropout_p, rng_state);
    ctx->save_for_backward({q, k, v, out, lse, cu_q, cu_k, alibi.value_or(at::Tensor()),
                            rng_state.value_or(at::Tensor())});
    const double scale_used = resolve_scale(scale, q.size(-1), "flashcute.attention_varlen");
    SavedArgs{causal, deterministic, scale_used, softcap, dropout_p, window_left, window_right}.save(ctx);
    ctx->saved_data["max_q"] = max_q;
    ctx->saved_data["max_k"] = max_k;
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto s = ctx->get_saved_variables();
    const SavedArgs a = SavedArgs::load(ctx);
    auto [dout, dlse] = output_grads(grads, s[3]);
    static auto op = below_autograd<decltype(attention_varlen_backward)>("flashcute::attention_varlen_backward");
    const int64_t max_q = ctx->saved_data.at("max_q").toInt(), max_k = ctx->saved_data.at("max_k").toInt();
    return qkv_grads<AttentionVarlenFunction>(op.call(dout, s[0], s[1], s[2], s[3], s[4], dlse, s[5], s[6], max_q,
                                                      max_k, a.causal, a.scale, a.deterministic, a.window_left,
                                                      a.window_right, a.softcap, saved_opt(s[7]), a.dropout_p,
                                                      saved_opt(s[8])));
  }
};

std::tuple<at::Tensor, at::Tensor> attention_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, std::optional<double> scale,
    bool deterministic, const std::optional<at::Tensor>& kv_num, const std::optional<at::Tensor>& kv_idx,
    const std::optional<at::Tensor>& q_num, const std::optional<at::Tensor>& q_idx, at::IntArrayRef block_size,
    int64_t window_left, int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi,
    double dropout_p, const std::optional<at::Tensor>& rng_state) {
  auto r = AttentionFunction::apply(q, k, v, causal, scale, deterministic, kv_num, kv_idx, q_num, q_idx, block_size,
                                    window_left, window_right, softcap, alibi, dropout_p, rng_state);
  return {r[0], r[1]};
}

std::tuple<at::Tensor, at::Tensor> attention_varlen_autograd(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q, const at::Tensor& cu_k,
    int64_t max_q, int64_t max_k, bool causal, std::optional<double> scale, bool deterministic, int64_t window_left,
    int64_t window_right, double softcap, const std::optional<at::Tensor>& alibi, double dropout_p,
    const std::optional<at::Tensor>& rng_state) {
  auto r = AttentionVarlenFunction::apply(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic,
                                          window_left, window_right, softcap, alibi, dropout_p, rng_state);
  return {r[0], r[1]};
}

TORCH_LIBRARY(flashcute, m) {
  // New arguments are appended with defaults, so calls written for v1 keep working.
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, "
      "bool deterministic=False, Tensor? kv_num_blocks=None, Tensor? kv_indices=None, "
      "Tensor? q_num_blocks=None, Tensor? q_indices=None, int[2] block_size=[128, 128], "
      "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
      "float dropout_p=0.0, Tensor? rng_state=None) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? dlse, bool causal, float scale, bool deterministic, Tensor? kv_num_blocks=None, "
      "Tensor? kv_indices=None, Tensor? q_num_blocks=None, Tensor? q_indices=None, "
      "int[2] block_size=[128, 128], int window_left=-1, int window_right=-1, float softcap=0.0, "
      "Tensor? alibi_slopes=None, float dropout_p=0.0, Tensor? rng_state=None) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, bool causal=False, float? scale=None, bool deterministic=False, "
      "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, "
      "float dropout_p=0.0, Tensor? rng_state=None) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_varlen_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? dlse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
      "bool causal, float scale, bool deterministic, int window_left=-1, int window_right=-1, "
      "float softcap=0.0, Tensor? alibi_slopes=None, float dropout_p=0.0, Tensor? rng_state=None) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  m.def(
      "attention_with_kvcache(Tensor q, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k=None, Tensor? v=None, "
      "Tensor? cache_seqlens=None, Tensor? block_table=None, bool causal=False, float? scale=None, "
      "int window_left=-1, int window_right=-1, float softcap=0.0, Tensor? alibi_slopes=None, int num_splits=0) "
      "-> (Tensor out, Tensor lse)");
  m.def("block_mask_transpose(Tensor kv_num_blocks, Tensor kv_indices) -> (Tensor q_num_blocks, Tensor q_indices)");
  m.def("dropout_mask(Tensor rng_state, int batch, int nheads, int seqlen_q, int seqlen_k, float dropout_p) -> Tensor");
  m.def("has_cuda_kernel(int headdim, ScalarType dtype) -> bool", &has_cuda_kernel);
  m.def("set_kernel_family(int family) -> int", &set_kernel_family);
  m.def("kernel_families(int device_arch=0) -> int[]", &kernel_families);
}

TORCH_LIBRARY_IMPL(flashcute, Autograd, m) {
  m.impl("attention", &attention_autograd);
  m.impl("attention_varlen", &attention_varlen_autograd);
}

TORCH_LIBRARY_IMPL(flashcute, CPU, m) {
  m.impl("attention", &attention);
  m.impl("attention_backward", &attention_backward);
  m.impl("attention_varlen", &attention_varlen);
  m.impl("attention_varlen_backward", &attention_varlen_backward);
  m.impl("attention_with_kvcache", &attention_with_kvcache);
  m.impl("block_mask_transpose", &block_mask_transpose);
  m.impl("dropout_mask", &dropout_mask);
}

// Registered in CPU-only builds too, so that CUDA tensors get check_qkv's message.
TORCH_LIBRARY_IMPL(flashcute, CUDA, m) {
  m.impl("attention", &attention);
  m.impl("attention_backward", &attention_backward);
  m.impl("attention_varlen", &attention_varlen);
  m.impl("attention_varlen_backward", &attention_varlen_backward);
  m.impl("attention_with_kvcache", &attention_with_kvcache);
  m.impl("block_mask_transpose", &block_mask_transpose);
  m.impl("dropout_mask", &dropout_mask);
}

}  // namespace flashcute
