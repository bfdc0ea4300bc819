# CuTe/CUTLASS headers: CUTLASS_INCLUDE_DIR, or the nvidia-cutlass package's
# cutlass_library/source/include, located without importing the package.
if(NOT CUTLASS_INCLUDE_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "
import importlib.util, pathlib
spec = importlib.util.find_spec('cutlass_library')
print(pathlib.Path(spec.origin).parent / 'source' / 'include' if spec else '')"
    OUTPUT_VARIABLE _cutlass_inc OUTPUT_STRIP_TRAILING_WHITESPACE)
  set(CUTLASS_INCLUDE_DIR "${_cutlass_inc}" CACHE PATH "CuTe/CUTLASS headers" FORCE)
endif()
if(NOT EXISTS "${CUTLASS_INCLUDE_DIR}/cute/tensor.hpp")
  message(FATAL_ERROR "flashcute: CuTe headers not found (CUTLASS_INCLUDE_DIR='${CUTLASS_INCLUDE_DIR}'). "
                      "pip install nvidia-cutlass==4.2.0.0, or set CUTLASS_INCLUDE_DIR to CUTLASS's include/.")
endif()
message(STATUS "flashcute: CuTe headers from ${CUTLASS_INCLUDE_DIR}")
