#!/usr/bin/env bash
# The one command for the GPU machine: build (all cores), GPU tests, compute-sanitizer,
# benchmark; logs under $OUT (or ./gpu_out); a short summary table printed last.
#
# On the device:  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl \
#                   && export PYTHONPATH=/tmp/site; bash scripts/gpu_check.sh
# Environment: FLASHCUTE_CUDA_ARCHS (default 90), FLASHCUTE_HEADDIMS, FLASHCUTE_DTYPES (defaults:
# all), GPU_CHECK_STEPS (default "build test sanitize bench"; "profile" adds Nsight Compute),
# BENCH_ARGS, BENCH_SPARSE_ARGS, PROFILE_ARGS (flags for flashcute.bench, flashcute.bench --block-sparse,
# flashcute.profile).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
STEPS=${GPU_CHECK_STEPS:-build test sanitize bench}
BUILD=${FLASHCUTE_BUILD_DIR:-$ROOT/build-gpu}
declare -A RESULT
summary() {
  echo
  echo "==== gpu_check summary ($(date -u +%Y-%m-%dT%H:%MZ)) ===="
  python3 -c "import torch; print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__)" 2>/dev/null
  for s in build test bench sanitize profile; do
    [ -n "${RESULT[$s]:-}" ] && printf '%-9s %s\n' "$s" "${RESULT[$s]}"
  done
  [ -f "$OUT/bench.txt" ] && { echo; sed -n '/^mode/,$p' "$OUT/bench.txt"; }
  [ -f "$OUT/bench_sparse/bench.txt" ] && { echo; sed -n '/^mode/,$p' "$OUT/bench_sparse/bench.txt"; }
}
trap summary EXIT

has() { [[ " $STEPS " == *" $1 "* ]]; }

# The compiler: the system's g++ unless FLASHCUTE_CXX names one. (This workplace's GPU machine
# sets CXX=/opt/gcc/bin/g++; our library built with it carried libstdc++ code of its own, and
# formatting a torch error message segfaulted. docs/NOTES.md has the details.)
CXX_FOR_BUILD=${FLASHCUTE_CXX:-$( [ -x /usr/bin/g++ ] && echo /usr/bin/g++ || echo "${CXX:-g++}")}

# CuTe headers: the nvidia-cutlass package; where it is not installed, a carried wheel in .whl/.
if ! python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('cutlass_library') is None)" \
    && ls .whl/nvidia_cutlass-*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/nvidia_cutlass-*.whl &&
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi

if has build; then
  t0=$(date +%s)
  CXX=$CXX_FOR_BUILD CUDAHOSTCXX=$CXX_FOR_BUILD \
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DFLASHCUTE_CUDA_ARCHS="${FLASHCUTE_CUDA_ARCHS:-90}" \
      ${FLASHCUTE_HEADDIMS:+-DFLASHCUTE_HEADDIMS="$FLASHCUTE_HEADDIMS"} \
      ${FLASHCUTE_DTYPES:+-DFLASHCUTE_DTYPES="$FLASHCUTE_DTYPES"} > "$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" -j "$(nproc)" >> "$OUT/build.log" 2>&1
  rc=$?
  grep -E "spill|error" "$OUT/build.log" | sort | uniq | head -20
  RESULT[build]="rc=$rc in $(( $(date +%s) - t0 )) s ($(nproc) cores, $CXX_FOR_BUILD)"
  [ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
fi
export FLASHCUTE_LIBRARY=$BUILD/libflashcute_ops.so
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1

if has test; then
  python3 scripts/diagnose_errors.py > "$OUT/diagnose.log" 2>&1 || echo "diagnose_errors.py failed: rc=$?" >> "$OUT/diagnose.log"
  cat "$OUT/diagnose.log"
  PYTEST_MARK=${PYTEST_MARK-gpu}  # PYTEST_MARK="" runs every test, the CPU ones too
  python3 -m pytest ${PYTEST_MARK:+-m "$PYTEST_MARK"} tests -q --maxfail=25 -p no:cacheprovider 2>&1 | tee "$OUT/pytest.log" | tail -25
  RESULT[test]="$(tail -1 "$OUT/pytest.log")"
fi

if has bench; then
  python3 -m flashcute.bench --out "$OUT" ${BENCH_ARGS:---modes fwd bwd fwdbwd --peers sdpa_flash sdpa_cudnn} \
      2> "$OUT/bench.log"
  RESULT[bench]="rc=$? (table below; $OUT/bench.{csv,json,png})"
  python3 -m flashcute.bench --block-sparse --out "$OUT/bench_sparse" ${BENCH_SPARSE_ARGS:-} \
      2> "$OUT/bench_sparse.log"
  RESULT[bench]+="; --block-sparse rc=$? (table below; $OUT/bench_sparse/)"
fi

if has sanitize; then
  res=""
  for tool in memcheck racecheck; do
    compute-sanitizer --tool $tool --error-exitcode 9 python3 scripts/sanitize_shapes.py \
        > "$OUT/sanitize_$tool.log" 2>&1
    rc=$?
    res+="$tool rc=$rc ($(grep -c '^ok' "$OUT/sanitize_$tool.log") shapes, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sanitize_$tool.log" | tail -1)); "
    [ $rc -eq 0 ] || tail -30 "$OUT/sanitize_$tool.log"
  done
  RESULT[sanitize]="$res"
fi

if has profile; then
  { python3 -m flashcute.profile ${PROFILE_ARGS:---seqlen 4096 --headdim 128} &&
    python3 -m flashcute.profile ${PROFILE_ARGS:---seqlen 4096 --headdim 128} --causal &&
    python3 -m flashcute.profile ${PROFILE_ARGS:---seqlen 4096 --headdim 128} --block-sparse 0.25 &&
    python3 -m flashcute.profile --torch-trace "$OUT/trace.json" ${PROFILE_ARGS:---seqlen 4096 --headdim 128}
  } > "$OUT/profile.txt" 2>&1
  RESULT[profile]="rc=$? ($OUT/profile.txt)"
  cat "$OUT/profile.txt" | grep -v '^\$' | head -40
fi
