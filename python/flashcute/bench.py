"""Benchmark flashcute against its peers: ``python -m flashcute.bench``.

Times flashcute and, in the same process on the same random inputs, torch SDPA's flash,
cuDNN, efficient (and math, at small sizes) backends and FlexAttention, with medians of
``triton.testing.do_bench`` (CUDA events, warm-up, cache flush). Prints a table of ms,
TFLOP/s and the ratio of flashcute's speed to each peer's; writes CSV and JSON (and PNG
plots when matplotlib is there) to --out.

FLOPs: 4 * batch * heads * seqlen_q * seqlen_k * headdim for the forward (halved when
causal), 2.5x that for the backward, 3.5x for forward + backward.

Without a GPU it compares the CPU backend with torch's CPU SDPA at small sizes.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

import flashcute

MODE_FLOP_FACTOR = {"fwd": 1.0, "bwd": 2.5, "fwdbwd": 3.5}
SDPA_BACKENDS = {
    "sdpa_flash": "FLASH_ATTENTION",
    "sdpa_cudnn": "CUDNN_ATTENTION",
    "sdpa_efficient": "EFFICIENT_ATTENTION",
    "sdpa_math": "MATH",
}


def attention_flops(batch, nheads, seqlen_q, seqlen_k, headdim, causal, mode):
    flops = 4.0 * batch * nheads * seqlen_q * seqlen_k * headdim
    if causal:
        flops /= 2
    return flops * MODE_FLOP_FACTOR[mode]


def _timer(device):
    """Median milliseconds of fn(): triton's do_bench on CUDA, a wall clock on CPU."""
    if device == "cuda":
        try:
            from triton.testing import do_bench

            return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median")
        except ImportError:
            return _cuda_event_timer

    def cpu_time(fn, reps=5):
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return sorted(times)[len(times) // 2]

    return cpu_time


def _cuda_event_timer(fn, reps=50):
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _make_runner(forward, q, k, v, mode):
    """A closure timing `mode` of forward(q, k, v) -> out."""
    if mode == "fwd":
        return lambda: forward(q, k, v)
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if mode == "fwdbwd":
        def run():
            out = forward(q, k, v)
            out.backward(dout)
        dout = torch.randn_like(forward(q, k, v))
        return run
    out = forward(q, k, v)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


ALL_PEERS = [*SDPA_BACKENDS, "flex"]


def _peers(device, causal, seqlen, headdim, math_max_seqlen, wanted):
    """name -> forward(q, k, v) in flashcute's (b, s, h, d) layout, for the wanted peers that apply."""
    peers = {}

    def sdpa_with(backend_name):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)

        def fwd(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      is_causal=causal).transpose(1, 2)
        return fwd

    if device == "cuda":
        for name, backend in SDPA_BACKENDS.items():
            if name not in wanted or (name == "sdpa_math" and seqlen > math_max_seqlen):
                continue
            peers[name] = sdpa_with(backend)
        if "flex" not in wanted:
            return peers
        try:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention

            flex = torch.compile(flex_attention, dynamic=False)
            block_mask = None
            if causal:
                block_mask = create_block_mask(lambda b, h, q_idx, kv_idx: q_idx >= kv_idx, None, None,
                                               seqlen, seqlen, device=device)

            def flex_fwd(q, k, v):
                return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            block_mask=block_mask).transpose(1, 2)
            peers["flex"] = flex_fwd
        except Exception as exc:  # noqa: BLE001 - FlexAttention is optional
            print(f"# FlexAttention skipped: {exc}", file=sys.stderr)
    else:
        peers["sdpa_cpu"] = lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    return peers


def run_sweep(args):
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = getattr(torch, args.dtype)
    if device == "cpu":
        print("# no CUDA GPU: timing the CPU backend against torch's CPU SDPA; GPU peers skipped")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            dtype = torch.float32
    timer = _timer(device)
    rows = []
    points = [(d, s, c, m) for d in args.headdims for s in args.seqlens for c in args.causal for m in args.modes]
    for idx, (headdim, seqlen, causal, mode) in enumerate(points, 1):
        batch = max(1, args.tokens // seqlen)
        nheads = max(1, args.hidden // headdim)
        gen = torch.Generator(device=device).manual_seed(idx)
        q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen)
                   for _ in range(3))
        flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, mode)
        impls = {"flashcute": lambda q, k, v: flashcute.attention(q, k, v, causal=causal)}
        if not args.no_peers:
            impls.update(_peers(device, causal, seqlen, headdim, args.math_max_seqlen, args.peers))
        times = {}
        for name, fwd in impls.items():
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    times[name] = timer(_make_runner(fwd, q, k, v, mode))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run this point is skipped
                print(f"# {name} skipped at d={headdim} s={seqlen} causal={causal} {mode}: "
                      f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}", file=sys.stderr)
        for name, ms in times.items():
            rows.append(dict(impl=name, mode=mode, dtype=str(dtype).replace("torch.", ""), headdim=headdim,
                             seqlen=seqlen, batch=batch, nheads=nheads, causal=causal, ms=ms,
                             tflops=flops / ms / 1e9,
                             peer_over_flashcute=ms / times["flashcute"] if "flashcute" in times else None))
        print(f"[{idx}/{len(points)}] d={headdim} s={seqlen} causal={causal} {mode}: " +
              ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()), file=sys.stderr, flush=True)
        del q, k, v
    return device, rows


