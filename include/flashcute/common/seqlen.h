// flashcute — where sequence b starts and how long it is, read once per tile.
//
// Padded batches: every sequence has params.seqlen_q / seqlen_k rows at batch index b.
// Packed variable-length batches (params.cu_seqlens_q/k): sequence b owns rows
// [cu[b], cu[b + 1]) of a (total, heads, headdim) tensor whose batch stride is 0. The device-side
// offsets are clamped into [0, total] and the lengths into [0, max_seqlen], so a bad cu_seqlens
// never leads a kernel outside its tensors. KV-cache calls (with_cache): the keys of sequence b
// are its used cache positions (params.cache_seqlens, clamped to the capacity); with GQA packing
// the kernel's params count (position, head) rows in seqlen_q (sm80/fwd_launch.h).
#pragma once

#include "flashcute/params.h"

namespace flashcute {

struct SeqlenInfo {
  int q = 0;         // query rows of sequence b (GQA packing: (position, head) rows)
  int k = 0;         // keys of sequence b
  int q_offset = 0;  // first row of b in the packed q / out (0 for padded batches)
  int k_offset = 0;  // first row of b in the packed k / v

  FLASHCUTE_HOST_DEVICE SeqlenInfo(const FwdParams& p, int b) {
    if (p.cu_seqlens_q != nullptr) {
      range(p.cu_seqlens_q, b, p.total_q, p.seqlen_q, q_offset, q);
      range(p.cu_seqlens_k, b, p.total_k, p.seqlen_k, k_offset, k);
    } else {
      *this = padded(p);
    }
  }

  // Kernels that never see a packed batch (Mask::kVarlen = false): params' lengths, which the
  // kernel reads from the constant bank where it needs them instead of keeping them (and the
  // addresses derived from them) in registers across its loop.
  FLASHCUTE_HOST_DEVICE static SeqlenInfo padded(const FwdParams& p) {
    SeqlenInfo s;
    s.q = p.seqlen_q;
    s.k = p.seqlen_k;
    return s;
  }

  // KV-cache calls: the keys of sequence b are its used cache positions (the KV-cache main loop
  // and the sm90 forward, which serves chunked prefill). A separate entry point: the branch in the
  // constructor cost the other kernels spills, e.g. d32 sm80 forward 80/76 -> 92/88 bytes (ptxas);
  // the sm90 forward's registers did not change.
  FLASHCUTE_HOST_DEVICE static SeqlenInfo with_cache(const FwdParams& p, int b) {
    SeqlenInfo s(p, b);
    if (p.cache_seqlens != nullptr) {
      const int used = p.cache_seqlens[b] + p.seqlen_new;
      s.k = used < 0 ? 0 : (used < s.k ? used : s.k);
    }
    return s;
  }

  // Offset of (b, h)'s first lse value: lse is (batch, nheads, seqlen_q), or (nheads, total_q)
  // for packed batches.
  FLASHCUTE_HOST_DEVICE int64_t lse_offset(const FwdParams& p, int b, int h) const {
    return p.cu_seqlens_q != nullptr ? int64_t(h) * p.total_q + q_offset
                                     : (int64_t(b) * p.nheads + h) * p.seqlen_q;
  }

 private:
  SeqlenInfo() = default;
  FLASHCUTE_HOST_DEVICE static void range(const int* cu, int b, int total, int max_len, int& offset, int& len) {
    int begin = cu[b], end = cu[b + 1];
    begin = begin < 0 ? 0 : (begin > total ? total : begin);
    end = end < begin ? begin : (end > total ? total : end);
    offset = begin;
    len = end - begin < max_len ? end - begin : max_len;
  }
};

}  // namespace flashcute
