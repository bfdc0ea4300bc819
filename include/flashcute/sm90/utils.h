// flashcute — helpers of the sm90 kernel family: register-layout views of wgmma accumulators,
// the warpgroup GEMM wrapper, the mbarrier ring that the TMA producer and the consumer
// warpgroups share, global tensors as TMA sees them, and bulk reductions.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flashcute/common/utils.h"
#include "flashcute/params.h"

namespace flashcute::sm90 {

using namespace cute;

// ---- Register-layout views of a wgmma (m64nNk16) accumulator -------------------------
// A fragment is ((2 cols, 2 rows, N / 8), MMA_M, MMA_N). As (rows, cols): rows = (2, MMA_M),
// cols = (2, N / 8, MMA_N); the 4 threads of a quad share a row, as in mma.sync's layout, so
// the common softmax and mask work on it unchanged.
template <typename Layout>
CUTE_HOST_DEVICE constexpr auto acc_rowcol(Layout acc) {
  static_assert(decltype(rank<0>(acc))::value == 3, "a wgmma accumulator has a ((2, 2, N/8), M, N) layout");
  return make_layout(make_layout(get<0, 1>(acc), get<1>(acc)), make_layout(get<0, 0>(acc), get<0, 2>(acc), get<2>(acc)));
}

// The same accumulator (16-bit after conversion) as the register A operand of the next wgmma
// (P in O += P V): ((2, 2, N / 8), MMA_M, MMA_N) -> ((2, 2, 2), MMA_M, (N / 16, MMA_N)).
template <typename Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_A(Layout acc) {
  auto l = logical_divide(get<0, 2>(acc), Tile<_2>{});  // ((2, N / 16))
  return make_layout(make_layout(get<0, 0>(acc), get<0, 1>(acc), get<0, 0>(l)), get<1>(acc),
                     coalesce(make_layout(get<0, 1>(l), get<2>(acc))));
}

// ---- Accumulator -> shared memory, converting one copy atom at a time ----------------------
// src: an fp32 accumulator retiled for tiled_copy ((CPY), CPY_M, CPY_N); dst: its shared-memory
// partition. Each atom's values are converted just before its store, so no 16-bit copy of the
// whole tile sits in registers beside the live accumulators (at d64 with 128-row steps that copy
// made the backward spill).
// kRelu: stores max(x, 0) (one cvt.relu instruction per pair; dropout's marked P).
template <bool kRelu = false, typename TiledCopy, typename TS, typename TD>
CUTE_DEVICE void store_converted(TiledCopy const& tiled_copy, TS const& src, TD&& dst) {
  using To = typename std::decay_t<TD>::value_type;
  constexpr int kVals = decltype(size<0>(src))::value;
  static_assert(kVals % 2 == 0);
  cutlass::NumericArrayConverter<To, float, 2> convert;
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    CUTE_UNROLL
    for (int n = 0; n < size<2>(src); ++n) {
      Tensor chunk = make_fragment_like<To>(src(_, m, n));  // the atoms' (nested) shape
      CUTE_UNROLL
      for (int e = 0; e < kVals; e += 2) {
        cutlass::Array<To, 2> pair = kRelu ? convert_pair_relu<To>(src(e, m, n), src(e + 1, m, n))
                                           : convert(cutlass::Array<float, 2>{src(e, m, n), src(e + 1, m, n)});
        chunk(e) = pair[0];
        chunk(e + 1) = pair[1];
      }
      copy(tiled_copy, chunk, dst(_, m, n));
    }
  }
}

// ---- Warpgroup GEMM ----------------------------------------------------------------------
// acc (+)= A B over the k blocks, issued asynchronously by the warpgroup; kWait >= 0 waits until
// at most kWait batches are in flight, -1 returns at once (the caller waits later). A is a smem
// descriptor (SS) or a register fragment (RS); the fences keep the compiler from touching the
// registers a running wgmma reads or writes.
template <bool kZeroInit, int kWait, typename TiledMma, typename TA, typename TB, typename TC>
CUTE_DEVICE void gemm(TiledMma& tiled_mma, TA const& tA, TB const& tB, TC& tC) {
  constexpr bool kIsRS = !cute::is_base_of<GMMA::DescriptorIterator, typename TiledMma::FrgTypeA>::value;
  if constexpr (kIsRS) warpgroup_fence_operand(const_cast<TA&>(tA));
  warpgroup_fence_operand(tC);
  warpgroup_arrive();
  if constexpr (kZeroInit) tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(tA); ++k) {
    cute::gemm(tiled_mma, tA(_, _, k), tB(_, _, k), tC);
    tiled_mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  if constexpr (kWait >= 0) warpgroup_wait<kWait>();
  warpgroup_fence_operand(tC);
  if constexpr (kIsRS) warpgroup_fence_operand(const_cast<TA&>(tA));
}

