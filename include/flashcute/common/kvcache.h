// flashcute — where the rows of a KV-cache call live (arch-free): the query rows of a tile,
// GQA-packed as (position, head) pairs, and the cache positions of a sequence, contiguous or
// through the page table. The loaders of the kernels add these offsets to their per-column
// copies; every device-side value is clamped so that no row leads outside its tensor.
#pragma once

#include "flashcute/params.h"

namespace flashcute {

struct KvCacheRows {
  const FwdParams& p;
  int b;      // sequence
  int h0;     // the tile's first query head (GQA packing: of its group)
  int h_kv;   // its key/value head

  // Element offset of packed query row r (position r / pack_gqa, head h0 + r % pack_gqa) in a
  // (batch, seqlen_q, nheads, headdim) tensor with strides s.
  FLASHCUTE_HOST_DEVICE int64_t q_row(const Strides& s, int r) const {
    const int i = r / p.pack_gqa;
    return b * s.batch + i * s.row + (h0 + r - i * p.pack_gqa) * s.head;
  }
  // The page and the row in it of cache position t (0 <= t < seqlen_k) of this sequence
  // (contiguous caches: page b).
  FLASHCUTE_HOST_DEVICE void page_of(int t, int& page, int& row) const {
    if (p.block_table == nullptr) {
      page = b;
      row = t;
      return;
    }
    const int i = t / p.page_size;
    page = clamp_page(p.block_table[b * p.block_table_stride + i]);
    row = t - i * p.page_size;
  }
  // page_of in steps, for a loader that reads the table a tile ahead of its use: the table's entry
  // for position t as stored (contiguous caches: b), that entry's page, and t's row in its page.
  // (page_of keeps its own one-branch body: written through these three, the sm80 KV-cache
  // kernels' SASS grew by 1.6-5.1% in instructions.)
  FLASHCUTE_HOST_DEVICE int table_entry_or_b(int t) const { return p.block_table == nullptr ? b : table_entry(t); }
  FLASHCUTE_HOST_DEVICE int page_from_entry(int entry) const {
    return p.block_table == nullptr ? entry : clamp_page(entry);
  }
  FLASHCUTE_HOST_DEVICE int row_in_page(int t) const { return p.block_table == nullptr ? t : t % p.page_size; }
  // page_of in two halves (paged caches), for loaders that copy the page table's entries
  // asynchronously: the entry for position t as stored (a reference into the table), and an entry
  // clamped into the pool.
  FLASHCUTE_HOST_DEVICE const int& table_entry(int t) const {
    return p.block_table[b * p.block_table_stride + t / p.page_size];
  }
  FLASHCUTE_HOST_DEVICE int clamp_page(int page) const {
    return page < 0 ? 0 : (page >= p.num_pages ? p.num_pages - 1 : page);
  }
  // Element offset of row `row` of page `page` for this kv head.
  FLASHCUTE_HOST_DEVICE int64_t kv_offset(const Strides& s, int page, int row) const {
    return page * s.batch + row * s.row + h_kv * s.head;
  }
  // Element offset of cache position t (0 <= t < seqlen_k) of this sequence and kv head.
  FLASHCUTE_HOST_DEVICE int64_t kv_row(const Strides& s, int t) const {
    int page, row;
    page_of(t, page, row);
    return kv_offset(s, page, row);
  }
  // Whether every tile of tile_n positions lies in one page (contiguous caches: one page each).
  FLASHCUTE_HOST_DEVICE bool tile_in_one_page(int tile_n) const {
    return p.block_table == nullptr || p.page_size % tile_n == 0;
  }
  // The row of (split, query row r) in o_accum / lse_accum, (num_splits, batch, nheads, seqlen_q);
  // the kernel's p.seqlen_q counts packed rows (seqlen_q * pack_gqa).
  FLASHCUTE_HOST_DEVICE int64_t accum_row(int split, int r) const {
    const int i = r / p.pack_gqa;
    return ((int64_t(split) * p.batch + b) * p.nheads + h0 + r - i * p.pack_gqa) * (p.seqlen_q / p.pack_gqa) + i;
  }
};

}  // namespace flashcute
