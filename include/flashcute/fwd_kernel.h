// flashcute — the forward kernel: FlashAttention-2, Algorithm 1.
//
// One CTA computes one block of kBlockM query rows of one (batch, head). Its warps split
// the rows (each warp owns whole rows of S), so the softmax stays inside a warp. The CTA
// walks the key/value blocks its mask policy lists (dense: last to first; block-sparse: the
// listed blocks), keeping O, the row max m and the row sum l in registers:
//
//   for each key block j:   S = Q K_j^T            (tensor cores, operands via ldmatrix)
//                           mask S                 (the policy; only on boundary blocks)
//                           m' = max(m, rowmax S); P = exp2(S - m'); l = l e^(m-m') + rowsum P
//                           O = O e^(m-m') + P V_j
//   O /= l; L = m + log l.
//
// K_j and V_j come from global memory by cp.async into swizzled shared memory; V_j's load
// overlaps S = Q K_j^T, and the next K block's load overlaps O += P V_j.
#pragma once

#include <cute/tensor.hpp>

#include "kernel_traits.h"
#include "mask.h"
#include "params.h"
#include "softmax.h"
#include "utils.h"

namespace flashcute {

using namespace cute;

template <typename Traits, typename MaskPolicy>
__global__ void __launch_bounds__(Traits::kNThreads) flashcute_fwd_kernel(const FwdParams params) {
  using Element = typename Traits::Element;
  constexpr int kBlockM = Traits::kBlockM;
  constexpr int kBlockN = Traits::kBlockN;
  constexpr int kHeadDim = Traits::kHeadDim;

  extern __shared__ __align__(128) char smem[];
  const int tidx = threadIdx.x;
  // A 1-D grid over (query block, batch, head), query blocks fastest (any batch and head count).
  // Causal: the longest query blocks (most keys) start first, so the short ones fill the tail.
  const int num_m_blocks = ceil_div(params.seqlen_q, kBlockM);
  const int m_idx = blockIdx.x % num_m_blocks;
  const int m_block = MaskPolicy::kCausal ? num_m_blocks - 1 - m_idx : m_idx;
  const int bidb = (blockIdx.x / num_m_blocks) % params.batch;
  const int bidh = blockIdx.x / num_m_blocks / params.batch;
  const int bidh_kv = bidh / (params.nheads / params.nheads_kv);

  const MaskPolicy mask(params, kBlockM, kBlockN);
  auto kv = mask.kv_cursor(bidb, bidh, m_block);  // the walk over the key blocks to visit
  const int rows_left = params.seqlen_q - m_block * kBlockM;

  // ---- Global tensors of this (batch, head): (seqlen, kHeadDim) with a unit last stride.
  auto gmem = [&](const void* base, Strides s, int head, int seqlen) {
    return head_tensor<Element, kHeadDim>(base, s, bidb, head, seqlen);
  };

  Tensor mQ = gmem(params.q, params.q_stride, bidh, params.seqlen_q);
  Tensor mK = gmem(params.k, params.k_stride, bidh_kv, params.seqlen_k);
  Tensor mV = gmem(params.v, params.v_stride, bidh_kv, params.seqlen_k);
  Tensor mO = gmem(params.o, params.o_stride, bidh, params.seqlen_q);
  Tensor gQ = local_tile(mQ, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gO = local_tile(mO, Shape<Int<kBlockM>, Int<kHeadDim>>{}, make_coord(m_block, 0));
  Tensor gK = local_tile(mK, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));  // (N, D, n_blocks)
  Tensor gV = local_tile(mV, Shape<Int<kBlockN>, Int<kHeadDim>>{}, make_coord(_, 0));
  float* lse_row0 = params.lse + (int64_t(bidb) * params.nheads + bidh) * params.seqlen_q + m_block * kBlockM;

  // ---- Shared memory: Q, K, V tiles; V^T is a view of sV; O reuses sQ.
  Tensor sQ = make_tensor(make_smem_ptr(reinterpret_cast<Element*>(smem)), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(sQ.data() + size(sQ), typename Traits::SmemLayoutKV{});
  Tensor sV = make_tensor(sK.data() + size(sK), typename Traits::SmemLayoutKV{});
  Tensor sVt = make_tensor(sV.data(), typename Traits::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(sV.data().get(), typename Traits::SmemLayoutVtNoSwizzle{});
  Tensor sO = make_tensor(sQ.data(), typename Traits::SmemLayoutO{});

  // ---- Global -> shared copies, predicated on seqlen (rows) and headdim (columns).
  typename Traits::GmemTiledCopyQKV gmem_copy;
  auto gmem_thr = gmem_copy.get_thread_slice(tidx);
  Tensor tQgQ = gmem_thr.partition_S(gQ);
  Tensor tQsQ = gmem_thr.partition_D(sQ);
  Tensor tKgK = gmem_thr.partition_S(gK);  // (CPY, CPY_N, CPY_K, n_blocks)
  Tensor tKsK = gmem_thr.partition_D(sK);
  Tensor tVgV = gmem_thr.partition_S(gV);
  Tensor tVsV = gmem_thr.partition_D(sV);
  Tensor tQcQ = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor tKcK = gmem_thr.partition_S(make_identity_tensor(Shape<Int<kBlockN>, Int<kHeadDim>>{}));
  Tensor col_ok = make_tensor<bool>(make_shape(size<2>(tQsQ)));  // same columns for Q, K, V, O
  CUTE_UNROLL
  for (int k = 0; k < size(col_ok); ++k) col_ok(k) = get<1>(tQcQ(0, 0, k)) < params.headdim;

  // ---- The tiled MMA and its register fragments.
  typename Traits::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tidx);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);

  // Shared -> register copies: ldmatrix for Q and K, transposing ldmatrix for V^T.
  auto smem_copy_q = make_tiled_copy_A(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_q = smem_copy_q.get_thread_slice(tidx);
  Tensor tSsQ = smem_thr_q.partition_S(sQ);
  auto smem_copy_k = make_tiled_copy_B(typename Traits::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_k = smem_copy_k.get_thread_slice(tidx);
  Tensor tSsK = smem_thr_k.partition_S(sK);
  auto smem_copy_v = make_tiled_copy_B(typename Traits::SmemCopyAtomT{}, tiled_mma);
  auto smem_thr_v = smem_copy_v.get_thread_slice(tidx);
  Tensor tOsVt = smem_thr_v.partition_S(sVt);

  // (row, col) of each accumulator element of S and O inside its tile, as (rows, cols) views.
  Tensor tScS = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{}));
  Tensor cS = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
  Tensor tOcO = thr_mma.partition_C(make_identity_tensor(Shape<Int<kBlockM>, Int<kHeadDim>>{}));
  Tensor cO = make_tensor(tOcO.data(), acc_rowcol(tOcO.layout()));
  Tensor o_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));

  constexpr int kRows = decltype(size<0>(o_rc))::value;
  OnlineSoftmax<kRows> softmax;

  if (kv.valid()) {
    // ---- Prologue: Q and the first K block in flight.
    copy_tile</*kCheckRows=*/true>(gmem_copy, tQgQ, tQsQ, tQcQ, col_ok, rows_left);
    copy_tile<true>(gmem_copy, tKgK(_, _, _, kv.tile()), tKsK, tKcK, col_ok,
                    params.seqlen_k - kv.tile() * kBlockN);
    cp_async_fence();

    // ---- One step of the main loop, on key block n_block; n_next: the next one (-1: none).
    auto step = [&](int n_block, int n_next, auto is_first, auto is_masked) __attribute__((always_inline)) {
      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      cp_async_wait<0>();
      __syncthreads();  // K_j has landed; every warp is done with V of the previous step

      // V_j's load overlaps S = Q K_j^T. A partial block (at seqlen_k: dense, the first one; in
      // any case a masked one) has its rows past seqlen_k zero-filled (P is 0 there, and
      // 0 * garbage could be NaN).
      constexpr bool kCheckRowsV =
          MaskPolicy::kPartialTileFirst ? decltype(is_first)::value : decltype(is_masked)::value;
      copy_tile<kCheckRowsV>(gmem_copy, tVgV(_, _, _, n_block), tVsV, tKcK, col_ok,
                             params.seqlen_k - n_block * kBlockN);
      cp_async_fence();

      // S = Q K_j^T, then the mask policy on blocks that hold masked scores.
      gemm_ss(tiled_mma, acc_s, tSrQ, tSrK, tSsQ, tSsK, smem_copy_q, smem_copy_k, smem_thr_q, smem_thr_k);
      Tensor s_rc = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      if constexpr (decltype(is_masked)::value) mask.apply(s_rc, cS, m_block * kBlockM, n_block * kBlockN);

      cp_async_wait<0>();
      __syncthreads();  // V_j has landed; every warp is done with K_j
      // The next K block's load overlaps the softmax and O += P V_j.
      if (n_next >= 0) {
        const int rows_next = params.seqlen_k - n_next * kBlockN;
        if (!MaskPolicy::kPartialTileFirst && rows_next < kBlockN) {
          copy_tile<true>(gmem_copy, tKgK(_, _, _, n_next), tKsK, tKcK, col_ok, rows_next);
        } else {
          copy_tile<false>(gmem_copy, tKgK(_, _, _, n_next), tKsK, tKcK, col_ok, kBlockN);
        }
        cp_async_fence();
      }

      // Online softmax: m, l and O rescaled; S becomes P.
      softmax.template step<decltype(is_first)::value>(s_rc, o_rc, params.scale_log2);

      // O += P V_j, P converted to the input type in registers and used as the A operand.
      Tensor rP = convert_fragment<Element>(acc_s);
      Tensor tOrP = make_tensor(rP.data(), acc_as_A(rP.layout()));
      gemm_rs(tiled_mma, acc_o, tOrP, tOrVt, tOsVt, smem_copy_v, smem_thr_v);
    };

    // ---- Main loop over the key blocks the policy lists, in runs of blocks with masked scores
    // and runs without. Dense (one run each), the blocks come last to first, so the masked
    // ones (at seqlen_k, on the causal diagonal) come first; block-sparse, runs can alternate.
    step(kv.tile(), kv.next_tile(), /*is_first=*/cute::true_type{}, /*is_masked=*/cute::true_type{});
    kv.advance();
    while (kv.valid()) {
      if constexpr (MaskPolicy::kMasksBeyondFirstTile) {
        CUTE_NO_UNROLL
        for (; kv.valid() && mask.needs_mask(m_block, kv.tile()); kv.advance()) {
          step(kv.tile(), kv.next_tile(), cute::false_type{}, cute::true_type{});
        }
      }
      CUTE_NO_UNROLL
      for (; kv.valid() && !(MaskPolicy::kSparse && mask.needs_mask(m_block, kv.tile())); kv.advance()) {
        step(kv.tile(), kv.next_tile(), cute::false_type{}, cute::false_type{});
      }
    }
  }

  // ---- Epilogue: O /= l, L = m + log l (rows with no key: O = 0, L = -inf).
  float lse[kRows];
  softmax.finalize(o_rc, params.scale, lse);

  // LSE: the thread holding column 0 of a row writes it.
  if (get<1>(cO(0, 0)) == 0) {
    CUTE_UNROLL
    for (int i = 0; i < kRows; ++i) {
      const int row = get<0>(cO(i, 0));
      if (row < rows_left) lse_row0[row] = lse[i];
    }
  }

  // O: registers -> shared (sQ's space; each warp rewrites only its own rows of sQ, which
  // only it has read) -> global with 16-byte stores.
  Tensor rO = convert_fragment<Element>(acc_o);
  auto smem_copy_o = make_tiled_copy_C(typename Traits::SmemCopyAtomO{}, tiled_mma);
  auto smem_thr_o = smem_copy_o.get_thread_slice(tidx);
  copy(smem_copy_o, smem_thr_o.retile_S(rO), smem_thr_o.partition_D(sO));
  __syncthreads();

  store_smem_tile(typename Traits::GmemTiledCopyO{}, tidx, sO, gO, tQcQ, col_ok, rows_left);
}

}  // namespace flashcute
