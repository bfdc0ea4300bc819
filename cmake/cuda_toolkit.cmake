# Finds nvcc and makes a partial CUDA toolkit usable by torch's CMake config.
#
# torch's Caffe2 config needs the toolkit root, libnvrtc and the cuBLAS/cuSPARSE/cuSOLVER
# headers (ATen/cuda/CUDAContext.h includes them). A toolkit that lacks some of them
# (e.g. nvcc installed alone) is completed from the pip CUDA wheels that torch itself
# depends on (site-packages/nvidia/cu13 or nvidia/*): the missing pieces are linked into
# a shim directory in the build tree, which is put on CMake's search paths.
# Sets FLASHCUTE_CUDA_TOOLKIT_OK.

set(FLASHCUTE_CUDA_TOOLKIT_OK OFF)

if(NOT CMAKE_CUDA_COMPILER)
  find_program(_nvcc nvcc
    HINTS "$ENV{CUDA_HOME}/bin" "$ENV{CUDA_PATH}/bin" /usr/local/cuda/bin
    NO_CACHE)
  if(NOT _nvcc)
    return()
  endif()
  set(CMAKE_CUDA_COMPILER "${_nvcc}" CACHE FILEPATH "nvcc" FORCE)
endif()
get_filename_component(_cuda_bin "${CMAKE_CUDA_COMPILER}" DIRECTORY)
get_filename_component(_cuda_root "${_cuda_bin}" DIRECTORY)
set(CUDA_TOOLKIT_ROOT_DIR "${_cuda_root}" CACHE PATH "CUDA toolkit root" FORCE)
set(CUDAToolkit_ROOT "${_cuda_root}")

# Where the pip CUDA wheels keep their headers and libraries.
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "
import importlib.util, pathlib
spec = importlib.util.find_spec('nvidia')
roots = []
for base in (spec.submodule_search_locations if spec else []):
    base = pathlib.Path(base)
    roots += [p for p in [base / 'cu13', base / 'cu12'] if p.is_dir()]
    roots += [p for p in sorted(base.iterdir()) if (p / 'include').is_dir() and p.name not in ('cu13', 'cu12')]
print(';'.join(str(r) for r in roots))"
  OUTPUT_VARIABLE _wheel_roots OUTPUT_STRIP_TRAILING_WHITESPACE)

set(_shim "${CMAKE_BINARY_DIR}/cuda-shim")
file(MAKE_DIRECTORY "${_shim}/lib64" "${_shim}/include")
set(_need_shim OFF)

# Headers torch's CUDA headers include.
foreach(_h nvrtc.h cublas_v2.h cublasLt.h cusparse.h cusolverDn.h cufft.h curand.h)
  if(NOT EXISTS "${_cuda_root}/include/${_h}")
    foreach(_r ${_wheel_roots})
      if(EXISTS "${_r}/include/${_h}")
        set(_need_shim ON)
        file(GLOB _hdrs "${_r}/include/*")
        foreach(_f ${_hdrs})
          get_filename_component(_n "${_f}" NAME)
          if(NOT EXISTS "${_cuda_root}/include/${_n}" AND NOT EXISTS "${_shim}/include/${_n}")
            file(CREATE_LINK "${_f}" "${_shim}/include/${_n}" SYMBOLIC)
          endif()
        endforeach()
        break()
      endif()
    endforeach()
  endif()
endforeach()

# Libraries, under the unversioned names find_library looks for.
foreach(_l nvrtc cublas cublasLt cusparse cusolver cufft curand nvJitLink)
  file(GLOB _have "${_cuda_root}/lib64/lib${_l}.so" "${_cuda_root}/lib/lib${_l}.so"
                  "${_cuda_root}/targets/*/lib/lib${_l}.so")
  if(_have)
    continue()
  endif()
  foreach(_r ${_wheel_roots})
    file(GLOB _cands "${_r}/lib/lib${_l}.so.[0-9]*")
    if(_cands)
      list(SORT _cands)
      list(GET _cands 0 _lib)
      file(CREATE_LINK "${_lib}" "${_shim}/lib64/lib${_l}.so" SYMBOLIC)
      set(_need_shim ON)
      break()
    endif()
  endforeach()
endforeach()

if(_need_shim)
  list(APPEND CMAKE_LIBRARY_PATH "${_shim}/lib64")
  list(APPEND CMAKE_INCLUDE_PATH "${_shim}/include")
  include_directories(SYSTEM "${_shim}/include")
  message(STATUS "flashcute: completed the CUDA toolkit at ${_cuda_root} from the pip CUDA wheels (${_shim})")
endif()
set(FLASHCUTE_CUDA_TOOLKIT_OK ON)