def format_table(rows):
    """One line per point: flashcute's ms and TFLOP/s, and its speed over each peer's."""
    points = {}
    for r in rows:
        key = (r["mode"], r["headdim"], r["causal"], r["seqlen"])
        points.setdefault(key, {})[r["impl"]] = r
    peers = sorted({r["impl"] for r in rows} - {"flashcute"})
    head = f"{'mode':7}{'d':>5}{'causal':>7}{'seqlen':>7}{'ms':>9}{'TFLOP/s':>9}" + "".join(
        f"{'x ' + p:>16}" for p in peers)
    lines = [head, "-" * len(head)]
    for (mode, d, c, s), impls in sorted(points.items()):
        ours = impls.get("flashcute")
        line = f"{mode:7}{d:5}{str(c):>7}{s:7}"
        line += f"{ours['ms']:9.3f}{ours['tflops']:9.1f}" if ours else f"{'-':>9}{'-':>9}"
        for p in peers:
            r = impls.get(p)
            line += f"{r['ms'] / ours['ms']:16.2f}" if (r and ours) else f"{'-':>16}"
        lines.append(line)
    lines.append("x peer = peer time / flashcute time (> 1: flashcute faster)")
    return "\n".join(lines)


def markdown_report(env, rows, command, plot=None):
    """BENCHMARKS.md-style section: environment, then one table per mode of flashcute's
    TFLOP/s and each peer's time over flashcute's (> 1: flashcute faster)."""
    peers = sorted({r["impl"] for r in rows} - {"flashcute"})
    out = [f"Device: {env['device']}; date: {env['date']}; torch {env['torch']}"
           f"{'; CUDA ' + env['cuda'] if env.get('cuda') else ''}.", "",
           f"Command: `{command}`", ""]
    for mode in sorted({r["mode"] for r in rows}, key=list(MODE_FLOP_FACTOR).index):
        out += [f"### {mode}", "",
                "| d | causal | seqlen | batch x heads | flashcute ms | flashcute TFLOP/s | " +
                " | ".join(f"{p} TFLOP/s | {p} / flashcute" for p in peers) + " |",
                "|" + "---|" * (5 + 2 * len(peers) + 1)]
        points = {}
        for r in rows:
            if r["mode"] == mode:
                points.setdefault((r["headdim"], r["causal"], r["seqlen"]), {})[r["impl"]] = r
        for (d, c, s), impls in sorted(points.items()):
            ours = impls.get("flashcute")
            if ours is None:
                continue
            cells = [str(d), str(c), str(s), f"{ours['batch']}x{ours['nheads']}", f"{ours['ms']:.3f}",
                     f"{ours['tflops']:.1f}"]
            for p in peers:
                r = impls.get(p)
                cells += [f"{r['tflops']:.1f}", f"{r['ms'] / ours['ms']:.2f}"] if r else ["-", "-"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    if plot:
        out += [f"![TFLOP/s vs seqlen]({plot})", ""]
    return "\n".join(out)


def environment():
    info = dict(date=datetime.date.today().isoformat(), torch=torch.__version__, python=platform.python_version())
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    else:
        info["device"] = platform.processor() or platform.machine()
    return info


def write_outputs(out_dir: Path, env, rows, table):
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    with open(out_dir / "bench.csv", "w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    (out_dir / "bench.md").write_text(markdown_report(env, rows, "python -m flashcute.bench " + " ".join(sys.argv[1:]),
                                                      plot="bench.png"))
    (out_dir / "bench.txt").write_text(
        "\n".join(f"{k}: {v}" for k, v in env.items()) + "\n\n" + table + "\n")
    plot(rows, env, out_dir / "bench.png")


def plot(rows, env, path):
    """TFLOP/s vs seqlen, one panel per (mode, head dim, causal): modes in rows."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    modes = [m for m in MODE_FLOP_FACTOR if any(r["mode"] == m for r in rows)]
    cols = sorted({(r["headdim"], r["causal"]) for r in rows})
    if not modes or not cols:
        return
    fig, axes = plt.subplots(len(modes), len(cols), figsize=(3.6 * len(cols), 2.9 * len(modes)), squeeze=False)
    impls = sorted({r["impl"] for r in rows})
    for i, mode in enumerate(modes):
        for j, (d, c) in enumerate(cols):
            ax = axes[i][j]
            for impl in impls:
                pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                             if (r["mode"], r["headdim"], r["causal"], r["impl"]) == (mode, d, c, impl))
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=impl, linewidth=2.5 if impl == "flashcute" else 1)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}  d={d}  causal={c}", fontsize=9)
            ax.set_xlabel("seqlen", fontsize=8)
            ax.set_ylabel("TFLOP/s", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{env['device']}, {env['date']}, {env.get('torch', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashcute.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seqlens", type=int, nargs="+", default=None,
                   help="default: 512..16384 on CUDA, 128 256 512 on CPU")
    p.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+",
                   default=[False, True])
    p.add_argument("--modes", nargs="+", choices=list(MODE_FLOP_FACTOR), default=["fwd"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=int, default=16384, help="batch * seqlen")
    p.add_argument("--hidden", type=int, default=2048, help="nheads * headdim")
    p.add_argument("--math-max-seqlen", type=int, default=2048)
    p.add_argument("--peers", nargs="+", choices=ALL_PEERS, default=ALL_PEERS,
                   help="GPU peers to time (the CPU peer is torch's CPU SDPA)")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--cpu", action="store_true", help="time the CPU backend even when a GPU is there")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    args = p.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not args.cpu
    if args.seqlens is None:
        args.seqlens = [512, 1024, 2048, 4096, 8192, 16384] if on_gpu else [128, 256, 512]
    if not on_gpu and args.tokens == 16384:
        args.tokens, args.hidden = 1024, 256
    device, rows = run_sweep(args)
    env = environment()
    table = format_table(rows)
    write_outputs(args.out, env, rows, table)
    print("\n".join(f"{k}: {v}" for k, v in env.items()))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
