// flashcute — the backward's O(seqlen) stages around either family's main kernel, and the
// workspace they share with it:
//
//   1. flashcute_bwd_preprocess_kernel: D = rowsum(dO * O) - dLSE (times 1 - p with dropout) and
//      L * log2(e) in fp32, padded to whole query blocks; the dQ accumulator cleared.
//   3. flashcute_bwd_convert_dq_kernel: dQ = scale * sum of the accumulator splits (and dropout's
//      1 / (1 - p)), in the input type, read back in the family's dQ thread order.
#pragma once

#include <cute/tensor.hpp>

#include <algorithm>

#include "flashcute/common/scheduler.h"
#include "flashcute/common/seqlen.h"
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"

namespace flashcute {

using namespace cute;

// The fp32 dQ accumulator: (splits, batch, nheads, rows, kernel head dim), and D and L
// (params.dsum, params.lse_log2): (batch, nheads, rows). Padded batches: rows = seqlen_q rounded
// up to 128. Packed batches: batch 1 and rows = total_q + 128 * sequences, rounded up to 128;
// sequence b starts at row (cu_seqlens_q[b] + 128 b) rounded down to 128, so each sequence has
// its own whole blocks and no atomic reaches a neighbour.
// Each (kBlockM, headdim) tile of the accumulator is stored in the main kernel's thread order,
// not row-major, in vectors of V = Traits::kDqAccumVector floats: fragment value i of thread t
// (in the dQ GEMM's accumulator layout, over the N = kNThreadsDq threads that compute dQ) lies at
// (i / V) * N * V + t * V + i % V (dq_accum_thread + dq_accum_value), so that a warp's atomics
// cover contiguous bytes. The sm80 family adds its values with 16-byte atomics on sm90 (V = 4)
// and scalar ones before (V = 1); the sm90 family (V = 4) stages the tile so in shared memory
// (16-byte stores, conflict-free) and adds it with one bulk reduction. The convert kernel,
// compiled for the same arch, reads it back with the same thread layout.
struct DqAccumShape {
  static constexpr int kRowAlign = 128;
  int rows;
  int headdim;
  int batch;
  int nheads;
  bool packed;
  // Offset of the (rows, headdim) slab of one split, sequence and head, at the sequence's first row.
  CUTE_HOST_DEVICE int64_t offset(int split, int b, int h, const SeqlenInfo& s) const {
    return (((int64_t(split) * batch + (packed ? 0 : b)) * nheads + h) * rows + row0(b, s)) * headdim;
  }
  // Offset of the D and L rows of one sequence and head.
  CUTE_HOST_DEVICE int64_t rows_offset(int b, int h, const SeqlenInfo& s) const {
    return (int64_t(packed ? 0 : b) * nheads + h) * rows + row0(b, s);
  }
  CUTE_HOST_DEVICE int row0(int b, const SeqlenInfo& s) const {
    return packed ? (s.q_offset + b * kRowAlign) / kRowAlign * kRowAlign : 0;
  }
};

// Where fragment value i of thread t of N lies in a tile of the dQ accumulator stored in vectors
// of V: at the thread's base t * V plus the value's offset (i / V) * N * V + i % V, a constant.
template <int V>
CUTE_HOST_DEVICE constexpr int dq_accum_thread(int t) {
  return t * V;
}
template <int V, int N>
CUTE_HOST_DEVICE constexpr int dq_accum_value(int i) {
  return (i / V) * N * V + i % V;
}

// The workspace of a call for a family whose main kernel takes kBlockN keys per CTA: rows padded
// to the accumulator's alignment; in deterministic mode enough CTAs to fill the GPU, each owning
// one dQ split (at most 16 splits of memory).
inline BwdWorkspace make_bwd_workspace(const BwdParams& params, int num_sms, int block_n, int headdim) {
  constexpr int kAlign = DqAccumShape::kRowAlign;
  BwdWorkspace ws;
  ws.seqlen_rounded = params.is_varlen() ? ceil_div_int(params.total_q + kAlign * params.batch, kAlign) * kAlign
                                         : ceil_div_int(params.seqlen_q, kAlign) * kAlign;
  ws.headdim = headdim;
  ws.num_splits = 1;
  if (params.deterministic) {
    const int num_n_blocks = ceil_div_int(params.seqlen_k, block_n);
    const int ctas = params.batch * params.nheads_kv;
    ws.num_splits = std::max(1, std::min({num_n_blocks, ceil_div_int(num_sms, std::max(ctas, 1)), 16}));
  }
  return ws;
}

inline DqAccumShape dq_accum_shape(const BwdParams& params, const BwdWorkspace& ws) {
  return {ws.seqlen_rounded, ws.headdim, params.is_varlen() ? 1 : params.batch, params.nheads, params.is_varlen()};
}

// ---- Stage 1: per row, D = rowsum(dO * O) - dLSE and L * log2(e); the dQ accumulator (and the
// persistent backward's tile counter) cleared.
// Each thread takes 8 columns (16-byte loads), kHeadDim / 8 threads (a power of two) per row.
// Rows run to the sequence's length rounded up to 128, so the main loop reads whole blocks
// without checks: rows past seqlen_q, and rows that saw no key in the forward (L = -inf), get
// L = +inf (P = 0) and D = 0.
template <int kHeadDim>
struct PreprocessShape {
  static constexpr int kThreads = 256;
  static constexpr int kThreadsPerRow = kHeadDim <= 32 ? 4 : kHeadDim <= 64 ? 8 : kHeadDim <= 128 ? 16 : 32;
  static constexpr int kRowsPerCta = kThreads / kThreadsPerRow;  // divides 128
  // A 1-D grid over (row block, sequence, head), row blocks fastest.
  static dim3 grid(const FwdParams& p) {
    return dim3(ceil_div_int(p.seqlen_q, DqAccumShape::kRowAlign) * (DqAccumShape::kRowAlign / kRowsPerCta) *
                p.batch * p.nheads);
  }
};

// kFamily (80, 90) names the family whose units instantiate it: each family's units are compiled
// for their own archs, so the two instances must be distinct kernels (one symbol would be
// registered by both units' modules).
template <typename Element, int kHeadDim, int kFamily>
__global__ void __launch_bounds__(PreprocessShape<kHeadDim>::kThreads)
    flashcute_bwd_preprocess_kernel(__grid_constant__ const BwdParams params, DqAccumShape acc, int num_splits) {
  constexpr float kLog2e = 1.4426950408889634f;
  using Shape_ = PreprocessShape<kHeadDim>;
  constexpr int kThreadsPerRow = Shape_::kThreadsPerRow;
  const int row_blocks = gridDim.x / (params.batch * params.nheads);
  const int row = (blockIdx.x % row_blocks) * Shape_::kRowsPerCta + threadIdx.x / kThreadsPerRow;
  const int c = (threadIdx.x % kThreadsPerRow) * 8;
  const int b = (blockIdx.x / row_blocks) % params.batch, h = blockIdx.x / row_blocks / params.batch;
  const SeqlenInfo seqlen(params, b);
  dependents_may_launch();  // the main kernel waits for this one's writes (common/utils.h)
  if (blockIdx.x == 0 && threadIdx.x == 0 && params.tile_counter != nullptr) *params.tile_counter = 0;
  if (row >= ceil_div_int(seqlen.q, DqAccumShape::kRowAlign) * DqAccumShape::kRowAlign) return;

  if (c < kHeadDim) {  // clear this row's columns c .. c+7 in every split
    for (int split = 0; split < num_splits; ++split) {
      float4* dst = reinterpret_cast<float4*>(params.dq_accum + acc.offset(split, b, h, seqlen) +
                                              int64_t(row) * kHeadDim + c);
      dst[0] = dst[1] = float4{0, 0, 0, 0};
    }
  }
  float sum = 0.f;
  if (row < seqlen.q && c < params.headdim) {  // headdim % 8 == 0
    const int64_t r = seqlen.q_offset + row;
    const Element* o = static_cast<const Element*>(params.o) + b * params.o_stride.batch + r * params.o_stride.row +
                       h * params.o_stride.head + c;
    const Element* g = static_cast<const Element*>(params.dout) + b * params.do_stride.batch +
                       r * params.do_stride.row + h * params.do_stride.head + c;
    const cutlass::Array<Element, 8> ov = *reinterpret_cast<const cutlass::Array<Element, 8>*>(o);
    const cutlass::Array<Element, 8> gv = *reinterpret_cast<const cutlass::Array<Element, 8>*>(g);
    CUTE_UNROLL
    for (int e = 0; e < 8; ++e) sum += float(ov[e]) * float(gv[e]);
  }
  CUTE_UNROLL
  for (int off = kThreadsPerRow / 2; off > 0; off /= 2) sum += __shfl_xor_sync(0xffffffff, sum, off);
  if (c == 0) {
    float d = 0.f, l_log2 = INFINITY;
    if (row < seqlen.q) {
      const int64_t idx = seqlen.lse_offset(params, b, h) + row;
      const float l = params.lse[idx];
      d = (sum - (params.dlse ? params.dlse[idx] : 0.f)) * params.dropout_keep;  // dropout: (1 - p) D
      if (l != -INFINITY) l_log2 = l * kLog2e;
    }
    params.dsum[acc.rows_offset(b, h, seqlen) + row] = d;
    params.lse_log2[acc.rows_offset(b, h, seqlen) + row] = l_log2;
  }
}

// ---- Stage 3: dQ = scale * (sum of the accumulator's splits), in the input type. One CTA per
// (query block, sequence, head) with the main kernel's dQ thread layout: each thread reads back
// the fragment values its counterparts added (DqAccumShape), then the tile goes out through
// shared memory as 16-byte rows. Traits (the family's backward traits) name the dQ GEMM
// (TiledMmadQ over kNThreadsDq threads) and the copies: SmemLayoutdQ, SmemCopyAtomdQ (registers ->
// shared), GmemTiledCopydQ (shared -> global).
template <typename Traits>
__global__ void __launch_bounds__(Traits::kNThreadsDq)
    flashcute_bwd_convert_dq_kernel(__grid_constant__ const BwdParams params, DqAccumShape acc, int num_splits) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kHeadDim = Traits::kHeadDim;
  constexpr int kNThreads = Traits::kNThreadsDq;
  __shared__ __align__(128) Element smem[kBlockM * kHeadDim];
  wait_for_previous_grid();  // the main kernel's dQ accumulator
  const int tidx = threadIdx.x;
  const FwdTile tile = SingleTileScheduler<kBlockM, false>::get(params);
  const SeqlenInfo seqlen(params, tile.bidb);
  if (tile.m_block * kBlockM >= seqlen.q) return;

