#!/usr/bin/env bash
# The one command for the GPU machine: build (all cores), GPU tests, compute-sanitizer,
# benchmarks; logs under $OUT (or ./gpu_out); a short summary table printed last.
#
#   bash scripts/gpu_check.sh
#
# Environment:
#   GPU_CHECK_STEPS  steps to run (default "build test sanitize bench decode"); also "baseline" (build the
#                    commit in .base/ (git archive of the commit before the restructure, carried) and
#                    bench it in its own process, for before/after ratios), "variant" (build the
#                    tree VARIANT_SRC (default: this one; or e.g. a carried `git archive` of another
#                    commit) with VARIANT_CUDA_FLAGS, e.g. -DFLASHCUTE_SM90_BWD_D64_BLOCK_M=64, for
#                    VARIANT_HEADDIMS (default 64) bf16, beside the main build; then COMPARE_ROUNDS
#                    alternating bench runs of the two (VARIANT_BENCH_ARGS), compared per point into
#                    $OUT/variant.txt: old = the variant, new = this build; VARIANT_CMAKE_ARGS: CMake
#                    options of the variant build (e.g. -DFLASHCUTE_CAUSAL_KERNELS=OFF); VARIANT_IMPL (default
#                    flashcute, e.g. "flashcute[sm80]" or softcap) and VARIANT_PEER (default
#                    sdpa_cudnn) pick the rows), "compare" (after
#                    "baseline": COMPARE_ROUNDS (default 2) alternating runs of the old build's
#                    bench and this build's sm80 family, each in its own process, compared per grid
#                    point by scripts/compare_bench.py into $OUT/compare.txt), "sparse" (block-sparse
#                    bench), "gpt" (scripts/bench_integrations.py gpt: a compiled GPT block, flashcute
#                    against F.scaled_dot_product_attention; GPT_ARGS), "llama" (its llama: the HF
#                    Llama training step through the integration against HF sdpa; LLAMA_ARGS), "profile" (Nsight Compute), "ptxas"
#                    (register table of the build)
#   FLASHCUTE_CUDA_ARCHS (default 90), FLASHCUTE_HEADDIMS, FLASHCUTE_DTYPES (defaults: all)
#   FLASHCUTE_SM80_ON_SM90 (default ON here, so that the tests and the sanitizers run both kernel
#                    families on the sm90 GPU; OFF builds what a default install has: the sm80
#                    family only where the sm90 family has no kernel)
#   GPU_CHECK_CMAKE_ARGS extra CMake options of the main build (e.g. -DFLASHCUTE_UNWINDOWED_SPARSE_KERNELS=OFF;
#                    -DCMAKE_CUDA_FLAGS=-DFLASHCUTE_SM80_DQ_SCALAR_ATOMICS runs the sm80 backward's
#                    sm_80 dQ reductions on the sm90 GPU, to test that path there)
#   PYTEST_MARK (default gpu), PYTEST_ARGS (e.g. "-k sm90" or a file list; default: tests)
#   BENCH_ARGS, BASELINE_BENCH_ARGS, BENCH_SPARSE_ARGS, DECODE_ARGS, PROFILE_ARGS: flags for the tools
# Where nvidia-cutlass is not installed (this workplace's GPU machine), put its wheel in .whl/.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu_out}
mkdir -p "$OUT"
STEPS=${GPU_CHECK_STEPS:-build test sanitize bench decode}
BUILD=${FLASHCUTE_BUILD_DIR:-$ROOT/build-gpu}
declare -A RESULT
summary() {
  echo
  echo "==== gpu_check summary ($(date -u +%Y-%m-%dT%H:%MZ)) ===="
  python3 -c "import torch; print('device:', torch.cuda.get_device_name(), '| torch', torch.__version__)" 2>/dev/null
  for s in build baseline compare variant test bench decode sparse gpt llama sanitize profile; do
    [ -n "${RESULT[$s]:-}" ] && printf '%-9s %s\n' "$s" "${RESULT[$s]}"
  done
  [ -f "$OUT/compare.txt" ] && { echo; echo "# $OUT/compare.txt (old build vs this build's sm80 family)"; sed -n '/^mode .*points/,$p' "$OUT/compare.txt"; }
  [ -f "$OUT/gpt.txt" ] && { echo; echo "# $OUT/gpt.txt"; sed -n '/^compiled GPT/,$p' "$OUT/gpt.txt"; }
  [ -f "$OUT/llama.txt" ] && { echo; echo "# $OUT/llama.txt"; sed -n '/-layer random Llama/,$p' "$OUT/llama.txt"; }
  [ -f "$OUT/variant.txt" ] && { echo; echo "# $OUT/variant.txt (old: ${VARIANT_SRC:-.} ${VARIANT_CUDA_FLAGS:-}; new: this build)"; cat "$OUT/variant.txt"; }
  for f in "$OUT/baseline/bench.txt" "$OUT/bench.txt" "$OUT/bench_sparse/bench.txt"; do
    [ -f "$f" ] && { echo; echo "# $f"; sed -n '/^mode/,$p' "$f"; }
  done
  for f in "$OUT/bench_decode/bench.txt" "$OUT/bench_decode_hd/bench.txt"; do
    [ -f "$f" ] && { echo; echo "# $f"; sed -n '/^decode:/,$p' "$f"; }
  done
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

build() {  # build <source dir> <build dir> <log> [extra cmake args...]
  local src=$1 dir=$2 log=$3
  shift 3
  CXX=$CXX_FOR_BUILD CUDAHOSTCXX=$CXX_FOR_BUILD \
  cmake -S "$src" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_FLAGS=-Xptxas=-v \
      -DFLASHCUTE_CUDA_ARCHS="${FLASHCUTE_CUDA_ARCHS:-90}" -DFLASHCUTE_SM80_ON_SM90="${FLASHCUTE_SM80_ON_SM90:-ON}" \
      "$@" > "$log" 2>&1 &&
    cmake --build "$dir" -j "$(nproc)" >> "$log" 2>&1
}

build_base() {  # the commit before the restructure (.base/), d64/d128 bf16
  build .base "$ROOT/build-base" "$OUT/baseline_build.log" -DFLASHCUTE_HEADDIMS="64;128" -DFLASHCUTE_DTYPES=bf16
}

if has build; then
  t0=$(date +%s)
  if has variant; then  # built alongside the main build (its few units fill the cores the main build leaves)
    build "${VARIANT_SRC:-.}" "$ROOT/build-variant" "$OUT/variant_build.log" -DFLASHCUTE_HEADDIMS="${VARIANT_HEADDIMS:-64}" \
        -DFLASHCUTE_DTYPES=bf16 "-DCMAKE_CUDA_FLAGS=-Xptxas=-v ${VARIANT_CUDA_FLAGS:-}" ${VARIANT_CMAKE_ARGS:-} &
    variant_pid=$!
  fi
  if has baseline && [ -d .base ]; then  # the same for the old commit's few units
    build_base &
    baseline_pid=$!
  fi
  build . "$BUILD" "$OUT/build.log" ${GPU_CHECK_CMAKE_ARGS:-} \
      $([ -n "${FLASHCUTE_HEADDIMS:-}" ] && echo "-DFLASHCUTE_HEADDIMS=$FLASHCUTE_HEADDIMS" || echo -UFLASHCUTE_HEADDIMS) \
      $([ -n "${FLASHCUTE_DTYPES:-}" ] && echo "-DFLASHCUTE_DTYPES=$FLASHCUTE_DTYPES" || echo -UFLASHCUTE_DTYPES)
  # (-U: unset, a reused build directory forgets an earlier restricted set and takes CMake's default)
  rc=$?
  if has variant; then wait $variant_pid || echo "variant build failed: rc=$?"; fi
  if [ -n "${baseline_pid:-}" ]; then wait $baseline_pid; baseline_rc=$?; fi
  grep -E "spill|error|warning C75" "$OUT/build.log" | grep -v " 0 bytes spill" | sort | uniq | head -20
  RESULT[build]="rc=$rc in $(( $(date +%s) - t0 )) s ($(nproc) cores, $CXX_FOR_BUILD)"
  [ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; exit 1; }
  has ptxas && python3 scripts/ptxas_table.py "$OUT/build.log" > "$OUT/ptxas.md"
fi
export PYTHONUNBUFFERED=1

if has baseline && [ -d .base ]; then
  # The commit before the restructure, built and benchmarked in its own process (one op library
  # per process); its ratios to the peers timed beside it are comparable to this tree's.
  t0=$(date +%s)
  if [ -n "${baseline_rc:-}" ]; then  # built beside the main build
    rc=$baseline_rc
  else
    build_base
    rc=$?
  fi
  if [ $rc -eq 0 ] && ! has compare; then  # compare benches it itself
    FLASHCUTE_LIBRARY=$ROOT/build-base/libflashcute_ops.so PYTHONPATH=$ROOT/.base/python${PYTHONPATH:+:$PYTHONPATH} \
      python3 -m flashcute.bench --out "$OUT/baseline" \
      ${BASELINE_BENCH_ARGS:---modes fwd bwd fwdbwd --peers sdpa_flash sdpa_cudnn} > /dev/null \
      2> "$OUT/baseline_bench.log"
    rc=$?
  fi
  RESULT[baseline]="rc=$rc in $(( $(date +%s) - t0 )) s (.base: build d64/d128 bf16 + bench)"
fi

# alternate_bench <dir> <log> <old lib> <old python dir> <new lib> <new's extra args> <bench args...>:
# COMPARE_ROUNDS (default 2) alternating bench runs of two builds, each in its own process (one op
# library per process), so that drifts of the machine (clocks, temperature) hit both alike; the
# CSVs land as <dir>/old_<r>.csv and <dir>/new_<r>.csv for scripts/compare_bench.py.
alternate_bench() {
  local dir=$1 log=$2 old_lib=$3 old_py=$4 new_lib=$5 new_extra=$6
  shift 6
  mkdir -p "$dir"
  for r in $(seq "${COMPARE_ROUNDS:-2}"); do
    FLASHCUTE_LIBRARY=$old_lib PYTHONPATH=$old_py${PYTHONPATH:+:$PYTHONPATH} \
      python3 -m flashcute.bench --out "/tmp/alt_old_$r" "$@" > /dev/null 2>> "$log" &&
      cp "/tmp/alt_old_$r/bench.csv" "$dir/old_$r.csv"
    FLASHCUTE_LIBRARY=$new_lib PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH} \
      python3 -m flashcute.bench --out "/tmp/alt_new_$r" "$@" $new_extra > /dev/null 2>> "$log" &&
      cp "/tmp/alt_new_$r/bench.csv" "$dir/new_$r.csv"
  done
}

