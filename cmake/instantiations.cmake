# Generates the kernel translation units: one kernel family, head dim, kind (forward, backward,
# KV-cache forward) and group of dtypes (FLASHCUTE_DTYPES_PER_UNIT, below) per file, so a build
# parallelises over them and FLASHCUTE_HEADDIMS / FLASHCUTE_DTYPES restrict the set. Each family
# is compiled only for the GPU archs that run it:
#   sm80 (mma.sync, cp.async): every arch of FLASHCUTE_CUDA_ARCHS (e.g. sm_80 and sm_90 code);
#   sm90 (wgmma, TMA, setmaxnreg): sm_90a only, when FLASHCUTE_CUDA_ARCHS has 90.
# Also writes flashcute_instances.h, the list of (family, head dim, dtype) the dispatcher's
# table is built from (src/cuda/dispatch.cu).
set(FLASHCUTE_GEN_DIR "${CMAKE_BINARY_DIR}/generated")
file(MAKE_DIRECTORY "${FLASHCUTE_GEN_DIR}")

set(_known_hdims 32 64 96 128 192 256)
set(_cute_type_fp16 "cutlass::half_t")
set(_cute_type_bf16 "cutlass::bfloat16_t")
set(_enum_fp16 "kFloat16")
set(_enum_bf16 "kBFloat16")

# Which archs each family's code is compiled for. The sm90 family (wgmma, TMA, setmaxnreg): sm_90a
# only, when FLASHCUTE_CUDA_ARCHS has 90. The sm80 family (mma.sync, cp.async) runs every arch
# of FLASHCUTE_CUDA_ARCHS where the sm90 family has no kernel: on sm90 GPUs that is the KV-cache
# forward and the backward above d128; its forward and backward of the head dims the sm90
# family serves are compiled for the other archs only (on an H100 they never run: the dispatcher
# picks sm90 for every call, src/cuda/dispatch.cu). FLASHCUTE_SM80_ON_SM90=ON compiles them for
# sm_90 too, so that flashcute.kernels("sm80") runs the sm80 family on sm90 GPUs (to compare the
# families, and to test both on one GPU: scripts/gpu_check.sh builds so). The sm80 family's code
# is the same for every arch but where __CUDA_ARCH__ >= 900 adds to it: the backward's dQ atomics
# (4-wide vector reductions) and, in every kernel launched chained (the KV cache's append,
# attention and combine kernels, the backward's stages), the wait for the previous grid
# (griddepcontrol, common/utils.h), without which the launcher must launch plainly. So the backward
# and KV-cache units and the small CUDA files run a device front-end pass per arch; the forward
# units, which no sm90 GPU runs in a default build, run it once, for the lowest arch, and ptxas
# once per arch (compute_80 -> [sm_80, sm_90]; the same SASS, function by function, as a pass per
# arch: d128 bf16, cuobjdump, 2026-11-23; 60% of the compile time). (With one pass for every kind,
# a default build's sm80 KV-cache kernels launched plainly on the H200: b 1 decoding on them 0.6-1.0
# us slower than in gpu_check's archs-90 build, MQA 8k 10.0 against 9.1 us; session 52.)
option(FLASHCUTE_SM80_ON_SM90
       "Compile the sm80 family for sm_90 at every head dim (flashcute.kernels('sm80') on sm90 GPUs)" OFF)
# Kernels of their own for plain calls without a window or causal mask (calls with dropout,
# softcap or ALiBi always run the windowed ones). OFF: such calls run the windowed kernels with an
# unbounded window (common/dispatch.h), half the plain calls' mask variants, for 1-2% slower dense
# calls (README, "Build time").
option(FLASHCUTE_DENSE_KERNELS "Kernels without window code for calls without a window or causal mask" ON)
# Forward kernels of their own for plain causal calls (the window (-1, 0) at compile time; both
# families; the backward runs the windowed ones, common/dispatch.h): OFF runs them on the windowed
# kernels, one kernel less per forward unit and dtype (two in the sm90 units of d <= 64), the sm90
# d64 causal forward at 512-2048 tokens 4-6% and the sm80 d128 causal forward 3-7% slower
# (BENCHMARKS.md, "Causal kernels"). Implied by DENSE_KERNELS=OFF.
option(FLASHCUTE_CAUSAL_KERNELS "Kernels with the causal mask at compile time for plain causal calls" ON)
# The same for block-sparse calls: OFF runs plain block-sparse calls without a window or causal
# mask on the windowed block-sparse kernels, three mask variants instead of four, such calls 2-5%
# slower (README, "Build time"). Implied by DENSE_KERNELS=OFF.
option(FLASHCUTE_UNWINDOWED_SPARSE_KERNELS
       "Block-sparse kernels without window code for block-sparse calls without a window or causal mask" ON)
