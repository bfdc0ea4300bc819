// flashcute — the sm90 decoding launcher (flash-decoding over a KV cache, the calls
// src/cuda/dispatch.cu sends here): the mask policy of a call, the TMA descriptors, and a cluster
// of each query tile's splits.
#pragma once

#include <map>
#include <mutex>
#include <utility>

#include "flashcute/common/dispatch.h"
#include "flashcute/common/scheduler.h"
#include "flashcute/common/utils.h"
#include "flashcute/launch.h"
#include "flashcute/sm90/decode_kernel.h"
#include "flashcute/sm90/epilogue_decode.h"
#include "flashcute/sm90/mainloop_decode.h"
#include "flashcute/sm90/traits.h"

namespace flashcute::sm90 {

// How many clusters of `cluster` CTAs of `kernel` the GPU holds at once (cached per device).
template <typename Kernel>
int clusters_that_fit(Kernel kernel, int threads, int smem, int cluster) {
  int device = 0;
  FLASHCUTE_CUDA_CHECK(cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int> known;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = known.find({device, cluster});
  if (it != known.end()) return it->second;
  set_smem_limit(kernel, smem);
  cudaLaunchAttribute attr[1] = {cluster_attribute(cluster)};
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(cluster);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.attrs = attr;
  config.numAttrs = 1;
  int n = 0;
  FLASHCUTE_CUDA_CHECK(cudaOccupancyMaxActiveClusters(&n, kernel, &config));
  known.emplace(std::make_pair(device, cluster), n);
  return n;
}

// params.num_splits (at most EpilogueDecode's kMaxSplits) CTAs per query tile, one cluster;
// fewer where the query tiles' clusters of that many would not all be resident at once (the
// clusters that wait stream their keys alone at the end: b 1, 32 KV heads, 32k, 32 clusters of 4
// took 156 us where the sm80 kernel took 127, H200, session 48). (The spread and load-balancing
// cluster scheduling policies changed nothing, GQA or MHA; session 53.)
template <typename Element, int kHeadDim>
void run_fwd_kvcache(const FwdParams& call, cudaStream_t stream) {
  using Traits = DecodeTraits<kHeadDim, Element>;
  using Scheduler = KvCacheTileScheduler<Traits::kBlockM>;
  FwdParams params = call;
  params.seqlen_q *= params.pack_gqa;  // the kernel's query rows: (position, head) pairs
  dispatch_window(params, [&](auto window) {
    using Mainloop = MainloopDecode<Traits, AttentionMask<decltype(window)::value, false, true>>;
    using Epilogue = EpilogueDecode<Mainloop>;
    if (params.num_splits < 1 || params.num_splits > Epilogue::kMaxSplits) {
      throw std::invalid_argument("flashcute: the sm90 decoding kernel takes 1 to 8 splits, not " +
                                  std::to_string(params.num_splits));
    }
    static_assert(sizeof(typename Mainloop::SharedStorage) <= 227 * 1024, "the rings, Q and the landing buffers");
    auto kernel = &flashcute_decode_kernel<Mainloop, Epilogue>;
    const int smem = int(sizeof(typename Mainloop::SharedStorage));
    const int64_t tiles = int64_t(Scheduler::num_m_blocks(params)) * params.batch * Scheduler::head_groups(params);
    while (params.num_splits > 1 && tiles > clusters_that_fit(kernel, Mainloop::kNThreads, smem, params.num_splits)) {
      --params.num_splits;
    }
    launch_kernel_clustered(kernel, Scheduler::grid(params), Mainloop::kNThreads, smem, stream, params.num_splits,
                            Mainloop::to_params(params));
  });
}

// The tile and how many CTAs an SM holds (one: the rings take most of its shared memory).
template <typename Element, int kHeadDim>
void kvcache_tiles(const FwdParams&, int& block_m, int& block_n, int& ctas_per_sm) {
  block_m = DecodeTraits<kHeadDim, Element>::kBlockM;
  block_n = DecodeTraits<kHeadDim, Element>::kBlockN;
  ctas_per_sm = 1;
}

}  // namespace flashcute::sm90
