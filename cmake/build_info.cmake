# Records the build's configuration in flashcute_build_info.json, next to the library (the
# build tree, where FLASHCUTE_LIBRARY points, and the installed package):
#   - the torch it was built against (torch.__version__, torch.version.cuda): the library links
#     that exact libtorch, so python/flashcute/_ops.py refuses to load it under another torch
#     with an ImportError that names both versions and the rebuild command;
#   - what it has kernels for (families, archs, head dims, dtypes), the compilers, the build type:
#     `python -m flashcute.info` prints them.
# Included at the end of CMakeLists.txt (after the target and cmake/instantiations.cmake).

execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import torch; print(torch.__version__)"
  OUTPUT_VARIABLE FLASHCUTE_TORCH_VERSION OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE _fc_rc)
if(NOT _fc_rc EQUAL 0)
  message(FATAL_ERROR "flashcute: cannot read torch.__version__ with ${Python_EXECUTABLE}")
endif()

# A CMake list as a JSON array: strings quoted, or (ints) bare.
function(_flashcute_json_array out_var list_var as_ints)
  set(_items "")
  foreach(_x IN LISTS ${list_var})
    if(as_ints)
      list(APPEND _items "${_x}")
    else()
      list(APPEND _items "\"${_x}\"")
    endif()
  endforeach()
  string(REPLACE ";" ", " _items "${_items}")
  set(${out_var} "[${_items}]" PARENT_SCOPE)
endfunction()

if(FLASHCUTE_WITH_CUDA)
  set(_fc_with_cuda "true")
  set(_fc_archs "${FLASHCUTE_CUDA_ARCHS}")
  set(_fc_hdims "${FLASHCUTE_HEADDIMS}")
  set(_fc_dtypes "${FLASHCUTE_DTYPES}")
  set(_fc_families "${FLASHCUTE_FWD_FAMILIES}")
  set(_fc_nvcc "\"${CMAKE_CUDA_COMPILER_ID} ${CMAKE_CUDA_COMPILER_VERSION}\"")
else()
  set(_fc_with_cuda "false")
  set(_fc_archs "")
  set(_fc_hdims "")
  set(_fc_dtypes "")
  set(_fc_families "")
  set(_fc_nvcc "null")
endif()
# A CUDA build option as a JSON boolean (false without the CUDA kernels).
function(_flashcute_json_bool out_var value)
  if(FLASHCUTE_WITH_CUDA AND "${value}")
    set(${out_var} "true" PARENT_SCOPE)
  else()
    set(${out_var} "false" PARENT_SCOPE)
  endif()
endfunction()
_flashcute_json_bool(_fc_sm80_on_sm90 "${FLASHCUTE_SM80_ON_SM90}")
_flashcute_json_bool(_fc_dense_kernels "${FLASHCUTE_DENSE_KERNELS}")
_flashcute_json_bool(_fc_causal_kernels "${FLASHCUTE_HAS_CAUSAL_KERNELS}")
_flashcute_json_bool(_fc_unwindowed_sparse_kernels "${FLASHCUTE_HAS_UNWINDOWED_SPARSE}")
_flashcute_json_array(_fc_archs_json _fc_archs OFF)
_flashcute_json_array(_fc_hdims_json _fc_hdims ON)
_flashcute_json_array(_fc_dtypes_json _fc_dtypes OFF)
_flashcute_json_array(_fc_families_json _fc_families OFF)
if(TORCH_CUDA_VERSION)
  set(_fc_torch_cuda "\"${TORCH_CUDA_VERSION}\"")
else()
  set(_fc_torch_cuda "null")
endif()
if(DEFINED SKBUILD_PROJECT_VERSION)
  set(_fc_version "\"${SKBUILD_PROJECT_VERSION}\"")
else()
  set(_fc_version "null")
endif()

set(FLASHCUTE_BUILD_INFO "${CMAKE_BINARY_DIR}/flashcute_build_info.json")
file(CONFIGURE OUTPUT "${FLASHCUTE_BUILD_INFO}" CONTENT
"{
  \"flashcute_version\": ${_fc_version},
  \"torch_version\": \"${FLASHCUTE_TORCH_VERSION}\",
  \"torch_cuda_version\": ${_fc_torch_cuda},
  \"with_cuda\": ${_fc_with_cuda},
  \"kernel_families\": ${_fc_families_json},
  \"cuda_archs\": ${_fc_archs_json},
  \"sm80_on_sm90\": ${_fc_sm80_on_sm90},
  \"dense_kernels\": ${_fc_dense_kernels},
  \"causal_kernels\": ${_fc_causal_kernels},
  \"unwindowed_sparse_kernels\": ${_fc_unwindowed_sparse_kernels},
  \"headdims\": ${_fc_hdims_json},
  \"dtypes\": ${_fc_dtypes_json},
  \"cxx_compiler\": \"${CMAKE_CXX_COMPILER_ID} ${CMAKE_CXX_COMPILER_VERSION}\",
  \"cuda_compiler\": ${_fc_nvcc},
  \"build_type\": \"${CMAKE_BUILD_TYPE}\",
  \"python\": \"${Python_VERSION}\"
}
")
install(FILES "${FLASHCUTE_BUILD_INFO}" DESTINATION flashcute)
