"""What dropout costs each implementation over its own call without dropout, in one process:
flashcute (default family), SDPA-flash and SDPA-cuDNN, each without and with dropout, rounds
interleaved, `triton.testing.do_bench` medians (flashcute.bench's timer). bf16, 16384 tokens
(b = 16384 / s), 2048 / d heads. Issue 15 asks for flashcute's overhead; this puts the peers'
beside it (BENCHMARKS.md, "Dropout's cost against the peers' own").

usage: python scripts/bench_dropout_peers.py [--p 0.1] [--rounds 3] [--headdims 64 128]
       [--seqlens 4096 16384] [--modes fwd fwdbwd]
An implementation that refuses a call (e.g. a backend without dropout) prints nan and its error."""
import argparse
import statistics
import sys

import torch

import flashcute
from flashcute.bench import _make_runner, _timer, sdpa_forward

IMPLS = {
    "flashcute": lambda causal, p: lambda q, k, v: flashcute.attention(q, k, v, causal=causal, dropout_p=p),
    "sdpa_flash": lambda causal, p: sdpa_forward("FLASH_ATTENTION", causal, p),
    "sdpa_cudnn": lambda causal, p: sdpa_forward("CUDNN_ATTENTION", causal, p),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_dropout_peers.py: needs a CUDA device")
    timer = _timer("cuda")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | dropout_p = {args.p}")
    print("mode d s causal | impl: plain ms, dropout ms, overhead %")
    for mode in args.modes:
        for d in args.headdims:
            for s in args.seqlens:
                for causal in (False, True):
                    b, h = 16384 // s, 2048 // d
                    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
                    times = {}
                    for r in range(args.rounds):
                        for name, make in IMPLS.items():
                            for p in (0.0, args.p):
                                try:
                                    t = timer(_make_runner(make(causal, p), q, k, v, mode))
                                except Exception as e:  # a peer refusing the call: reported, not fatal
                                    t = float("nan")
                                    if r == 0:
                                        print(f"  {name} p={p}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                                times.setdefault((name, p), []).append(t)
                    med = {key: statistics.median(ts) for key, ts in times.items()}
                    line = " | ".join(f"{n}: {med[(n, 0.0)]:.3f} {med[(n, args.p)]:.3f} "
                                      f"{100 * (med[(n, args.p)] / med[(n, 0.0)] - 1):+.1f}%" for n in IMPLS)
                    print(f"{mode:6} {d:3} {s:5} {causal!s:5} | {line}", flush=True)


if __name__ == "__main__":
    main()