if has compare && [ -f "$ROOT/build-base/libflashcute_ops.so" ]; then
  t0=$(date +%s)
  alternate_bench "$OUT/cmp" "$OUT/compare.log" "$ROOT/build-base/libflashcute_ops.so" "$ROOT/.base/python" \
      "$BUILD/libflashcute_ops.so" "--kernels sm80 --families none" \
      ${COMPARE_BENCH_ARGS:---modes fwd bwd fwdbwd --peers sdpa_flash}
  # (This build times its sm80 family as the process-wide family, beside the same peers in the same
  # order as the old build's bench: with the sm90 family timed first in each point, session 31's
  # sm80 d128 causal forward was +2.3..+2.7% against the old build where its kernel time was +0.6..+1.5%.)
  python3 scripts/compare_bench.py --old "$OUT"/cmp/old_*.csv --new "$OUT"/cmp/new_*.csv --new-impl flashcute \
      > "$OUT/compare.txt"
  RESULT[compare]="rc=$? in $(( $(date +%s) - t0 )) s ($OUT/compare.txt)"
fi

if has variant && [ -f "$ROOT/build-variant/libflashcute_ops.so" ]; then
  t0=$(date +%s)
  alternate_bench "$OUT/var" "$OUT/variant.log" "$ROOT/build-variant/libflashcute_ops.so" "$ROOT/python" \
      "$BUILD/libflashcute_ops.so" "" \
      ${VARIANT_BENCH_ARGS:---modes bwd fwdbwd --headdims 64 --seqlens 1024 4096 16384 --peers sdpa_cudnn --families none}
  python3 scripts/compare_bench.py --old "$OUT"/var/old_*.csv --new "$OUT"/var/new_*.csv \
      --old-impl "${VARIANT_IMPL:-flashcute}" --new-impl "${VARIANT_IMPL:-flashcute}" \
      --peer "${VARIANT_PEER:-sdpa_cudnn}" > "$OUT/variant.txt"
  RESULT[variant]="rc=$? in $(( $(date +%s) - t0 )) s ($OUT/variant.txt)"