# What the build has (the compile definitions, the plan message and flashcute_build_info.json read
# these values): the unwindowed block-sparse kernels and the causal ones need the dense kernels'
# option too.
if(FLASHCUTE_DENSE_KERNELS AND FLASHCUTE_UNWINDOWED_SPARSE_KERNELS)
  set(FLASHCUTE_HAS_UNWINDOWED_SPARSE ON)
else()
  set(FLASHCUTE_HAS_UNWINDOWED_SPARSE OFF)
endif()
if(FLASHCUTE_DENSE_KERNELS AND FLASHCUTE_CAUSAL_KERNELS)  # common/dispatch.h: kCausalKernels
  set(FLASHCUTE_HAS_CAUSAL_KERNELS ON)
else()
  set(FLASHCUTE_HAS_CAUSAL_KERNELS OFF)
endif()
# Dtypes per unit: "all" puts every dtype of a head dim in one unit (about 20% less compile time
# in all: the dtypes share the CuTe layout algebra of the front end), "one" gives each dtype its own
# unit (twice the units, so many cores finish sooner: the longest unit bounds the build), "auto":
# "all" below 8 parallel jobs (MAX_JOBS, else the logical cores), "one" from 8 on.
set(FLASHCUTE_DTYPES_PER_UNIT "auto" CACHE STRING "Dtypes per kernel unit: all, one or auto")
set(_dtypes_per_unit "${FLASHCUTE_DTYPES_PER_UNIT}")
if(_dtypes_per_unit STREQUAL "auto")
  if(DEFINED ENV{MAX_JOBS} AND "$ENV{MAX_JOBS}" MATCHES "^[0-9]+$")
    set(_jobs $ENV{MAX_JOBS})
  else()
    cmake_host_system_information(RESULT _jobs QUERY NUMBER_OF_LOGICAL_CORES)
  endif()
  if(_jobs LESS 8)
    set(_dtypes_per_unit all)
  else()
    set(_dtypes_per_unit one)
  endif()
elseif(NOT _dtypes_per_unit MATCHES "^(all|one)$")
  message(FATAL_ERROR "FLASHCUTE_DTYPES_PER_UNIT: '${_dtypes_per_unit}' is not one of all, one, auto")
endif()
if(_dtypes_per_unit STREQUAL "all")
  string(REPLACE ";" "_" _unit_dtype_groups "${FLASHCUTE_DTYPES}")
else()
  set(_unit_dtype_groups ${FLASHCUTE_DTYPES})
endif()
set(FLASHCUTE_FAMILIES "")
set(_sm80_archs "")
foreach(_a ${FLASHCUTE_CUDA_ARCHS})
  string(REGEX REPLACE "a$" "" _n "${_a}")
  if(_n LESS 80)
    message(FATAL_ERROR "FLASHCUTE_CUDA_ARCHS: '${_a}' is older than sm80, which flashcute's kernels need")
  endif()
  list(APPEND _sm80_archs ${_n})
endforeach()
list(REMOVE_DUPLICATES _sm80_archs)
list(SORT _sm80_archs COMPARE NATURAL)
set(_with_sm90 OFF)
if(90 IN_LIST _sm80_archs AND FLASHCUTE_ENABLE_SM90)
  set(_with_sm90 ON)
endif()
list(APPEND FLASHCUTE_FAMILIES sm80)
if(_with_sm90)
  list(APPEND FLASHCUTE_FAMILIES sm90)
