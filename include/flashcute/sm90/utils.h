// flashcute — helpers of the sm90 kernel family: register-layout views of wgmma accumulators,
// the warpgroup GEMM wrapper, and the mbarrier ring that the TMA producer and the consumer
// warpgroups share.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "flashcute/common/utils.h"

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

  CUTE_DEVICE void init(int consumer_arrivals) {
    CUTE_UNROLL
    for (int s = 0; s < kStages; ++s) {
      cutlass::arch::ClusterTransactionBarrier::init(&full[s], 1);
      cutlass::arch::ClusterBarrier::init(&empty[s], consumer_arrivals);
    }
  }
  static CUTE_DEVICE int stage(int i) { return i % kStages; }
  static CUTE_DEVICE uint32_t parity(int i) { return (i / kStages) & 1; }

  // Producer: wait until use i - kStages of the buffer is released, then arm `full` for `bytes`.
  CUTE_DEVICE uint64_t& acquire(int i, uint32_t bytes) {
    if (i >= kStages) cutlass::arch::ClusterBarrier::wait(&empty[stage(i)], parity(i) ^ 1);
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full[stage(i)], bytes);
    return full[stage(i)];
  }
  // Consumer: wait until use i has landed; release it once read (one thread per warpgroup).
  CUTE_DEVICE void wait_full(int i) { cutlass::arch::ClusterBarrier::wait(&full[stage(i)], parity(i)); }
  CUTE_DEVICE void release(int i, bool signaling_thread) {
    if (signaling_thread) cutlass::arch::ClusterBarrier::arrive(&empty[stage(i)]);
  }
};

}  // namespace flashcute::sm90