fi

export FLASHCUTE_LIBRARY=$BUILD/libflashcute_ops.so
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}

if has test; then
  python3 scripts/diagnose_errors.py > "$OUT/diagnose.log" 2>&1 || echo "diagnose_errors.py failed: rc=$?" >> "$OUT/diagnose.log"
  tail -5 "$OUT/diagnose.log"
  PYTEST_MARK=${PYTEST_MARK-gpu}  # PYTEST_MARK="" runs every test, the CPU ones too
  python3 -m pytest ${PYTEST_MARK:+-m "$PYTEST_MARK"} ${PYTEST_ARGS:-tests} -q --maxfail=25 -p no:cacheprovider \
      2>&1 | tee "$OUT/pytest.log" | tail -30
  RESULT[test]="$(tail -1 "$OUT/pytest.log")"
fi

if has bench; then
  python3 -m flashcute.bench --out "$OUT" ${BENCH_ARGS:---modes fwd bwd fwdbwd --peers sdpa_flash sdpa_cudnn --rounds 3} \
      > /dev/null 2> "$OUT/bench.log"
  RESULT[bench]="rc=$? ($OUT/bench.{txt,csv,json,png})"
fi

if has decode; then  # issue 13's decode sweep (d128), and d64 / d192 / d256 at b 1 and 8 (session 51's decoding loop
                     # had slowed d256 by 56-66% at b 1 while the d128 sweep saw nothing: session 52)
  python3 -m flashcute.bench --decode --peers sdpa_cudnn --append-cache 0 --out "$OUT/bench_decode" \
      ${DECODE_ARGS:-} > /dev/null 2> "$OUT/bench_decode.log"
  rc=$?
  python3 -m flashcute.bench --decode --peers sdpa_cudnn --append-cache 0 --chunk 0 --headdims 64 192 256 \
      --batches 1 8 --caches 8192 32768 --kv-heads 8 --layouts contig paged128 --out "$OUT/bench_decode_hd" \
      > /dev/null 2>> "$OUT/bench_decode.log"
  RESULT[decode]="rc=$rc, $? ($OUT/bench_decode{,_hd}/)"
fi

if has sparse; then
  python3 -m flashcute.bench --block-sparse --out "$OUT/bench_sparse" ${BENCH_SPARSE_ARGS:-} \
      > /dev/null 2> "$OUT/bench_sparse.log"
  RESULT[sparse]="rc=$? ($OUT/bench_sparse/)"
fi

if has gpt; then
  python3 scripts/bench_integrations.py gpt --out "$OUT/gpt.json" ${GPT_ARGS:-} > "$OUT/gpt.txt" 2> "$OUT/gpt.log"
  RESULT[gpt]="rc=$? ($OUT/gpt.txt)"
fi

if has llama; then
  python3 scripts/bench_integrations.py llama --out "$OUT/llama.json" ${LLAMA_ARGS:-} > "$OUT/llama.txt" 2> "$OUT/llama.log"
  RESULT[llama]="rc=$? ($OUT/llama.txt)"
fi

if has sanitize; then
  res=""
  for tool in memcheck racecheck synccheck; do
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
  grep -v '^\$' "$OUT/profile.txt" | head -40
fi