endif()

# _sm80_gencode(<out> <kind> <archs...>): the sm80 family's -gencode flags for archs: a front-end
# pass per arch for every kind but "fwd" (kinds bwd, kvcache, and "small" for the small CUDA
# files), one for the lowest arch for "fwd" (the comment on FLASHCUTE_SM80_ON_SM90 says why).
function(_sm80_gencode out kind)
  set(_flags "")
  if(NOT kind STREQUAL "fwd")
    foreach(_n ${ARGN})
      list(APPEND _flags "-gencode=arch=compute_${_n},code=sm_${_n}")
    endforeach()
  elseif(ARGN)
    list(GET ARGN 0 _lowest)
    set(_codes "")
    foreach(_n ${ARGN})
      list(APPEND _codes "sm_${_n}")
    endforeach()
    string(REPLACE ";" "," _codes "${_codes}")
    set(_flags "-gencode=arch=compute_${_lowest},code=[${_codes}]")
  endif()
  set(${out} "${_flags}" PARENT_SCOPE)
endfunction()
_sm80_gencode(FLASHCUTE_SM80_GENCODE small ${_sm80_archs})  # the small CUDA files (every arch)
set(FLASHCUTE_SM90_GENCODE "-gencode=arch=compute_90a,code=sm_90a")

# The directions each family has, and the head dims of a direction where it has fewer (the sm90
# backward keeps dK and dV of 64 keys per warpgroup in registers: up to d 128; larger head dims run
# the sm80 backward).
set(_kinds_sm80 fwd bwd kvcache)
set(_kinds_sm90 fwd bwd kvcache)
# The kinds whose sm80 kernels the sm90 family replaces on sm90 GPUs (built for sm_90 only with
# FLASHCUTE_SM80_ON_SM90): the sm90 decoding kernel serves only some KV-cache calls, so the sm80
# KV-cache kernels keep their sm_90 code.
set(_replaced_by_sm90 fwd bwd)
# The header of each family's KV-cache launcher.
set(_kvcache_launch_sm80 fwd_launch.h)
set(_kvcache_launch_sm90 decode_launch.h)
set(_max_hdim_sm90_bwd 128)
set(_arch_sm80 80)
set(_arch_sm90 90)

set(FLASHCUTE_KERNEL_SOURCES "")
set(FLASHCUTE_FWD_FAMILIES "")
set(_fwd_list "")
set(_bwd_list "")
set(_kvcache_list "")
foreach(_t ${FLASHCUTE_DTYPES})
  if(NOT DEFINED _cute_type_${_t})
    message(FATAL_ERROR "FLASHCUTE_DTYPES: '${_t}' is not one of fp16, bf16")
  endif()
endforeach()
foreach(_d ${FLASHCUTE_HEADDIMS})
  if(NOT _d IN_LIST _known_hdims)
    message(FATAL_ERROR "FLASHCUTE_HEADDIMS: '${_d}' is not one of ${_known_hdims}")
  endif()
