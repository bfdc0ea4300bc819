// flashcute — picks the kernel instance for a call from the table of what this build has
// (flashcute_instances.h, generated): the kernel family (sm90 on sm90 GPUs for the calls it
// serves, unless flashcute.kernels("sm80") forces the other; sm80 otherwise), then the smallest
// head dim of that family that holds the call's head dim (the kernels zero-pad the rest), in
// the call's dtype.
#include <cutlass/numeric_types.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "backends.h"
#include "flashcute/launch.h"
#include "flashcute_instances.h"

namespace flashcute {
namespace {

// A row of the table: the family (arch), head dim and dtype of an instance, and whether its code
// runs on compute capability 9.0 (the sm80 family's forward and backward of the head dims the sm90
// family serves are compiled for sm90 only with FLASHCUTE_SM80_ON_SM90, cmake/instantiations.cmake).
struct FwdInstance {
  int arch;
  int headdim;
  DType dtype;
  bool sm90_code;
  void (*run)(const FwdParams&, cudaStream_t);
};
struct BwdInstance {
  int arch;
  int headdim;
  DType dtype;
  bool sm90_code;
  BwdWorkspace (*workspace)(const BwdParams&, int);
  void (*stage)(BwdStage, const BwdParams&, const BwdWorkspace&, cudaStream_t);
};

#define FLASHCUTE_FWD_ROW(A, F, D, E, T, S9) FwdInstance{A, D, DType::T, S9, &F::run_fwd<E, D>},
#define FLASHCUTE_BWD_ROW(A, F, D, E, T, S9) \
  BwdInstance{A, D, DType::T, S9, &F::bwd_workspace<E, D>, &F::run_bwd_stage<E, D>},
const FwdInstance kFwdInstances[] = {FLASHCUTE_FOR_EACH_FWD_INSTANCE(FLASHCUTE_FWD_ROW)};
struct KvCacheInstance {
  int arch;
  int headdim;
  DType dtype;
  bool sm90_code;
  void (*run)(const FwdParams&, cudaStream_t);
  void (*tiles)(const FwdParams&, int&, int&, int&);
};
#define FLASHCUTE_KVCACHE_ROW(A, F, D, E, T, S9) \
  KvCacheInstance{A, D, DType::T, S9, &F::run_fwd_kvcache<E, D>, &F::kvcache_tiles<E, D>},
const KvCacheInstance kKvCacheInstances[] = {FLASHCUTE_FOR_EACH_KVCACHE_INSTANCE(FLASHCUTE_KVCACHE_ROW)};
#undef FLASHCUTE_KVCACHE_ROW
const BwdInstance kBwdInstances[] = {FLASHCUTE_FOR_EACH_BWD_INSTANCE(FLASHCUTE_BWD_ROW)};
#undef FLASHCUTE_FWD_ROW
#undef FLASHCUTE_BWD_ROW

// Whether a row's code runs on a GPU of compute capability device_arch (10 * major + minor; 0:
// any GPU): sm90-family code on 9.0 only, sm80-family code on 8.x and, where it has sm_90 code, 9.0.
template <typename Row>
bool runs_on(const Row& r, int device_arch) {
  if (device_arch == 0) return true;
  return device_arch >= 80 && (r.arch == 90 ? device_arch == 90 : device_arch != 90 || r.sm90_code);
}

// The instance of `arch` for (headdim, dtype) that runs on device_arch (0: any): the smallest
// head dim >= headdim, or nullptr.
template <typename Row, size_t N>
const Row* pick(const Row (&rows)[N], int arch, int device_arch, int headdim, DType dtype) {
  const Row* best = nullptr;
  for (const Row& r : rows) {
    if (r.arch == arch && runs_on(r, device_arch) && r.dtype == dtype && r.headdim >= headdim &&
        (best == nullptr || r.headdim < best->headdim)) {
      best = &r;
    }
  }
  return best;
}

// TMA describes q, k, v when every stride that matters is a positive multiple of 16 bytes (the
// op already copies tensors with misaligned pointers or strides; negative or zero strides, as in
// flipped or expanded views, remain).
bool tma_describes(const Strides& s, int heads, int batch) {
  auto ok = [](int64_t stride, int extent) { return extent <= 1 || (stride > 0 && (stride * 2) % 16 == 0); };
  return ok(s.row, 2) && ok(s.head, heads) && ok(s.batch, batch);
}

// The calls the sm90 forward serves (the rest run on sm80): sm_90a code runs on compute
// capability 9.0 only, and its loads are TMA copies.
bool sm90_fwd_serves(const FwdParams& p, int device_arch) {
  const int batch = p.is_varlen() ? 1 : p.batch;
  return device_arch == 90 && tma_describes(p.q_stride, p.nheads, batch) &&
         tma_describes(p.k_stride, p.nheads_kv, batch) && tma_describes(p.v_stride, p.nheads_kv, batch);
}

[[noreturn]] void no_instance(int headdim) {
  throw std::invalid_argument("flashcute: no CUDA kernel for headdim " + std::to_string(headdim) + " in this build");
}

}  // namespace

int cuda_kernel_headdim(int headdim, DType dtype) {
  const FwdInstance* r = pick(kFwdInstances, 80, 0, headdim, dtype);
  if (r == nullptr) r = pick(kFwdInstances, 90, 0, headdim, dtype);
  return r != nullptr ? r->headdim : 0;
}

std::vector<int64_t> cuda_kernel_families(int device_arch) {
  std::vector<int64_t> families;
  for (const FwdInstance& r : kFwdInstances) {
    if (runs_on(r, device_arch) && std::find(families.begin(), families.end(), r.arch) == families.end()) families.push_back(r.arch);
  }
  return families;
}

#ifdef FLASHCUTE_TUNING
bool run_fwd_tuning(const FwdParams& params, DType dtype, cudaStream_t stream);  // src/cuda/tuning.cu
#endif

int run_fwd_cuda(const FwdParams& call, DType dtype, int device_arch, int num_sms, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  FwdParams params = call;
  params.num_sms = num_sms;
#ifdef FLASHCUTE_TUNING
  if (run_fwd_tuning(params, dtype, s)) return 80;
#endif
  const FwdInstance* r = nullptr;
  if (kernel_family() != 80 && sm90_fwd_serves(params, device_arch)) {
    r = pick(kFwdInstances, 90, device_arch, params.headdim, dtype);
  }
  if (r == nullptr) r = pick(kFwdInstances, 80, device_arch, params.headdim, dtype);
  if (r == nullptr) no_instance(params.headdim);
  r->run(params, s);
  return r->arch;
}

// The backward picks its family once, with the workspace; every stage then runs that family's
// kernels. The sm90 backward also needs dout's strides to be TMA-describable, and has head dims
// up to 128 (larger ones run on sm80).
BwdWorkspace bwd_workspace_cuda(const BwdParams& params, DType dtype, int device_arch, int num_sms) {
  const int batch = params.is_varlen() ? 1 : params.batch;
  const BwdInstance* r = nullptr;
  if (kernel_family() != 80 && sm90_fwd_serves(params, device_arch) &&
      tma_describes(params.do_stride, params.nheads, batch)) {
    r = pick(kBwdInstances, 90, device_arch, params.headdim, dtype);
  }
  if (r == nullptr) r = pick(kBwdInstances, 80, device_arch, params.headdim, dtype);
  if (r == nullptr) no_instance(params.headdim);
  BwdWorkspace ws = r->workspace(params, num_sms);
  ws.arch = r->arch;
  return ws;
}

void run_bwd_stage_cuda(BwdStage stage, const BwdParams& params, const BwdWorkspace& workspace, DType dtype,
                        void* stream) {
  const BwdInstance* r = pick(kBwdInstances, workspace.arch, 0, params.headdim, dtype);
  if (r == nullptr) no_instance(params.headdim);
  r->stage(stage, params, workspace, static_cast<cudaStream_t>(stream));
}

// ---- KV cache ---------------------------------------------------------------------------------

namespace {

// How many ranges to split each query tile's keys into: none when the CTAs already fill most of
// the GPU; otherwise enough to fill one wave (ctas_per_wave resident CTAs), at most one split per
// key tile and 128 splits, then as few splits as give each the same number of tiles (the
// kernel's ranges, DenseKvCursor::split). Measured on the H100 (bf16, d128, 32 query heads, CUDA
// graphs, per-kernel times from the torch profiler, docs/NOTES.md session 15): with a combine
// of 3-4 us up to 128 splits, the attention kernel is fastest at about one wave: b 1 MQA 32k
// 12.2 / 10.0 / 10.0 us at 64 / 128 / 256 splits, 128k 37.0 / 28.6 / 28.2; GQA 32/8 b 1 8k 15.3 us
// at 32 splits, 17.0 at 64; MHA b 1 8k 47.4 at 8, 50.2 at 16. 256 splits cost 2-7 us more in the
// combine than they save. (Before the combine was rewritten it cost 16 us at 64 splits, 30 at 128,
// and this rule kept >= 4 tiles per split and <= 64 splits.)
// Between half and two thirds of a wave, where a wave holds one split of each CTA, three splits
// fill two waves: measured on the H200 (session 38, BENCHMARKS.md; forced splits, 256 CTAs of
// decoding's tile, wave 396) d64 -4.8..-9.3% on contiguous caches and -8.6..-12.8% on 16-token
// pages, d128 16-token pages -1.4..+1.2% (2 splits, 1.3 waves, were slower than 1). (d64's tile
// counts four per SM since, sm80/mainloop_fwd.h: its 256-CTA calls take 2 splits, one wave.)
// As few splits as give each of `splits` ranges of n_blocks tiles the same number of tiles.
int equal_splits(int splits, int n_blocks) {
  splits = std::max(1, std::min(splits, n_blocks));
  const int tiles_per_split = (n_blocks + splits - 1) / splits;
  return std::max(1, (n_blocks + tiles_per_split - 1) / tiles_per_split);
}
int num_splits_heuristic(int ctas, int ctas_per_wave, int n_blocks) {
  if (ctas >= 0.8f * ctas_per_wave) return 1;
  int splits = ctas_per_wave / std::max(ctas, 1);
  if (splits == 1 && 3 * ctas <= 2 * ctas_per_wave) splits = 3;
  return equal_splits(std::min(splits, 128), n_blocks);
}

// The KV-cache kernel's GQA-packed query rows per sequence with ALiBi: its packed rows' position
// (common/score_mod.h ScoreMod::position) is exact up to there, so no ALiBi call with more is
// packed (unpacked rows are positions, exact at any length).
constexpr int64_t kKvCacheAlibiRows = int64_t(1) << 22;

const KvCacheInstance& pick_kvcache(const FwdParams& params, DType dtype, int arch) {
  const KvCacheInstance* r = pick(kKvCacheInstances, arch, 0, params.headdim, dtype);
  if (r == nullptr) no_instance(params.headdim);
  return *r;
}

// The sm90 decoding kernel (sm90/decode_launch.h): a query tile's splits in one cluster of at
// most kDecodeMaxSplits CTAs, one CTA per SM, its K and V loaded by TMA, a box per tile. It can
// serve the calls of the sm80 decoding tile (no softcap or ALiBi, up to 16 packed query rows)
// whose cache TMA can describe and whose pages (if any) hold whole tiles, with at most a
// cluster's splits forced; flashcute.kernels("sm90") sends it every such
// call. kernels("auto") sends it the calls where it measured faster than the sm80 kernel (H200,
// bf16, d128, 32 query heads, CUDA graphs, BENCHMARKS.md sessions 48 and 49): contiguous caches and
// pages of whole tiles with GQA packing whose query tiles fit one wave of one CTA each and, split,
// fill at least 45% of the SMs (a TMA read streams the full rate from 64 CTAs on the H200's 132
// SMs, scripts/decode_roofline.cu). GQA 32/8 at b 1 8k / 32k / 128k: 14.2 / 36.9 / 125.3 us
// against 15.7 / 38.6 / 127.4, at b 8 8k 66.7 against 68.2; 128-token pages at b 1 8k / 32k /
// 128k 15.1 / 38.4 / 128.0 against 16.7 / 40.2 / 129.4, at b 8 8k 68.7 against 70.2. Not the
// others: MHA at b 1, 32k 145.1 us against 126.4; b 32 (2 waves) 251.5 against 245.5; 16-token
// pages (not served: a TMA box per page, 59.2 against 40.4 at b 1, 32k; nor cp.async copies of
// the rows from the producer warpgroup, 75.4 against 40.5, session 49; nor a box per page with
// the table read a tile ahead, 58.3 against 40.5, session 50).
// FLASHCUTE_SM90_DECODE=0: the sm80 KV-cache kernel for every call (for before/after measurements
// in one build).
constexpr int kDecodeMaxSplits = 8;
bool decode_serves(const FwdParams& p, DType dtype, int device_arch, int requested_splits) {
  if (device_arch != 90 || p.has_score_mod() || requested_splits > kDecodeMaxSplits ||
      int64_t(p.seqlen_q) * p.h_per_kv() > 16 || pick(kKvCacheInstances, 90, device_arch, p.headdim, dtype) == nullptr) {
    return false;
  }
  int block_m = 0, block_n = 0, ctas_per_sm = 0;  // (a tile in one page: its box)
  pick_kvcache(p, dtype, 90).tiles(p, block_m, block_n, ctas_per_sm);
  if (p.block_table != nullptr && p.page_size % block_n != 0) return false;
  const int pages = p.block_table != nullptr ? p.num_pages : p.batch;
  return tma_describes(p.k_stride, p.nheads_kv, pages) && tma_describes(p.v_stride, p.nheads_kv, pages);
}
bool decode_on_sm90(const FwdParams& p, DType dtype, int device_arch, int num_sms, int requested_splits,
                    int pack_gqa) {
  static const bool enabled = [] {
    const char* v = std::getenv("FLASHCUTE_SM90_DECODE");
    return v == nullptr || std::strcmp(v, "0") != 0;
  }();
  const int family = kernel_family();
  if (!enabled || family == 80 || pack_gqa != p.h_per_kv() || !decode_serves(p, dtype, device_arch, requested_splits)) {
    return false;
  }
  if (family == 90) return true;
  if (pack_gqa < 2) return false;
  int block_m = 0, block_n = 0, ctas_per_sm = 0;
  pick_kvcache(p, dtype, 90).tiles(p, block_m, block_n, ctas_per_sm);
  const int n_blocks = (p.seqlen_k + block_n - 1) / block_n;
  const int64_t groups = int64_t(p.batch) * (p.nheads / pack_gqa);
  return groups <= int64_t(ctas_per_sm) * num_sms &&
         groups * std::min(kDecodeMaxSplits, std::max(n_blocks, 1)) >= 0.45 * num_sms;
}

}  // namespace

int kvcache_plan_cuda(FwdParams& params, DType dtype, int device_arch, int num_sms, int requested_splits) {
  // GQA packing: the query heads of a KV head share its tiles. With ALiBi, whose slope and
  // position the kernel finds per packed row (common/score_mod.h ScoreMod::position), only while a
  // sequence has at most kKvCacheAlibiRows of them.
  const bool pack = params.alibi_slopes == nullptr || int64_t(params.seqlen_q) * params.h_per_kv() <= kKvCacheAlibiRows;
  params.pack_gqa = pack ? params.h_per_kv() : 1;
  const int arch = decode_on_sm90(params, dtype, device_arch, num_sms, requested_splits, params.pack_gqa) ? 90 : 80;
  int block_m = 0, block_n = 0, ctas_per_sm = 0;
  pick_kvcache(params, dtype, arch).tiles(params, block_m, block_n, ctas_per_sm);
  const int m_blocks = (params.seqlen_q * params.pack_gqa + block_m - 1) / block_m;
  const int ctas = m_blocks * params.batch * (params.nheads / params.pack_gqa);
  const int n_blocks = (params.seqlen_k + block_n - 1) / block_n;
  if (requested_splits > 0) {
    params.num_splits = std::min(requested_splits, std::max(n_blocks, 1));
  } else if (arch == 90) {
    // As many splits as one wave holds (one CTA per SM), at most a cluster's.
    const int wave = ctas_per_sm * num_sms;
    params.num_splits = ctas >= 0.8f * wave ? 1 : equal_splits(std::min(wave / std::max(ctas, 1), kDecodeMaxSplits), n_blocks);
  } else {
    params.num_splits = num_splits_heuristic(ctas, ctas_per_sm * num_sms, n_blocks);
  }
  return arch;
}

void run_kvcache_cuda(const FwdParams& params, DType dtype, int arch, void* stream) {
  pick_kvcache(params, dtype, arch).run(params, static_cast<cudaStream_t>(stream));
}

// Chunked prefill (many queries against a cache) is compute-bound: on sm90 GPUs the sm90 forward
// (wgmma) serves it, reading a contiguous cache with TMA and bounding each sequence's keys by
// cache_seqlens (SeqlenInfo::with_cache). It has no GQA packing and no split-KV, so
// kernels("auto") sends it only calls whose query rows fill about half the GPU's SMs with
// 128-row tiles: seqlen_q >= 64 and >= 60 rows per SM in all. Measured on the H100 (bf16, d128,
// 32 query heads, causal, 32k cache, CUDA graphs, docs/NOTES.md session 15), sm80 KV-cache
// kernel / sm90 forward time: b 1 seqlen_q 128 0.60 (h_k 32) and 0.57 (h_k 8), 256 1.21 / 1.18,
// 512 1.79 / 1.87, 2048 1.91 / 1.96; b 4 h_k 8 seqlen_q 64 1.05, 128 1.84; decoding (seqlen_q 16,
// 64 at b 1) 0.31-0.51. kernels("sm90") sends it every call it can serve (no forced split);
// paged caches stay on the KV-cache kernel.
bool kvcache_on_sm90_cuda(const FwdParams& params, DType dtype, int device_arch, int num_sms, int requested_splits) {
  const int family = kernel_family();
  if (family == 80 || params.block_table != nullptr || requested_splits > 1 || !sm90_fwd_serves(params, device_arch) ||
      pick(kFwdInstances, 90, device_arch, params.headdim, dtype) == nullptr) {
    return false;
  }
  if (family == 90 && decode_serves(params, dtype, device_arch, requested_splits)) return false;  // the decoding kernel's
  const int64_t rows = int64_t(params.seqlen_q) * params.batch * params.nheads;
  return family == 90 || (params.seqlen_q >= 64 && rows >= 60 * int64_t(num_sms));
}

}  // namespace flashcute
