// flashcute — host-side compile-time dispatch: the run-time features of a call turned into the
// template flags of its kernels (both families). Each flag doubles the instances of a unit, so
// only the ones that pay for themselves in speed are flags (common/mask.h says why these do).
#pragma once

#include <type_traits>

#include "flashcute/common/mask.h"
#include "flashcute/params.h"

namespace flashcute {

template <typename Fn>
decltype(auto) dispatch_bool(bool c, Fn&& fn) {
  return c ? fn(std::true_type{}) : fn(std::false_type{});
}

// Calls without a window or causal mask have kernels of their own (AttentionMask<false, ...>: no
// window arithmetic), unless the build drops them (CMake FLASHCUTE_DENSE_KERNELS=OFF defines
// FLASHCUTE_NO_DENSE_KERNELS): such calls then run the windowed kernels with L = R = -1, half the
// plain calls' mask variants, and 1-2% slower dense calls (H100, d64/d128, both families,
// 2026-11-23; README "Build time"). Calls with features always do (with_policies).
#ifdef FLASHCUTE_NO_DENSE_KERNELS
inline constexpr bool kDenseKernels = false;
#else
inline constexpr bool kDenseKernels = true;
#endif

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(std::bool_constant<window>{}): AttentionMask's kWindow for a call (always true in a
// build without the dense kernels).
template <typename Fn>
void dispatch_window(const FwdParams& p, Fn&& fn) {
  if constexpr (kDenseKernels) {
    dispatch_bool(p.has_window(), fn);
  } else {
    fn(std::true_type{});
  }
}

// Block-sparse calls without a window or causal mask have kernels of their own too (no window
// arithmetic: such calls 2.3% (sm90, median) and 3-5% (sm80 forward) faster, H100, 2026-11-23),
// unless the build drops them (CMake FLASHCUTE_UNWINDOWED_SPARSE_KERNELS=OFF defines
// FLASHCUTE_NO_UNWINDOWED_SPARSE_KERNELS; a build without the dense kernels drops them too): such
// calls then run the windowed block-sparse kernels with L = R = -1, three mask variants instead
// of four for plain calls (README "Build time").
#ifdef FLASHCUTE_NO_UNWINDOWED_SPARSE_KERNELS
inline constexpr bool kUnwindowedSparseKernels = false;
#else
inline constexpr bool kUnwindowedSparseKernels = kDenseKernels;
#endif

// Plain causal calls without a block-sparse list have kernels of their own where the launcher names
// one (with_mask_policy's Causal), unless the build drops them (CMake FLASHCUTE_CAUSAL_KERNELS=OFF
// defines FLASHCUTE_NO_CAUSAL_KERNELS; a build without the dense kernels drops them too): such calls
// then run the windowed kernels with (L, R) = (-1, 0).
// - CausalMask (the forwards of both families): the window (-1, 0) at compile time, no left edge's
//   code. Measured against the windowed kernels (H200, bf16, 16k tokens, alternating processes;
//   BENCHMARKS.md "Causal kernels"): the sm90 forward d64 512-2048 tokens 4.2-5.9% faster (its
//   192-row windowed kernel spilled 96/108 bytes then, the causal one none), the sm80 forward d128
//   3.3-7.0%; the sm90 forward d128 and the sm80 forward d64 within +-1.6%.
// - PaddedCausalMask (the sm80 backward; padded batches only, packed ones keep the windowed
//   kernel): the same, and the sequence bounds params' (kVarlen = false). With run-time
//   bounds the causal backward kernels ran within -0.9..+0.7% of the windowed ones (session 29);
//   with both, the d64 kernel spills 28/28 bytes instead of 104/112 (as before the restructure)
//   and its prologue is 200 instructions shorter (ncu), d128 60/84 instead of 72/116. Against the
//   windowed kernel (H200, bf16, 16k tokens, 2 alternating rounds; docs/NOTES.md, session 31):
//   causal backward d64 -2.6 / -1.8% at 512 / 1024 tokens, d128 -0.4..-1.5%, 8k-16k within +-0.1%
//   at d64; forward + backward -0.2..-1.9%.
// - The sm90 backward has none: its d64 causal kernel spilled 136/168 bytes against 68/76 (ptxas).
#ifdef FLASHCUTE_NO_CAUSAL_KERNELS
inline constexpr bool kCausalKernels = false;
#else
inline constexpr bool kCausalKernels = kDenseKernels;
#endif
using CausalMask = AttentionMask<true, false, false, /*kLeftEdge=*/false>;
struct PaddedCausalMask : CausalMask {
  static constexpr bool kVarlen = false;  // padded batches only
  using CausalMask::CausalMask;
  static CUTE_DEVICE SeqlenInfo seqlen(const FwdParams& p, int) { return SeqlenInfo::padded(p); }
};

// Calls fn(TypeTag<mask policy>{}) for the mask policy of a call: AttentionMask<window, sparse>, or
// Causal (CausalMask, PaddedCausalMask, or void: the launcher has no causal kernels). (The causal
// test stands outside the generic lambda: nvcc 13.0's front end instantiated the discarded branch of
// an `if constexpr` inside it, so launchers without causal kernels and an OFF build compiled them
// anyway; g++ did not. Here a launcher without them would not compile: TypeTag<void>.)
template <typename Causal, typename Fn>
void with_mask_policy(const FwdParams& p, Fn&& fn) {
  if constexpr (kCausalKernels && !std::is_void_v<Causal>) {
    if (!p.sparse.enabled() && p.window_left < 0 && p.window_right == 0 && (Causal::kVarlen || !p.is_varlen())) {
      fn(TypeTag<Causal>{});
      return;
    }
  }
  dispatch_bool(p.sparse.enabled(), [&](auto sparse) {
    constexpr bool kSparse = decltype(sparse)::value;
    if constexpr (kSparse && !kUnwindowedSparseKernels) {
      fn(TypeTag<AttentionMask<true, true>>{});
    } else {
      dispatch_window(p, [&](auto window) { fn(TypeTag<AttentionMask<decltype(window)::value, kSparse>>{}); });
    }
  });
}

// Calls fn(TypeTag<AttentionMask<window, sparse>>{}, std::bool_constant<score_mod>{},
// std::bool_constant<dropout>{}): the mask policy, whether the kernel has the score modifications
// (softcap, ALiBi) and whether it has dropout's code (Causal: as in with_mask_policy). The
// score-mod variant always carries dropout as a uniform run-time branch; without score mods a call
// with dropout gets its own variant (the score-mod variant's register pressure cost the sm80
// backward 25-40% with ALiBi, BENCHMARKS.md).
// Only plain calls choose among the mask policies (four, and the launcher's causal one): calls with
// dropout or a score modification run the windowed ones (L = R = -1 without a window or causal
// mask; the sm90 forward, whose kernels have them as run-time branches, takes with_mask_policy's
// choice for every call). Their dense and unwindowed-sparse variants were a third of each backward
// unit's kernels and about 270 s of a 2-core build (1401 -> 1132 s); on them such calls' backward
// was 2% faster (sm90, median; sm80 family 3-4%) and the sm80 forward 3-5% slower (H100, issue 18;
// BENCHMARKS.md "Feature calls on the windowed kernels").
template <typename Causal, typename Fn>
void with_policies(const FwdParams& p, Fn&& fn) {
  if (p.is_plain()) {
    with_mask_policy<Causal>(p, [&](auto mask) { fn(mask, std::false_type{}, std::false_type{}); });
    return;
  }
  dispatch_bool(p.sparse.enabled(), [&](auto sparse) {
    dispatch_bool(p.has_score_mod(), [&](auto score_mod) {
      fn(TypeTag<AttentionMask<true, decltype(sparse)::value>>{}, score_mod, std::true_type{});
    });
  });
}

}  // namespace flashcute