endforeach()
foreach(_family ${FLASHCUTE_FAMILIES})
  set(FLASHCUTE_FAMILY ${_family})
  foreach(_d ${FLASHCUTE_HEADDIMS})
    set(FLASHCUTE_HEADDIM ${_d})
    foreach(_kind ${_kinds_${_family}})
      if(DEFINED _max_hdim_${_family}_${_kind} AND _d GREATER _max_hdim_${_family}_${_kind})
        continue()
      endif()
      # The archs of this unit; sm90_code: whether it runs on compute capability 9.0.
      if(_family STREQUAL "sm90")
        set(_gencode "${FLASHCUTE_SM90_GENCODE}")
        set(_sm90_code true)
      else()
        set(_archs ${_sm80_archs})
        if(_with_sm90 AND NOT FLASHCUTE_SM80_ON_SM90 AND _kind IN_LIST _replaced_by_sm90 AND
           NOT (DEFINED _max_hdim_sm90_${_kind} AND _d GREATER _max_hdim_sm90_${_kind}))
          list(REMOVE_ITEM _archs 90)
        endif()
        if(NOT _archs)
          continue()
        endif()
        _sm80_gencode(_gencode ${_kind} ${_archs})
        set(_sm90_code false)
        if(90 IN_LIST _archs)
          set(_sm90_code true)
        endif()
        string(REPLACE ";" "+" _a "${_archs}")
        string(APPEND _plan_${_kind} " ${_d}:${_a}")
      endif()
      set(FLASHCUTE_KVCACHE_LAUNCH ${_kvcache_launch_${_family}})
      # A unit per family, kind, head dim and dtype group (FLASHCUTE_DTYPES_PER_UNIT, above).
      foreach(_group ${_unit_dtype_groups})
        set(FLASHCUTE_INSTANTIATIONS "")
        string(REPLACE "_" ";" _group_dtypes "${_group}")
        foreach(_t ${_group_dtypes})
          string(APPEND FLASHCUTE_INSTANTIATIONS "FLASHCUTE_INSTANTIATE(${_cute_type_${_t}})\n")
          string(APPEND _${_kind}_list " \\\n  X(${_arch_${_family}}, ${_family}, ${_d}, ${_cute_type_${_t}}, ${_enum_${_t}}, ${_sm90_code})")
        endforeach()
        set(_out "${FLASHCUTE_GEN_DIR}/${_kind}_${_family}_hdim${_d}_${_group}.cu")
        configure_file("${PROJECT_SOURCE_DIR}/src/cuda/${_kind}_instance.cu.in" "${_out}" @ONLY)
        set_source_files_properties("${_out}" PROPERTIES COMPILE_OPTIONS "${_gencode}")
        if(_kind STREQUAL "fwd" AND _family STREQUAL "sm90" AND _d GREATER_EQUAL 128)
          # CuTe's wgmma selectors may then pick every N that is a multiple of 8 (64x176x16 ...),
          # not only 8, 16, 32, 64, 96, 128, 192, 256: the sm90 forward's plain-call tiles of d128,
          # d192 and d256 (plain_block_n() in sm90/fwd_launch.h; without it 176 keys ran as 11
          # wgmma of 64x16 per k-step, 32% slower, docs/NOTES.md session 23; FwdTraits asserts it).
          # Only there: the header it adds (cute/arch/mma_sm90_gmma_ext.hpp) costs a unit about
          # 13 s more on the 2-core machine (d64: sm80 forward 51 -> 65 s, sm90 forward 44 -> 57 s),
          # and the backward's d96 dQ GEMM (N = 48) would take a 64x48 atom, for which K^T's
          # shared-memory layout is not canonical.
          set_property(SOURCE "${_out}" APPEND PROPERTY COMPILE_DEFINITIONS CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED)
        endif()
        list(APPEND FLASHCUTE_KERNEL_SOURCES "${_out}")
      endforeach()
      if(_kind STREQUAL "fwd")
        list(APPEND FLASHCUTE_FWD_FAMILIES ${_family})
      endif()
    endforeach()
  endforeach()
endforeach()

file(CONFIGURE OUTPUT "${FLASHCUTE_GEN_DIR}/flashcute_instances.h" CONTENT
"// Generated by cmake/instantiations.cmake: the (arch, family, head dim, element, DType, whether it has
// code for compute capability 9.0) of this build.
#pragma once
#define FLASHCUTE_FOR_EACH_FWD_INSTANCE(X)${_fwd_list}
#define FLASHCUTE_FOR_EACH_BWD_INSTANCE(X)${_bwd_list}
#define FLASHCUTE_FOR_EACH_KVCACHE_INSTANCE(X)${_kvcache_list}
")
list(LENGTH FLASHCUTE_KERNEL_SOURCES FLASHCUTE_NUM_UNITS)
# The families with forward kernels (flashcute.kernels' choices; torch.ops.flashcute.kernel_families).
list(REMOVE_DUPLICATES FLASHCUTE_FWD_FAMILIES)
# For the build plan: the sm80 family's archs per kind and head dim (head dim:archs).
set(FLASHCUTE_SM80_PLAN "fwd${_plan_fwd}, bwd${_plan_bwd}, kvcache${_plan_kvcache}")
