#!/usr/bin/env bash
# Installs flashcute into the current Python environment, with its build requirements.
#
#   bash scripts/install.sh
#
# Build options (environment variables, read by pyproject.toml through scikit-build-core):
#   FLASHCUTE_ENABLE_CUDA=ON|OFF     build the CUDA kernels (default ON: when nvcc and a CUDA
#                                    torch are found; otherwise the CPU backend only)
#   FLASHCUTE_CUDA_ARCHS="80;90"     CUDA architectures (default: TORCH_CUDA_ARCH_LIST when set, e.g.
#                                    "8.0;9.0", else 80;90); the sm90 kernel family needs 90
#   MAX_JOBS=N                       parallel compile jobs (default: all cores)
#   NVCC_THREADS=N                   nvcc threads per unit (compiles a unit's archs in parallel)
#   FLASHCUTE_HEADDIMS="32;64;96;128;192;256"  head dims with kernels (others run on the next one up)
#   FLASHCUTE_DTYPES="fp16;bf16"     kernel dtypes
#   FLASHCUTE_DENSE_KERNELS=OFF      no kernels of their own for plain calls without a window or
#                                    causal mask (they run the windowed ones, as calls with dropout,
#                                    softcap or ALiBi always do): a shorter build, dense calls 1-2%
#                                    slower (default ON)
#   FLASHCUTE_CAUSAL_KERNELS=OFF     no kernels of their own for plain causal calls (they run the
#                                    windowed ones with the window (-1, 0)): a shorter build, causal
#                                    calls slower (README "Building"; default ON)
#   FLASHCUTE_UNWINDOWED_SPARSE_KERNELS=OFF  the same for plain block-sparse calls without a window
#                                    or causal mask: a shorter build, such calls 2-5% slower
#                                    (default ON)
#   FLASHCUTE_DTYPES_PER_UNIT=all|one|auto  dtypes per kernel unit (auto: all below 8 jobs, else one)
#   FLASHCUTE_SM80_ON_SM90=ON        also compile the sm80 family for sm90 GPUs where the sm90 family
#                                    serves the call (default OFF; for flashcute.kernels("sm80") there)
#   CMAKE_ARGS="-DCUTLASS_INCLUDE_DIR=/path/to/cutlass/include ..."  extra CMake options
#   PYTHON=python3                   the interpreter to install into
# ccache is used for g++ and nvcc when it is available (installed with apt-get when possible).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
start=$(date +%s)

# A Debian system Python refuses pip installs outside a virtual environment (PEP 668).
if "$PYTHON" - <<'PY'
import os, sys, sysconfig
managed = os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED"))
sys.exit(0 if managed and sys.prefix == sys.base_prefix else 1)
PY
then
  echo "install.sh: $PYTHON is an externally managed system Python; installing with --break-system-packages" >&2
  export PIP_BREAK_SYSTEM_PACKAGES=1
fi

echo "== build requirements"
"$PYTHON" -m pip install torch==2.11.0 nvidia-cutlass==4.2.0.0 scikit-build-core ninja "cmake>=3.26" pytest expecttest transformers==5.17.0

echo "== compiler cache"
if ! command -v ccache >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ccache) >/dev/null 2>&1 \
    || echo "install.sh: could not install ccache with apt-get; building without it" >&2
fi
if command -v ccache >/dev/null 2>&1; then
  export CMAKE_ARGS="${CMAKE_ARGS:-} -DCMAKE_CXX_COMPILER_LAUNCHER=ccache -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache"
  echo "using ccache ($(command -v ccache))"
else
  echo "ccache not found: building without a compiler cache"
fi

echo "== build and install flashcute"
# One compile job per core (ninja's own default is cores + 2: on a 2-core machine the default
# set took 2463 s that way, 2137 s with 2 jobs).
export CMAKE_BUILD_PARALLEL_LEVEL=${MAX_JOBS:-${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}}
echo "FLASHCUTE_ENABLE_CUDA=${FLASHCUTE_ENABLE_CUDA:-<default ON>} FLASHCUTE_CUDA_ARCHS=${FLASHCUTE_CUDA_ARCHS:-<default: TORCH_CUDA_ARCH_LIST or 80;90>}" \
     "FLASHCUTE_HEADDIMS=${FLASHCUTE_HEADDIMS:-<default all>} FLASHCUTE_DTYPES=${FLASHCUTE_DTYPES:-<default fp16;bf16>}"
echo "CMAKE_ARGS=${CMAKE_ARGS:-}"
build_start=$(date +%s)
"$PYTHON" -m pip install --no-build-isolation -v .
end=$(date +%s)

echo "== done: flashcute built and installed in $((end - build_start)) s (install.sh total $((end - start)) s)"
