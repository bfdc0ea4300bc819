#!/usr/bin/env bash
# Forward tile experiments on the GPU machine (a build with -DFLASHCUTE_TUNING=ON): times each
# tile of src/cuda/tuning.cu (FLASHCUTE_FWD_TILE) against SDPA's flash backend, bf16.
# Prints: tile, head dim, causal, seqlen, flashcute TFLOP/s, flash TFLOP/s, flash time / ours.
set -uo pipefail
OUT=${OUT:-/tmp/tile_sweep}
mkdir -p "$OUT"
SEQLENS=${SEQLENS:-1024 4096 16384}
run() {  # $1 tile ("" = FwdConfig's), $2 head dim
  FLASHCUTE_FWD_TILE="$1" python3 -m flashcute.bench --headdims "$2" --modes fwd --peers sdpa_flash \
      --seqlens $SEQLENS --out "$OUT/t_${1:-default}_$2" > /dev/null 2>&1
  python3 - "$OUT/t_${1:-default}_$2/bench.json" "${1:-default}" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
pts = {}
for r in rows:
    pts.setdefault((r["headdim"], r["causal"], r["seqlen"]), {})[r["impl"]] = r
for (d, c, s), p in sorted(pts.items()):
    f, o = p.get("sdpa_flash"), p.get("flashcute")
    if f and o:
        print(f"{sys.argv[2]:>10} d={d:<4} causal={c!s:<5} s={s:<6} ours {o['tflops']:6.1f}  flash {f['tflops']:6.1f}  x{f['ms'] / o['ms']:.3f}")
PY
}
for t in "" 128,128,4 128,128,8; do run "$t" 64; done
for t in "" 128,128,8 128,32,4 64,64,4; do run "$t" 128; done
