// flashcute — arch-free helpers shared by both kernel families: error checks, global-tensor
// views, register-fragment conversion, reductions over the 4 threads that share a row of an
// MMA accumulator (the same quad structure in mma.sync's m16n8 and wgmma's m64nN layouts).
#pragma once

#include <cuda_runtime.h>

#include <cute/tensor.hpp>
#include <cutlass/numeric_conversion.h>
#include <cutlass/numeric_types.h>

#include <stdexcept>
#include <string>

#include "flashcute/common/seqlen.h"
#include "flashcute/params.h"

#define FLASHCUTE_CUDA_CHECK(expr)                                                          \
  do {                                                                                     \
    const cudaError_t _err = (expr);                                                       \
    if (_err != cudaSuccess) {                                                             \
      throw std::runtime_error(std::string("flashcute: CUDA error ") + cudaGetErrorName(_err) + \
                               " (" + cudaGetErrorString(_err) + ") at " + __FILE__ + ":" +   \
                               std::to_string(__LINE__) + ": " #expr);                       \
    }                                                                                      \
  } while (0)

namespace flashcute {

using namespace cute;

// Block-sparse blocks must be whole multiples of the kernel's tiles (the op checks this for the
// user; this guards every launcher).
inline void check_sparse_tiles(const BlockSparse& sparse, int tile_m, int tile_n) {
  if (sparse.enabled() && (sparse.block_m % tile_m != 0 || sparse.block_n % tile_n != 0)) {
    throw std::invalid_argument("flashcute: block-sparse block size (" + std::to_string(sparse.block_m) + ", " +
                                std::to_string(sparse.block_n) + ") is not a multiple of the kernel tile (" +
                                std::to_string(tile_m) + ", " + std::to_string(tile_n) + ")");
  }
}

// ---- Programmatic dependent launch (sm90) ---------------------------------------------------
// Chains of our kernels on one stream (the KV cache's append -> attention -> combine, the
// backward's preprocess -> main -> dQ conversion): a kernel launched with launch_kernel_chained()
// may become resident while the kernel before it still runs, once every CTA of that one has called
// dependents_may_launch() (or exited), and waits in wait_for_previous_grid() until that kernel has
// completed and its writes are visible. So the next kernel's launch and CTA start overlap the
// previous one's run: decoding with MQA at b = 1 5-9% faster on the H100, the backward unchanged
// within noise (BENCHMARKS.md, session 25). Without the launch attribute (other GPUs, other
// launches) both instructions do nothing.
CUTE_DEVICE void wait_for_previous_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
CUTE_DEVICE void dependents_may_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

// Whether `kernel`'s code for the current device has wait_for_previous_grid()'s instruction
// (code for sm_90 or later, compiled from sm_90 or later PTX): only then may it be launched early.
bool chained_launch_supported(const void* kernel);

template <typename Kernel>
void set_smem_limit(Kernel kernel, int smem) {
  if (smem > 48 * 1024) {
    FLASHCUTE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
}

// Launches kernel with `smem` bytes of dynamic shared memory (raising the 48 KB default limit
// first where it needs more) and checks the launch. An empty grid (no work) launches nothing.
template <typename Kernel, typename... Args>
void launch_kernel(Kernel kernel, dim3 grid, dim3 block, int smem, cudaStream_t stream, Args const&... args) {
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  set_smem_limit(kernel, smem);
  kernel<<<grid, block, smem, stream>>>(args...);
  FLASHCUTE_CUDA_CHECK(cudaGetLastError());
}

// The launch attribute that groups a grid's CTAs in clusters of cluster_x along x.
inline cudaLaunchAttribute cluster_attribute(int cluster_x) {
  cudaLaunchAttribute attr = {};
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = cluster_x;
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  return attr;
}

// launch_kernel for a kernel that calls wait_for_previous_grid() before it reads anything: with
// programmatic stream serialization where its code has the wait, else a plain launch; cluster_x >
// 1: its CTAs in clusters of that many along x (the grid's x extent a multiple of it).
template <typename Kernel, typename... Args>
void launch_kernel_clustered(Kernel kernel, dim3 grid, dim3 block, int smem, cudaStream_t stream, int cluster_x,
                             Args const&... args) {
  const bool chained = chained_launch_supported(reinterpret_cast<const void*>(kernel));
  if (!chained && cluster_x == 1) {
    launch_kernel(kernel, grid, block, smem, stream, args...);
    return;
  }
  if (grid.x == 0 || grid.y == 0 || grid.z == 0) return;
  set_smem_limit(kernel, smem);
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (chained) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster_x > 1) attr[n++] = cluster_attribute(cluster_x);
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = static_cast<size_t>(smem);
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = n;
  FLASHCUTE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
}
template <typename Kernel, typename... Args>
void launch_kernel_chained(Kernel kernel, dim3 grid, dim3 block, int smem, cudaStream_t stream,
                           Args const&... args) {
  launch_kernel_clustered(kernel, grid, block, smem, stream, 1, args...);
}

// ---- Global tensors ---------------------------------------------------------------------
// One (batch, head) of a (batch, seqlen, heads, headdim) tensor as (rows, kHeadDim) with a unit
// last stride, starting at row `row0` (a packed sequence's offset); columns past the real headdim
// are never read or written (the kernels predicate or zero-fill them).
template <typename Element, int kHeadDim>
CUTE_DEVICE auto head_tensor(const void* base, Strides s, int batch, int head, int rows, int row0 = 0) {
  auto ptr = static_cast<Element*>(const_cast<void*>(base)) + batch * s.batch + row0 * s.row + head * s.head;
  return make_tensor(make_gmem_ptr(ptr), make_shape(rows, Int<kHeadDim>{}), make_stride(s.row, _1{}));
}

// Element-wise conversion of a register fragment (vectorised through CUTLASS converters).
template <typename To, typename Engine, typename Layout>
CUTE_DEVICE auto convert_fragment(Tensor<Engine, Layout> const& src) {
  using From = typename Engine::value_type;
  constexpr int N = decltype(size(src))::value;
  cutlass::NumericArrayConverter<To, From, N> convert;
  Tensor dst = make_tensor<To>(src.layout());
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, N>*>(src.data()));
  return dst;
}

// max(lo, 0), max(hi, 0) in a 16-bit type, one cvt.relu instruction (dropout's marked P:
// DropoutMap::mark_dropped gives the dropped scores a negative sign).
template <typename To>
CUTE_DEVICE cutlass::Array<To, 2> convert_pair_relu(float lo, float hi) {
  static_assert(std::is_same_v<To, cutlass::bfloat16_t> || std::is_same_v<To, cutlass::half_t>);
  cutlass::Array<To, 2> pair;
  uint32_t& bits = reinterpret_cast<uint32_t&>(pair);
  if constexpr (std::is_same_v<To, cutlass::bfloat16_t>) {
    asm("cvt.rn.relu.bf16x2.f32 %0, %1, %2;" : "=r"(bits) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.relu.f16x2.f32 %0, %1, %2;" : "=r"(bits) : "f"(hi), "f"(lo));
  }
  return pair;
}

// The same into an existing fragment of the destination type (a register tile that lives on).
template <typename EngineS, typename EngineD, typename Layout>
CUTE_DEVICE void convert_fragment_into(Tensor<EngineS, Layout> const& src, Tensor<EngineD, Layout>& dst) {
  using From = typename EngineS::value_type;
  using To = typename EngineD::value_type;
  constexpr int N = decltype(size(src))::value;
  cutlass::NumericArrayConverter<To, From, N> convert;
  *reinterpret_cast<cutlass::Array<To, N>*>(dst.data()) =
      convert(*reinterpret_cast<const cutlass::Array<From, N>*>(src.data()));
}

// ---- Tile stores (plain 16-byte accesses) ------------------------------------------------
// Store to global memory: only rows < max_rows and columns inside headdim are written.
template <typename TiledCopy, typename TS, typename TD, typename TC, typename TP>
CUTE_DEVICE void store_tile(TiledCopy const& tiled_copy, TS const& src, TD&& dst, TC const& coord,
                            TP const& col_ok, int max_rows) {
  CUTE_UNROLL
  for (int m = 0; m < size<1>(src); ++m) {
    if (get<0>(coord(0, m, 0)) < max_rows) {
      CUTE_UNROLL
      for (int k = 0; k < size<2>(src); ++k) {
        if (col_ok(k)) copy(tiled_copy, src(_, m, k), dst(_, m, k));
      }
    }
  }
}

// A tile in shared memory to global memory with 16-byte accesses, through registers; only rows
// < max_rows and columns inside headdim are written (coord, col_ok: as for store_tile, from the
// same thread layout).
template <typename TiledCopy, typename SS, typename GG, typename TC, typename TP>
CUTE_DEVICE void store_smem_tile(TiledCopy const& tiled_copy, int tidx, SS const& s_tile, GG const& g_tile,
                                 TC const& coord, TP const& col_ok, int max_rows) {
  auto thr = tiled_copy.get_thread_slice(tidx);
  Tensor tS = thr.partition_S(s_tile);
  Tensor tG = thr.partition_D(g_tile);
  Tensor tR = make_tensor<typename decltype(tG)::value_type>(shape(tG));
  copy(tiled_copy, tS, tR);
  store_tile(tiled_copy, tR, tG, coord, col_ok, max_rows);
}

// Whether each column chunk of a thread's (CPY, CPY_M, CPY_K) partition lies inside headdim.
template <typename TC>
CUTE_DEVICE auto column_predicate(TC const& coord, int headdim) {
  Tensor col_ok = make_tensor<bool>(make_shape(size<2>(coord)));
  CUTE_UNROLL
  for (int k = 0; k < size(col_ok); ++k) col_ok(k) = get<1>(coord(0, 0, k)) < headdim;
  return col_ok;
}

// ---- Reductions over the 4 threads (a quad) that share one row of an MMA tile ----------
struct MaxOp {
  CUTE_DEVICE float operator()(float a, float b) const { return fmaxf(a, b); }
};
struct SumOp {
  CUTE_DEVICE float operator()(float a, float b) const { return a + b; }
};
template <typename Op>
CUTE_DEVICE float quad_allreduce(float x, Op op) {
  x = op(x, __shfl_xor_sync(0xffffffff, x, 2));
  x = op(x, __shfl_xor_sync(0xffffffff, x, 1));
  return x;
}

}  // namespace flashcute
