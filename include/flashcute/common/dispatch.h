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

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls fn(TypeTag<AttentionMask<window, sparse>>{}) for the mask policy of a call.
template <typename Fn>
void with_mask_policy(const FwdParams& p, Fn&& fn) {
  dispatch_bool(p.has_window(), [&](auto window) {
    dispatch_bool(p.sparse.enabled(), [&](auto sparse) {
      fn(TypeTag<AttentionMask<decltype(window)::value, decltype(sparse)::value>>{});
    });
  });
}

// Calls fn(TypeTag<AttentionMask<window, sparse>>{}, std::bool_constant<score_mod>{}): the mask
// policy and whether the call modifies its scores (softcap, ALiBi).
template <typename Fn>
void with_policies(const FwdParams& p, Fn&& fn) {
  with_mask_policy(p, [&](auto mask) {
    dispatch_bool(p.softcap > 0.f || p.alibi_slopes != nullptr, [&](auto score_mod) { fn(mask, score_mod); });
  });
}

}  // namespace flashcute
