// flashcute — the dispatcher ops: torch.ops.flashcute.attention and its backward.
//
// Checks the arguments once (every message names the argument, the value and what is
// allowed), fills the shared params struct, and calls the CPU or the CUDA backend.
// Fake (meta) kernels and the autograd formula are registered in Python
// (python/flashcute/_ops.py).
#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "backends.h"

#ifdef FLASHCUTE_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <nvtx3/nvtx3.hpp>
#endif

namespace flashcute {
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

// The CUDA kernels move rows in 16-byte pieces: a tensor whose pointer or strides are not
// multiples of 16 bytes (rare: e.g. a view that starts mid-row) is copied to a contiguous one.
at::Tensor cuda_aligned(const at::Tensor& t) {
  if (!t.is_cuda()) return t;
  const int64_t align = 16 / t.element_size();
  const bool ok = reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0 && t.stride(0) % align == 0 &&
                  t.stride(1) % align == 0 && t.stride(2) % align == 0;
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Checks q, k, v against the SPEC and returns nothing; every failure raises.
void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const char* fn = "flashcute.attention";
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
    TORCH_CHECK_VALUE(dt == at::kHalf || dt == at::kBFloat16, fn, ": q has dtype ", dt,
                      "; on CUDA q, k and v must be float16 or bfloat16");
  } else {
    TORCH_CHECK_VALUE(q.device().is_cpu(), fn, ": q is on ", q.device(),
                      "; flashcute runs on CUDA and CPU devices only");
    TORCH_CHECK_VALUE(dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16, fn, ": q has dtype ", dt,
                      "; on CPU q, k and v must be float32, float16 or bfloat16");
  }
  TORCH_CHECK_VALUE(k.scalar_type() == dt, fn, ": k has dtype ", k.scalar_type(), " but q has ", dt,
                    "; q, k and v must share one dtype");
  TORCH_CHECK_VALUE(v.scalar_type() == dt, fn, ": v has dtype ", v.scalar_type(), " but q has ", dt,
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
    const int64_t ctas = (q.size(1) / 8 + 16) * q.size(0) * q.size(2);
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
  p.scale_log2 = static_cast<float>(scale * M_LOG2E);
  p.causal = causal;
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
  TORCH_CHECK_VALUE(kv_num_in.scalar_type() == at::kInt && kv_idx_in.scalar_type() == at::kInt, fn,
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
    TORCH_CHECK_VALUE(t.scalar_type() == at::kInt, fn, ": ", name, " has dtype ", dtype_str(t.scalar_type()),
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

double resolve_scale(std::optional<double> scale, int64_t headdim) {
  const double s = scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(headdim));
  TORCH_CHECK_VALUE(std::isfinite(s), "flashcute.attention: scale is ", s, "; it must be finite");
  return s;
}

std::tuple<at::Tensor, at::Tensor> attention(const at::Tensor& q_in, const at::Tensor& k_in,
                                             const at::Tensor& v_in, bool causal, std::optional<double> scale,
                                             bool deterministic, const std::optional<at::Tensor>& kv_num_blocks,
                                             const std::optional<at::Tensor>& kv_indices,
                                             const std::optional<at::Tensor>& q_num_blocks,
                                             const std::optional<at::Tensor>& q_indices, at::IntArrayRef block_size) {
  // deterministic and the query-major lists are used by the backward only; they are part of the
  // op so that autograd sees them.
  (void)deterministic;
  check_qkv(q_in, k_in, v_in);
  const SparseArgs sparse = check_block_sparse(q_in, k_in, kv_num_blocks, kv_indices, q_num_blocks, q_indices,
                                               block_size, /*need_q_lists=*/false);
  const auto q = cuda_aligned(q_in), k = cuda_aligned(k_in), v = cuda_aligned(v_in);
  const double s = resolve_scale(scale, q.size(3));
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
  p.sparse = sparse.params;
  if (q.is_cuda()) {
#ifdef FLASHCUTE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    run_stage("flashcute::fwd",
              [&] { run_fwd_cuda(p, to_dtype(q.scalar_type()), at::cuda::getCurrentCUDAStream().stream()); });
#endif
  } else {
    run_stage("flashcute::fwd", [&] { run_fwd_cpu(p, to_dtype(q.scalar_type())); });
  }
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward(
    const at::Tensor& dout, const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& dlse, bool causal, double scale,
    bool deterministic, const std::optional<at::Tensor>& kv_num_blocks, const std::optional<at::Tensor>& kv_indices,
    const std::optional<at::Tensor>& q_num_blocks, const std::optional<at::Tensor>& q_indices,
    at::IntArrayRef block_size) {
  check_qkv(q_in, k_in, v_in);
  const SparseArgs sparse = check_block_sparse(q_in, k_in, kv_num_blocks, kv_indices, q_num_blocks, q_indices,
                                               block_size, /*need_q_lists=*/q_in.is_cuda());
  const auto q = cuda_aligned(q_in), k = cuda_aligned(k_in), v = cuda_aligned(v_in);
  const char* fn = "flashcute.attention backward";
  TORCH_CHECK_VALUE(dout.sizes() == q.sizes() && out.sizes() == q.sizes(), fn, ": dout ", shape_str(dout),
                    " and out ", shape_str(out), " must have q's shape ", shape_str(q));
  TORCH_CHECK_VALUE(dout.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(), fn,
                    ": dout (", dout.scalar_type(), ") and out (", out.scalar_type(), ") must have q's dtype ",
                    q.scalar_type());
  TORCH_CHECK_VALUE(dout.device() == q.device() && out.device() == q.device() && lse.device() == q.device(), fn,
                    ": dout, out and lse must be on q's device ", q.device());
  // The kernels read dout, out and lse through their strides; only the head dim must be unit-stride,
  // and lse / dlse are read as contiguous (b, h, sq).
  const auto dout_c = cuda_aligned(dout.stride(3) == 1 ? dout : dout.contiguous());
  const auto out_c = cuda_aligned(out.stride(3) == 1 ? out : out.contiguous());
  const auto lse_c = lse.to(at::kFloat).contiguous();
  TORCH_CHECK_VALUE(lse_c.sizes() == at::IntArrayRef({q.size(0), q.size(2), q.size(1)}), fn, ": lse has shape ",
                    shape_str(lse), "; expected (batch, nheads, seqlen_q)");
  at::Tensor dlse_c;
  if (dlse.has_value() && dlse->defined()) {
    dlse_c = dlse->to(at::kFloat).contiguous();
    TORCH_CHECK_VALUE(dlse_c.sizes() == lse_c.sizes(), fn, ": dlse has shape ", shape_str(*dlse),
                      "; expected lse's shape ", shape_str(lse));
  }

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
  fill_fwd_params(p, q, k, v, out_c, lse_c, causal, scale);
  p.sparse = sparse.params;
  p.dout = dout_c.data_ptr();
  p.do_stride = strides_of(dout_c);
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dv = dv.data_ptr();
  p.dq_stride = strides_of(dq);
  p.dk_stride = strides_of(dk);
  p.dv_stride = strides_of(dv);
  p.dlse = dlse_c.defined() ? dlse_c.data_ptr<float>() : nullptr;
  p.deterministic = deterministic;

  if (q.is_cuda()) {
#ifdef FLASHCUTE_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    const auto dtype = to_dtype(q.scalar_type());
    const int num_sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    const BwdWorkspace ws = bwd_workspace_cuda(p, dtype, num_sms);
    // D and L for whole query blocks, then the dQ accumulator: one allocation.
    const int64_t rows = q.size(0) * q.size(2) * int64_t(ws.seqlen_rounded);
    auto workspace = at::empty({2 * rows + ws.numel(p)}, q.options().dtype(at::kFloat));
    p.dsum = workspace.data_ptr<float>();
    p.lse_log2 = p.dsum + rows;
    p.dq_accum = p.lse_log2 + rows;
    void* stream = at::cuda::getCurrentCUDAStream().stream();
    run_stage("flashcute::bwd_preprocess", [&] { run_bwd_stage_cuda(BwdStage::kPreprocess, p, ws, dtype, stream); });
    run_stage("flashcute::bwd", [&] { run_bwd_stage_cuda(BwdStage::kMain, p, ws, dtype, stream); });
    run_stage("flashcute::bwd_convert_dq", [&] { run_bwd_stage_cuda(BwdStage::kConvertDq, p, ws, dtype, stream); });
#endif
  } else {
    auto dsum = at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat));
    p.dsum = dsum.data_ptr<float>();
    run_stage("flashcute::bwd", [&] { run_bwd_cpu(p, to_dtype(q.scalar_type())); });
  }
  return {dq, dk, dv};
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

}  // namespace

TORCH_LIBRARY(flashcute, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, bool causal=False, float? scale=None, "
      "bool deterministic=False, Tensor? kv_num_blocks=None, Tensor? kv_indices=None, "
      "Tensor? q_num_blocks=None, Tensor? q_indices=None, int[2] block_size=[128, 128]) -> (Tensor out, Tensor lse)");
  m.def(
      "attention_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? dlse, bool causal, float scale, bool deterministic, Tensor? kv_num_blocks=None, "
      "Tensor? kv_indices=None, Tensor? q_num_blocks=None, Tensor? q_indices=None, "
      "int[2] block_size=[128, 128]) -> (Tensor dq, Tensor dk, Tensor dv)");
  m.def("block_mask_transpose(Tensor kv_num_blocks, Tensor kv_indices) -> (Tensor q_num_blocks, Tensor q_indices)");
  m.def("has_cuda_kernel(int headdim, ScalarType dtype) -> bool", &has_cuda_kernel);
}

TORCH_LIBRARY_IMPL(flashcute, CPU, m) {
  m.impl("attention", &attention);
  m.impl("attention_backward", &attention_backward);
  m.impl("block_mask_transpose", &block_mask_transpose);
}

// Registered in CPU-only builds too, so that CUDA tensors get check_qkv's message.
TORCH_LIBRARY_IMPL(flashcute, CUDA, m) {
  m.impl("attention", &attention);
  m.impl("attention_backward", &attention_backward);
  m.impl("block_mask_transpose", &block_mask_transpose);
}

}  // namespace flashcute