  typename Traits::TiledMmadQ mma_dq;
  Tensor acc_dq = partition_fragment_C(mma_dq, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_dq);
  constexpr int kVector = Traits::kDqAccumVector;
  using Vector = cutlass::AlignedArray<float, kVector>;
  for (int split = 0; split < num_splits; ++split) {
    const float* src = params.dq_accum + acc.offset(split, tile.bidb, tile.bidh, seqlen) +
                       int64_t(tile.m_block) * kBlockM * kHeadDim + dq_accum_thread<kVector>(tidx);
    CUTE_UNROLL
    for (int i = 0; i < size(acc_dq); i += kVector) {
      const Vector v = *reinterpret_cast<const Vector*>(src + dq_accum_value<kVector, kNThreads>(i));
      CUTE_UNROLL
      for (int e = 0; e < kVector; ++e) acc_dq(i + e) += v[e];
    }
  }
  CUTE_UNROLL
  for (int i = 0; i < size(acc_dq); ++i) acc_dq(i) *= params.scale * params.dropout_scale;  // dropout: 1 / (1 - p)
  Tensor rdQ = convert_fragment<Element>(acc_dq);

  Tensor sdQ = make_tensor(make_smem_ptr(smem), typename Traits::SmemLayoutdQ{});
  auto copy_s = make_tiled_copy_C(typename Traits::SmemCopyAtomdQ{}, mma_dq);
  auto thr_s = copy_s.get_thread_slice(tidx);
  copy(copy_s, thr_s.retile_S(rdQ), thr_s.partition_D(sdQ));
  __syncthreads();

