// flashcute — the sm90 forward launcher: the mask policy of the call, the TMA descriptors, the
// kernel's types, grid and shared memory.
#pragma once

#include <algorithm>

#include "flashcute/common/dispatch.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"
#include "flashcute/sm90/epilogue_fwd.h"
#include "flashcute/sm90/fwd_kernel.h"
#include "flashcute/sm90/mainloop_fwd.h"
#include "flashcute/sm90/traits.h"

namespace flashcute::sm90 {

// Persistent CTAs (common/scheduler.h) where each tile's key range is short and the tiles of a
// call have equal work (no packed batch or cache: the hardware's own scheduling balances those),
// or the call is block-sparse (below), and where O has a buffer of its own (Traits::kPersistent).
// Measured on the H100 (bf16, 16k tokens, d64 / d128, against one CTA per tile, alternating
// processes): non-causal seqlen 512 -15% / -7..-9%, 1024 -8..-9% / -4..-5%, 2048 -1..-3% / -2..-3%;
// causal (pairs of query blocks) 512 -17% / -11%, 1024 -12% / -10%, 2048 -8% / -9%. At 4096-16384
// keys the two grids ran within this comparison's noise (two builds of the same code differed by
// up to 6.5% at 4096): the bound is 4096 keys (docs/NOTES.md, session 16; the macro below moves it).
#ifndef FLASHCUTE_SM90_FWD_PERSISTENT_MAX_KEYS
#define FLASHCUTE_SM90_FWD_PERSISTENT_MAX_KEYS 4096
#endif
// The keys a query tile can see: seqlen_k, or the band of a window with both edges.
inline int64_t fwd_key_range(const FwdParams& p, int block_m, int block_n) {
  int64_t keys = p.seqlen_k;
  if (p.window_left >= 0 && p.window_right >= 0) {
    keys = std::min<int64_t>(keys, int64_t(p.window_left) + p.window_right + block_m + block_n);
  }
  return keys;
}
// Block-sparse calls: persistent at any key range, since a tile walks only its listed blocks (at
// 10% density 6 of 64, where one CTA per tile paid its start, Q's and K_0's loads and its epilogue
// for every 6 steps). The static walk c, c + grid, ... takes query blocks far apart (query blocks
// fastest), so lists whose length grows with the query block spread over the CTAs. Measured on
// the H200 against one CTA per tile (d128 bf16, 8192 / 16384 tokens, random lists, alternating
// processes): forward at 10% -13.0 / -5.1% (causal -12.4 / -3.1%), 25% -5.6 / -1.9% (-7.8 /
// -0.9%), 50% -4.9 / -0.2% (-2.4 / +2.2%); forward + backward -3.1..+0.7% (docs/NOTES.md, session
// 37). The macro at 0 restores one CTA per tile.
#ifndef FLASHCUTE_SM90_FWD_PERSISTENT_SPARSE
#define FLASHCUTE_SM90_FWD_PERSISTENT_SPARSE 1
#endif
template <typename Traits>
bool persistent_fwd(const FwdParams& p) {
  const bool short_range =
      fwd_key_range(p, Traits::kBlockM, Traits::kBlockN) <= FLASHCUTE_SM90_FWD_PERSISTENT_MAX_KEYS;
  return Traits::kPersistent && !p.is_varlen() && p.cache_seqlens == nullptr &&
         (p.sparse.enabled() ? FLASHCUTE_SM90_FWD_PERSISTENT_SPARSE != 0 : short_range);
}

template <typename Traits, typename Mask, bool kFeatures>
void launch_fwd_kernel(const FwdParams& params, cudaStream_t stream) {
  check_sparse_tiles(params.sparse, Traits::kBlockM, Traits::kBlockN);
  using Mainloop = MainloopFwd<Traits, Mask, kFeatures>;
  using Scheduler = PersistentTileScheduler<Traits::kBlockM, Mask::kWindow>;
  FwdParams p = params;
  if (!persistent_fwd<Traits>(p)) p.num_sms = 0;  // one CTA per tile
  launch_kernel(&flashcute_fwd_kernel<Mainloop, EpilogueFwd<Traits>, Scheduler>, Scheduler::grid(p),
                Traits::kNThreads, int(sizeof(typename Mainloop::SharedStorage)), stream, Mainloop::to_params(p),
                Scheduler::divmods(p));
}

// Plain calls (no dropout, softcap or ALiBi) run a twin of each kernel without the features' code.
// With it, the features' run-time branches split the step loop into blocks, and ptxas placed the
// wait for O += P V right after the wait for S, before the softmax (docs/NOTES.md, sessions 44-45);
// without it the softmax runs between the two waits, under the PV GEMM, and the loop is shorter
// (d64 192-row dense kernel: 3880 -> 2192 SASS instructions). Measured on the H200 against kernels
// with the features' code (bf16, 16k tokens, 3 alternating rounds; BENCHMARKS.md "sm90 forward,
// session 45"): d64 causal 512-4096 tokens -4.0..-4.8%, d128 causal -2.6..-4.5%, d128 non-causal
// 512-4096 -1.5..-3.7%, d64 non-causal -2.3..+1.5%, d64 causal 8k-16k -0.5 / -0.9%; windowed and
// block-sparse calls -1.1..-7.6%. (d64's 192-row kernel with a window's left edge had no twin until
// session 47: it spilled 140/164 bytes without the features' code. Since its mask is one bit mask
// per row (common/mask.h apply_wgmma_rows) neither spills, and the twin runs d64 windows over 4096
// keys 3.4-4.4% faster on the H200: (4095, 0) and (2048, 2048) over 8k / 16k tokens, 3 alternating
// rounds; BENCHMARKS.md "sm90 forward, session 47".) Each forward unit compiles one more kernel per
// mask policy and tile (d192 / d256: for their block-sparse kernels only, run_fwd). kPlainCalls:
// whether plain calls reach this launch at all (else it needs no twin).
template <typename Traits, typename Mask, bool kPlainCalls = true>
void launch_fwd(const FwdParams& params, cudaStream_t stream) {
  constexpr bool kFeatureTile = Traits::kBlockN % 32 == 0;  // (else a tile of plain calls only)
  constexpr bool kTwin = kFeatureTile && kPlainCalls;
  if constexpr (kTwin) {
    if (params.is_plain()) {
      launch_fwd_kernel<Traits, Mask, false>(params, stream);
      return;
    }
  }
  launch_fwd_kernel<Traits, Mask, kFeatureTile>(params, stream);
}

// Query rows per tile. d <= 64: 192 (three consumer warpgroups, FlashAttention-3's d64 tile) for
// dense calls, and for causal or windowed ones whose key range is long; 128 for block-sparse
// calls (their blocks are 128 rows) and for short causal or windowed ones, where a taller tile
// computes more of the masked triangle. Measured on the H100 (bf16, 16k tokens, d64, 192 against
// 128 rows, alternating processes): non-causal 2048-16384 -5..-11%, 512-1024 -3..+0.5%; causal
// 512-2048 +21..27% (hence 128 there), 4096-16384 -3..-8% (docs/NOTES.md, session 20).
#ifndef FLASHCUTE_SM90_FWD_TALL_BLOCK_M
#define FLASHCUTE_SM90_FWD_TALL_BLOCK_M 192
#endif
// Keys per step for plain calls (no dropout, softcap or ALiBi; not block-sparse, whose blocks are
// multiples of FwdConfig's tiles): FlashAttention-3's wider tiles, one wgmma per k-step with
// CuTe's extended shapes (cmake/instantiations.cmake defines them for these head dims). d128: 176
// for dense calls over 4096 keys (causal calls keep 128, FA3's causal tile; shorter ones the
// persistent kernel, whose own O buffer 176 keys leave no shared memory for: key ranges that
// FwdConfig's tile runs persistent stay on it); d192 112 and d256
// 80 for dense and windowed calls. These key counts are not multiples of 32, dropout's draw
// blocks: their kernels have no feature code (MainloopFwd::kFeatures) and calls with features
// keep FwdConfig's tile. Measured on the H100 against FwdConfig's tile (bf16, 16k tokens,
// alternating processes; docs/NOTES.md, session 23): d128 non-causal 8k / 16k -3.4 / -3.6%;
// d192 1024-16384 -3.2..-5.2% (non-causal), -1.8..-5.3% (causal); d256 -8.7..-12.2% and
// -4.4..-12.2%. A macro equal to FwdConfig's tile turns its head dim's plain kernels off.
#ifndef FLASHCUTE_SM90_FWD_PLAIN_BLOCK_N_D128
#define FLASHCUTE_SM90_FWD_PLAIN_BLOCK_N_D128 176
#endif
#ifndef FLASHCUTE_SM90_FWD_PLAIN_BLOCK_N_D192
#define FLASHCUTE_SM90_FWD_PLAIN_BLOCK_N_D192 112
#endif
#ifndef FLASHCUTE_SM90_FWD_PLAIN_BLOCK_N_D256
#define FLASHCUTE_SM90_FWD_PLAIN_BLOCK_N_D256 80
#endif
template <int kHeadDim, bool kWindow>
constexpr int plain_block_n() {  // 0: FwdConfig's
  return kHeadDim == 128   ? (kWindow ? 0 : FLASHCUTE_SM90_FWD_PLAIN_BLOCK_N_D128)
         : kHeadDim == 192 ? FLASHCUTE_SM90_FWD_PLAIN_BLOCK_N_D192
         : kHeadDim == 256 ? FLASHCUTE_SM90_FWD_PLAIN_BLOCK_N_D256
                           : 0;
}
template <typename Element, int kHeadDim>
void run_fwd(const FwdParams& params, cudaStream_t stream) {
  with_mask_policy<CausalMask>(params, [&](auto mask) {
    using Mask = typename decltype(mask)::type;
    using Short = typename FwdConfig<kHeadDim, Element>::Traits;
    if constexpr (kHeadDim > 64 || Mask::kSparse || FLASHCUTE_SM90_FWD_TALL_BLOCK_M == Short::kBlockM) {
      using Plain = typename FwdConfig<kHeadDim, Element, 128, plain_block_n<kHeadDim, Mask::kWindow>()>::Traits;
      if constexpr (Plain::kBlockN != Short::kBlockN && !Mask::kSparse) {
        // (Key ranges the persistent Short kernel takes stay on it.)
        const bool short_range = Short::kPersistent && fwd_key_range(params, Short::kBlockM, Short::kBlockN) <=
                                                           FLASHCUTE_SM90_FWD_PERSISTENT_MAX_KEYS;
        if (params.is_plain() && !short_range) {
          launch_fwd<Plain, Mask>(params, stream);
          return;
        }
      }
      // Every plain call took Plain above where Short is not persistent (d192, d256: no key range
      // stays on it), but for block-sparse ones.
      constexpr bool kPlainOnShort = Plain::kBlockN == Short::kBlockN || Mask::kSparse || Short::kPersistent;
      launch_fwd<Short, Mask, kPlainOnShort>(params, stream);
    } else {
      using Tall = typename FwdConfig<kHeadDim, Element, FLASHCUTE_SM90_FWD_TALL_BLOCK_M>::Traits;
      // (Two launch sites of Tall: folding them into one run-time test would instantiate the
      // 128-row dense kernel, which no call runs.)
      if constexpr (!Mask::kWindow) {
        launch_fwd<Tall, Mask>(params, stream);
      } else if (fwd_key_range(params, Short::kBlockM, Short::kBlockN) > FLASHCUTE_SM90_FWD_PERSISTENT_MAX_KEYS) {
        launch_fwd<Tall, Mask>(params, stream);
      } else {
        launch_fwd<Short, Mask>(params, stream);
      }
    }
  });
}

}  // namespace flashcute::sm90