// ---- The stage ring between the TMA producer and the consumer warpgroups ----------------
// kStages buffers, each with a "full" transaction barrier (the producer arms it with the bytes
// its TMA copies will deliver) and an "empty" barrier (one arrival per consumer warpgroup once
// its GEMMs have read the buffer). Use i of a buffer (i = 0, 1, ...) lives in stage i % kStages
// with phase parity (i / kStages) & 1.
template <int kStages>
struct StageRing {
  uint64_t full[kStages];
  uint64_t empty[kStages];

  // producer_arrivals: the arming arrival (acquire) and any arrivals of threads that fill part of
  // a stage with ordinary stores (fill_done).
  CUTE_DEVICE void init(int consumer_arrivals, int producer_arrivals = 1) {
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full[s], producer_arrivals);
      cutlass::arch::ClusterBarrier::init(&empty[s], consumer_arrivals);
    }
  }
  static CUTE_DEVICE int stage(int i) { return i % kStages; }
  static CUTE_DEVICE uint32_t parity(int i) { return (i / kStages) & 1; }

  // Producer: wait until use i - kStages of the buffer is released (wait_empty), then arm `full`
  // for `bytes` of TMA copies (acquire). Threads that fill part of the stage with ordinary stores
  // wait_empty, store, then arrive (fill_done: release semantics).
  CUTE_DEVICE void wait_empty(int i) {
    if (i >= kStages) cutlass::arch::ClusterBarrier::wait(&empty[stage(i)], parity(i) ^ 1);
  }
  CUTE_DEVICE uint64_t& acquire(int i, uint32_t bytes) {
    wait_empty(i);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full[stage(i)], bytes);
    return full[stage(i)];
  }
  CUTE_DEVICE void fill_done(int i) { cutlass::arch::ClusterBarrier::arrive(&full[stage(i)]); }
  // Consumer: wait until use i has landed; release it once read (consumer_arrivals signaling
  // threads in all).
  CUTE_DEVICE void wait_full(int i) { cutlass::arch::ClusterBarrier::wait(&full[stage(i)], parity(i)); }
  CUTE_DEVICE void release(int i, bool signaling_thread) {
    if (signaling_thread) cutlass::arch::ClusterBarrier::arrive(&empty[stage(i)]);
  }
};

// ---- Global tensors as TMA sees them --------------------------------------------------------
// A (batch, rows, heads, headdim) tensor as (rows, headdim, heads, batch) with a unit head-dim
// stride; packed batches pass batch 1. A dimension of extent 1 may carry any stride in torch; TMA
// wants a positive one.
template <typename Element>
auto tma_gmem_tensor(const void* ptr, Strides s, int rows, int headdim, int heads, int batch) {
  const int64_t head_stride = heads == 1 ? s.row : s.head;
  const int64_t batch_stride = batch == 1 ? int64_t(rows) * s.row : s.batch;
  return make_tensor(make_gmem_ptr(static_cast<Element const*>(ptr)), make_shape(rows, headdim, heads, batch),
                     make_stride(s.row, _1{}, head_stride, batch_stride));
}

// ---- Bulk (non-tensor) reductions --------------------------------------------------------------
// dst[0 .. bytes / 4) += src[...] in fp32, shared -> global, by the TMA unit (16-byte aligned,
// bytes a multiple of 16); the issuing thread commits it as a bulk group.
CUTE_DEVICE void bulk_reduce_add_f32(float* dst, const float* src, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
               :
               : "l"(dst), "r"(cute::cast_smem_ptr_to_uint(src)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
#endif
}
// Waits until the issuing thread's bulk groups have completed (their global writes done, not only
// their shared-memory reads: later reductions to the same addresses then apply in order).
CUTE_DEVICE void bulk_wait_all() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#endif
}

}  // namespace flashcute::sm90
