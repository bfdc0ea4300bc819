# The CPU-only build links libtorch directly: torch's own CMake config insists on a CUDA
# toolkit whenever torch itself was built with CUDA, and the CPU backend needs none.
get_filename_component(_torch_root "${TORCH_CMAKE_PREFIX}/../.." ABSOLUTE)
execute_process(
  COMMAND "${Python_EXECUTABLE}" -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))"
  OUTPUT_VARIABLE _abi OUTPUT_STRIP_TRAILING_WHITESPACE)
add_library(flashcute_torch_cpu INTERFACE)
target_include_directories(flashcute_torch_cpu SYSTEM INTERFACE
  "${_torch_root}/include" "${_torch_root}/include/torch/csrc/api/include")
target_compile_definitions(flashcute_torch_cpu INTERFACE _GLIBCXX_USE_CXX11_ABI=${_abi})
foreach(_l torch torch_cpu c10)
  find_library(_lib_${_l} ${_l} PATHS "${_torch_root}/lib" NO_DEFAULT_PATH REQUIRED)
  target_link_libraries(flashcute_torch_cpu INTERFACE "${_lib_${_l}}")
endforeach()
set(TORCH_LIBRARIES flashcute_torch_cpu)