  typename Traits::GmemTiledCopydQ gmem_store;
  Tensor tC = gmem_store.get_thread_slice(tidx).partition_D(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor gdQ = local_tile(head_tensor<Element, kHeadDim>(params.dq, params.dq_stride, tile.bidb, tile.bidh, seqlen.q,
                                                         seqlen.q_offset),
                          Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(tile.m_block, 0));
  store_smem_tile(gmem_store, tidx, sdQ, gdQ, tC, column_predicate(tC, params.headdim),
                  seqlen.q - tile.m_block * kBlockM);
}

// ---- Stages 1 and 3 of a family's backward (Traits: its backward traits; kFamily: 80 or 90); the
// family's launcher runs its own main kernel between them.
template <typename Traits, int kFamily>
void launch_bwd_pre_post(BwdStage stage, const BwdParams& params, const BwdWorkspace& ws, cudaStream_t stream) {
  using Element = typename Traits::Element;
  constexpr int kHeadDim = Traits::kHeadDim;
  const DqAccumShape acc = dq_accum_shape(params, ws);
  if (stage == BwdStage::kPreprocess) {
    using Pre = PreprocessShape<kHeadDim>;
    launch_kernel(&flashcute_bwd_preprocess_kernel<Element, kHeadDim, kFamily>, Pre::grid(params), Pre::kThreads, 0,
                  stream, params, acc, ws.num_splits);
  } else {
    launch_kernel_chained(&flashcute_bwd_convert_dq_kernel<Traits>,
                          SingleTileScheduler<Traits::kBlockM, false>::grid(params), Traits::kNThreadsDq, 0, stream,
                          params, acc, ws.num_splits);
  }
}

// The end of the main loop for one key tile: dK = scale dS^T Q; with dropout, dS and P * keep
// lack their 1 / (1 - p) (dropout_scale is 1 without dropout).
template <typename AccDKV>
CUTE_DEVICE void scale_dkv(const BwdParams& params, AccDKV& acc_dk, AccDKV& acc_dv) {
  const float scale_dk = params.scale * params.dropout_scale;
  CUTE_UNROLL
  for (int e = 0; e < size(acc_dk); ++e) {
    acc_dk(e) *= scale_dk;
    acc_dv(e) *= params.dropout_scale;
  }
}

}  // namespace flashcute
