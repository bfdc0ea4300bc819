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

// The two directions of a call: only the forward has causal kernels of its own (below).
enum class Pass { kForward, kBackward };

// Plain causal calls without a block-sparse list have forward kernels of their own (CausalMask: the
// window (-1, 0) at compile time, no left edge's code), unless the build drops them (CMake
// FLASHCUTE_CAUSAL_KERNELS=OFF defines FLASHCUTE_NO_CAUSAL_KERNELS; a build without the dense
// kernels drops them too): such calls then run the windowed kernels with (L, R) = (-1, 0).
// Measured against the windowed kernels (H200, bf16, 16k tokens, alternating processes; BENCHMARKS.md
// "Causal kernels"): the sm90 forward d64 512-2048 tokens 4.2-5.9% faster (its 192-row windowed
// kernel spills 96/108 bytes, the causal one none), the sm80 forward d128 3.3-7.0%; the sm90 forward
// d128 and the sm80 forward d64 within +-1.6%. The backward keeps the windowed kernels: the sm80
// backward's causal kernels ran within -0.9..+0.7% of them, and the sm90 backward's d64 causal kernel
// spilled 136/168 bytes against 68/76 (ptxas).
#ifdef FLASHCUTE_NO_CAUSAL_KERNELS
inline constexpr bool kCausalKernels = false;
#else
inline constexpr bool kCausalKernels = kDenseKernels;
#endif
using CausalMask = AttentionMask<true, false, false, /*kLeftEdge=*/false>;

// Calls fn(TypeTag<mask policy>{}) for the mask policy of a call in direction kPass:
// AttentionMask<window, sparse>, or CausalMask. (The causal test stands outside the generic lambda:
// nvcc 13.0's front end instantiated the discarded branch of an `if constexpr (!kSparse && kPass ==
// ...)` inside it, so the backward and an OFF build compiled the causal kernels anyway; g++ did not.)
template <Pass kPass, typename Fn>
void with_mask_policy(const FwdParams& p, Fn&& fn) {
  if constexpr (kCausalKernels && kPass == Pass::kForward) {
    if (!p.sparse.enabled() && p.window_left < 0 && p.window_right == 0) {
      static_assert(kPass == Pass::kForward, "instantiated for the backward: see the note above");
      fn(TypeTag<CausalMask>{});
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
// (softcap, ALiBi) and whether it has dropout's code. The score-mod variant always carries dropout
// as a uniform run-time branch; without score mods a call with dropout gets its own variant (the
// score-mod variant's register pressure cost the sm80 backward 25-40% with ALiBi, BENCHMARKS.md).
// Only plain calls choose among the mask policies (four, and the forward's causal one): calls with
// dropout or a score modification run the windowed ones (L = R = -1 without a window or causal
// mask; the sm90 forward, whose kernels have them as run-time branches, takes with_mask_policy's
// choice for every call). Their dense and unwindowed-sparse variants were a third of each backward
// unit's kernels and about 270 s of a 2-core build (1401 -> 1132 s); on them such calls' backward
// was 2% faster (sm90, median; sm80 family 3-4%) and the sm80 forward 3-5% slower (H100, issue 18;
// BENCHMARKS.md "Feature calls on the windowed kernels").
template <Pass kPass, typename Fn>
void with_policies(const FwdParams& p, Fn&& fn) {
  if (p.is_plain()) {
    with_mask_policy<kPass>(p, [&](auto mask) { fn(mask, std::false_type{}, std::false_type{}); });
    return;
  }
  dispatch_bool(p.sparse.enabled(), [&](auto sparse) {
    dispatch_bool(p.has_score_mod(), [&](auto score_mod) {
      fn(TypeTag<AttentionMask<true, decltype(sparse)::value>>{}, score_mod, std::true_type{});
    });
  });
}

}  // namespace flashcute
