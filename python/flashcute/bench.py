"""Benchmark flashcute against its peers: ``python -m flashcute.bench``.

Times flashcute and, in the same process on the same random inputs, torch SDPA's flash,
cuDNN, efficient (and math, at small sizes) backends and FlexAttention, with medians of
``triton.testing.do_bench`` (CUDA events, warm-up, cache flush). Prints a table of ms,
TFLOP/s and the ratio of flashcute's speed to each peer's; writes CSV and JSON (and PNG
plots when matplotlib is there) to --out.

FLOPs: 4 * batch * heads * seqlen_q * seqlen_k * headdim for the forward (halved when
causal), 2.5x that for the backward, 3.5x for forward + backward.

Without a GPU it compares the CPU backend with torch's CPU SDPA at small sizes.

``--block-sparse`` times, instead, flashcute with random block masks of each --densities
(``flashcute.masks.random_blocks``) and, on causal points, a --window-wide sliding window,
against dense flashcute and FlexAttention with the equivalent BlockMask (``mask.as_flex()``:
full blocks only; with causal=True, a BlockMask of the mask's blocks and the causal mask), in
one process on the same inputs. Its defaults are issue 5's figure: bf16, d=128, seqlen 8192
and 16384, fwd and fwdbwd. FLOPs count only the scores the mask (and causal) keep:
``flop_fraction`` x the dense call's (with the same causal), computed per score from the
mask's block lists; for a random mask without causal it is its density. Each row gets the
bound ``1.15 * flop_fraction * dense_ms + 0.020`` ms (issue 5) and whether flashcute meets
it; flex rows the ratio flex ms / flashcute ms. The plot shows time vs density. Without a
GPU it runs the CPU backend's block-sparse path against its dense one (no FlexAttention).
"""
from __future__ import annotations

import argparse
import csv
import datetime
import functools
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
    if mode == "fwdbwd":  # autograd.grad, not .backward(): no gradient accumulation kernels timed
        dout = torch.randn_like(forward(q, k, v))
        return lambda: torch.autograd.grad(forward(q, k, v), (q, k, v), dout)
    out = forward(q, k, v)
    dout = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)


ALL_PEERS = [*SDPA_BACKENDS, "flex"]


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # One graph per shape and BlockMask structure: a sweep needs more than dynamo's default 8.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(flex_attention, dynamic=False)


def _flex_forward(mask, causal, seqlen, device):
    """FlexAttention's forward(q, k, v) with the BlockMask equivalent to flashcute's `mask`
    (None: dense) combined with `causal`, or None when FlexAttention is not there."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        flex = _compiled_flex()
        if not causal:
            block_mask = None if mask is None else mask.as_flex()
        else:  # causal & the mask's blocks: full blocks below the diagonal, partial ones on it
            keep = None if mask is None else mask.to_block_dense()[0, 0].to(device)  # the bench's masks broadcast
            bq, bk = (128, 128) if mask is None else mask.block_size

            def mask_mod(b, h, q_idx, kv_idx):
                kept = q_idx >= kv_idx
                return kept if keep is None else kept & keep[q_idx // bq, kv_idx // bk]
            block_mask = create_block_mask(mask_mod, None, None, seqlen, seqlen, device=device, BLOCK_SIZE=(bq, bk))
    except Exception as exc:  # noqa: BLE001 - FlexAttention is optional
        print(f"# FlexAttention skipped: {exc}", file=sys.stderr)
        return None
    return lambda q, k, v: flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                block_mask=block_mask).transpose(1, 2)


def flop_fraction(mask, seqlen_q, seqlen_k, causal):
    """The scores `mask` keeps (with `causal`) over those the dense call with the same `causal`
    computes, counted per score and averaged over the mask's batch and heads."""
    table = mask.to_block_dense().cpu()
    (bq, bk), (nq, nkv) = mask.block_size, table.shape[-2:]
    query = torch.arange(nq * bq)[:, None]
    first_key = torch.arange(nkv) * bk
    keys = (seqlen_k - first_key).clamp(0, bk).expand(nq * bq, nkv)  # per query and key block
    if causal:  # query i sees the keys j <= i + seqlen_k - seqlen_q
        keys = torch.minimum(keys, (query + seqlen_k - seqlen_q + 1 - first_key).clamp(min=0))
    per_block = (keys * (query < seqlen_q)).view(nq, bq, nkv).sum(1)
    return float((table * per_block).sum((-2, -1)).double().mean() / per_block.sum())


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
        if "flex" in wanted:
            flex = _flex_forward(None, causal, seqlen, device)
            if flex is not None:
                peers["flex"] = flex
    else:
        peers["sdpa_cpu"] = lambda q, k, v: F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal).transpose(1, 2)
    return peers


def _device_and_dtype(args):
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    dtype = getattr(torch, args.dtype)
    if device == "cpu":
        print("# no CUDA GPU: timing the CPU backend " + (
            "with block masks against its dense path; FlexAttention skipped" if args.block_sparse else
            "against torch's CPU SDPA; GPU peers skipped"))
    return device, dtype


def _points(args, device, dtype):
    """(index, count, headdim, seqlen, causal, mode, batch, nheads, q, k, v) for each point of the sweep."""
    points = [(d, s, c, m) for d in args.headdims for s in args.seqlens for c in args.causal for m in args.modes]
    for idx, (headdim, seqlen, causal, mode) in enumerate(points, 1):
        batch = max(1, args.tokens // seqlen)
        nheads = max(1, args.hidden // headdim)
        gen = torch.Generator(device=device).manual_seed(idx)
        q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device=device, dtype=dtype, generator=gen)
                   for _ in range(3))
        yield idx, len(points), headdim, seqlen, causal, mode, batch, nheads, q, k, v


def _time_all(timer, impls, q, k, v, mode, where):
    """name -> median ms of each impl; one that cannot run is skipped with a message."""
    times = {}
    for name, fwd in impls.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                times[name] = timer(_make_runner(fwd, q, k, v, mode))
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this point is skipped
            print(f"# {name} skipped at {where}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}",
                  file=sys.stderr)
    return times


def _row(impl, mode, dtype, headdim, seqlen, batch, nheads, causal, ms, flops, mask_cols=None, **tail):
    """One output row: the point (and its mask's columns), the time and TFLOP/s, then `tail`."""
    return dict(impl=impl, mode=mode, dtype=str(dtype).replace("torch.", ""), headdim=headdim, seqlen=seqlen,
                batch=batch, nheads=nheads, causal=causal, **(mask_cols or {}), ms=ms, tflops=flops / ms / 1e9,
                **tail)


def run_sweep(args):
    device, dtype = _device_and_dtype(args)
    timer = _timer(device)
    rows = []
    for idx, count, headdim, seqlen, causal, mode, batch, nheads, q, k, v in _points(args, device, dtype):
        flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, mode)
        impls = {"flashcute": lambda q, k, v: flashcute.attention(q, k, v, causal=causal)}
        if not args.no_peers:
            impls.update(_peers(device, causal, seqlen, headdim, args.math_max_seqlen, args.peers))
        where = f"d={headdim} s={seqlen} causal={causal} {mode}"
        times = _time_all(timer, impls, q, k, v, mode, where)
        for name, ms in times.items():
            rows.append(_row(name, mode, dtype, headdim, seqlen, batch, nheads, causal, ms, flops,
                             peer_over_flashcute=ms / times["flashcute"] if "flashcute" in times else None))
        print(f"[{idx}/{count}] {where}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()),
              file=sys.stderr, flush=True)
    return device, rows


def _masks(args, seqlen, causal, seed, device):
    """(pattern, mask) cases of one point: dense (None), then the random and sliding masks."""
    from flashcute import masks

    cases = [("dense", None)]
    if "random" in args.patterns:
        cases += [("random", masks.random_blocks(seqlen, density=rho, seed=seed, device=device))
                  for rho in args.densities]
    if "sliding" in args.patterns and causal:
        cases.append(("sliding", masks.sliding_window(seqlen, window=args.window, device=device)))
    return cases


def run_block_sparse_sweep(args):
    device, dtype = _device_and_dtype(args)
    timer = _timer(device)
    rows = []
    for idx, count, headdim, seqlen, causal, mode, batch, nheads, q, k, v in _points(args, device, dtype):
        dense_flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, mode)
        dense_ms, log = None, []
        for pattern, mask in _masks(args, seqlen, causal, idx, device):
            impls = {"flashcute": lambda q, k, v, mask=mask: flashcute.attention(q, k, v, causal=causal,
                                                                                 block_mask=mask)}
            flex = _flex_forward(mask, causal, seqlen, device) if device == "cuda" and not args.no_peers else None
            if flex is not None:
                impls["flex"] = flex
            density = 1.0 if mask is None else mask.density(seqlen, seqlen)
            fraction = 1.0 if mask is None else flop_fraction(mask, seqlen, seqlen, causal)
            where = f"d={headdim} s={seqlen} causal={causal} {mode} {pattern} density {density:.3f}"
            times = _time_all(timer, impls, q, k, v, mode, where)
            ours = times.get("flashcute")
            if mask is None:  # the first case
                dense_ms = ours
            bound = 1.15 * fraction * dense_ms + 0.020 if dense_ms is not None else None
            for name, ms in times.items():
                rows.append(_row(name, mode, dtype, headdim, seqlen, batch, nheads, causal, ms,
                                 fraction * dense_flops,
                                 mask_cols=dict(pattern=pattern, density=density, flop_fraction=fraction),
                                 bound_ms=bound if name == "flashcute" else None,
                                 meets_bound=(ms <= bound) if name == "flashcute" and bound is not None else None,
                                 peer_over_flashcute=ms / ours if ours else None))
            log.append(f"{pattern} {density:.2f}: " + " / ".join(f"{n} {t:.3f}" for n, t in times.items()))
        print(f"[{idx}/{count}] d={headdim} s={seqlen} causal={causal} {mode} (ms): " + ", ".join(log),
              file=sys.stderr, flush=True)
    return device, rows


def _is_block_sparse(rows):
    return bool(rows) and "pattern" in rows[0]


PATTERNS = ["dense", "random", "sliding"]


def _sparse_cases(rows):
    """[(mode, headdim, causal, seqlen, pattern, density), flashcute row | None, flex row | None] in order."""
    cases = {}
    for r in rows:
        key = (r["mode"], r["headdim"], r["causal"], r["seqlen"], r["pattern"], r["density"])
        cases.setdefault(key, {})[r["impl"]] = r
    keys = sorted(cases, key=lambda key: (list(MODE_FLOP_FACTOR).index(key[0]), *key[1:4], PATTERNS.index(key[4]),
                                          key[5]))
    return [(key, cases[key].get("flashcute"), cases[key].get("flex")) for key in keys]


def _bound_summary(rows):
    ours = [r for r in rows if r["impl"] == "flashcute" and r["pattern"] != "dense" and r["bound_ms"] is not None]
    flex = [r for r in rows if r["impl"] == "flex" and r["pattern"] != "dense" and r["peer_over_flashcute"]]
    return (f"block-sparse rows within the bound: {sum(r['meets_bound'] for r in ours)}/{len(ours)}" +
            (f"; faster than FlexAttention: {sum(r['peer_over_flashcute'] > 1 for r in flex)}/{len(flex)}"
             if flex else ""))


def format_sparse_table(rows):
    """One line per point, pattern and density: flashcute's ms, TFLOP/s, bound, and flex's time over it."""
    head = (f"{'mode':7}{'d':>5}{'causal':>7}{'seqlen':>7} {'pattern':8}{'density':>8}{'ms':>9}{'TFLOP/s':>9}"
            f"{'bound':>9}{'ok':>4}{'x flex':>8}")
    lines = [head, "-" * len(head)]
    for (mode, d, c, s, pattern, density), ours, flex in _sparse_cases(rows):
        line = f"{mode:7}{d:5}{str(c):>7}{s:7} {pattern:8}{density:8.3f}"
        line += f"{ours['ms']:9.3f}{ours['tflops']:9.1f}" if ours else f"{'-':>9}{'-':>9}"
        line += (f"{ours['bound_ms']:9.3f}{'yes' if ours['meets_bound'] else 'NO':>4}"
                 if ours and ours["bound_ms"] is not None else f"{'-':>9}{'-':>4}")
        line += f"{flex['peer_over_flashcute']:8.2f}" if flex and flex["peer_over_flashcute"] else f"{'-':>8}"
        lines.append(line)
    lines += ["bound = 1.15 * flop_fraction * dense ms + 0.020 ms; x flex = flex time / flashcute time",
              _bound_summary(rows)]
    return "\n".join(lines)


def format_table(rows):
    """One line per point: flashcute's ms and TFLOP/s, and its speed over each peer's."""
    if _is_block_sparse(rows):
        return format_sparse_table(rows)
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


def _markdown_head(env, command):
    return [f"Device: {env['device']}; date: {env['date']}; torch {env['torch']}"
            f"{'; CUDA ' + env['cuda'] if env.get('cuda') else ''}.", "",
            f"Command: `{command}`", ""]


def sparse_markdown_report(env, rows, command, plot=None):
    """BENCHMARKS.md-style section for --block-sparse: one table per mode."""
    out = _markdown_head(env, command)
    cases = _sparse_cases(rows)
    for mode in sorted({r["mode"] for r in rows}, key=list(MODE_FLOP_FACTOR).index):
        out += [f"### {mode}", "",
                "| d | causal | seqlen | batch x heads | pattern | density | flashcute ms | flashcute TFLOP/s | "
                "bound ms | meets bound | flex ms | flex / flashcute |", "|" + "---|" * 12]
        for (m, d, c, s, pattern, density), ours, flex in cases:
            if m != mode or ours is None:
                continue
            bound = ours["bound_ms"] is not None
            out.append("| " + " | ".join([
                str(d), str(c), str(s), f"{ours['batch']}x{ours['nheads']}", pattern, f"{density:.3f}",
                f"{ours['ms']:.3f}", f"{ours['tflops']:.1f}", f"{ours['bound_ms']:.3f}" if bound else "-",
                ("yes" if ours["meets_bound"] else "**no**") if bound else "-",
                f"{flex['ms']:.3f}" if flex else "-", f"{flex['ms'] / ours['ms']:.2f}" if flex else "-"]) + " |")
        out.append("")
    out += [f"bound = 1.15 · flop_fraction · dense ms + 0.020 ms (issue 5); flop_fraction = the scores the mask "
            f"(and causal) keep over the dense call's; TFLOP/s count only those. {_bound_summary(rows)}.", ""]
    if plot:
        out += [f"![time vs density]({plot})", ""]
    return "\n".join(out)


def markdown_report(env, rows, command, plot=None):
    """BENCHMARKS.md-style section: environment, then one table per mode of flashcute's
    TFLOP/s and each peer's time over flashcute's (> 1: flashcute faster)."""
    if _is_block_sparse(rows):
        return sparse_markdown_report(env, rows, command, plot)
    peers = sorted({r["impl"] for r in rows} - {"flashcute"})
    out = _markdown_head(env, command)
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


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def plot_density(rows, env, path):
    """Time vs density (log axis), one panel per (mode, head dim, causal) in rows and seqlen in columns:
    lines for flashcute, its bound and flex over the random masks (density 1: dense); crosses: sliding."""
    plt = _pyplot()
    panels = sorted({(list(MODE_FLOP_FACTOR).index(r["mode"]), r["mode"], r["headdim"], r["causal"]) for r in rows})
    seqlens = sorted({r["seqlen"] for r in rows})
    if plt is None or not panels:
        return
    fig, axes = plt.subplots(len(panels), len(seqlens), figsize=(3.8 * len(seqlens), 3.0 * len(panels)),
                             squeeze=False)
    for i, (_, mode, d, c) in enumerate(panels):
        for j, s in enumerate(seqlens):
            ax = axes[i][j]
            here = [r for r in rows if (r["mode"], r["headdim"], r["causal"], r["seqlen"]) == (mode, d, c, s)]
            for impl, key, label, style in [("flashcute", "ms", "flashcute", dict(linewidth=2.5, marker="o")),
                                            ("flashcute", "bound_ms", "flashcute bound", dict(linestyle="--")),
                                            ("flex", "ms", "flex", dict(marker="o"))]:
                series = [r for r in here if r["impl"] == impl and r[key] and r["density"] > 0]
                pts = sorted((r["density"], r[key]) for r in series if r["pattern"] != "sliding")
                sliding = [(r["density"], r[key]) for r in series if r["pattern"] == "sliding"]
                if not pts:
                    continue
                line, = ax.plot(*zip(*pts), label=label, **style)
                if sliding and key == "ms":
                    ax.plot(*zip(*sliding), marker="x", markersize=9, linestyle="none", color=line.get_color(),
                            label=f"{label} sliding")
            ticks = sorted({r["density"] for r in here if r["density"] > 0 and r["pattern"] != "sliding"})
            ax.set_xscale("log")
            ax.set_xticks(ticks, [f"{t:.3g}" for t in ticks])
            ax.minorticks_off()
            ax.set_ylim(bottom=0)
            ax.set_title(f"{mode}  d={d}  causal={c}  s={s}", fontsize=9)
            ax.set_xlabel("density (blocks kept)", fontsize=8)
            ax.set_ylabel("ms", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6)
    fig.suptitle(f"{env['device']}, {env['date']}, {env.get('torch', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot(rows, env, path):
    """TFLOP/s vs seqlen, one panel per (mode, head dim, causal): modes in rows (time vs density
    for --block-sparse rows)."""
    if _is_block_sparse(rows):
        return plot_density(rows, env, path)
    plt = _pyplot()
    if plt is None:
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
    p.add_argument("--headdims", type=int, nargs="+", default=None, help="default: 64 128 (--block-sparse: 128)")
    p.add_argument("--seqlens", type=int, nargs="+", default=None,
                   help="default: 512..16384 on CUDA, 128 256 512 on CPU (--block-sparse: 8192 16384 on CUDA, "
                        "512 1024 on CPU)")
    p.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+",
                   default=[False, True])
    p.add_argument("--modes", nargs="+", choices=list(MODE_FLOP_FACTOR), default=None,
                   help="default: fwd (--block-sparse: fwd fwdbwd)")
    p.add_argument("--block-sparse", action="store_true",
                   help="time block masks against dense flashcute and FlexAttention instead of the peers")
    p.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5],
                   help="--block-sparse: densities of the random masks")
    p.add_argument("--patterns", nargs="+", choices=["random", "sliding"], default=["random", "sliding"],
                   help="--block-sparse: random masks, and a causal sliding window on the causal points")
    p.add_argument("--window", type=int, default=1024, help="--block-sparse: the sliding window, in tokens")
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
        args.seqlens = (([8192, 16384] if on_gpu else [512, 1024]) if args.block_sparse else
                        [512, 1024, 2048, 4096, 8192, 16384] if on_gpu else [128, 256, 512])
    args.headdims = args.headdims or ([128] if args.block_sparse else [64, 128])
    args.modes = args.modes or (["fwd", "fwdbwd"] if args.block_sparse else ["fwd"])
    if not on_gpu and args.tokens == 16384:
        args.tokens, args.hidden = 1024, 256
    device, rows = (run_block_sparse_sweep if args.block_sparse else run_sweep)(args)
    env = environment()
    table = format_table(rows)
    write_outputs(args.out, env, rows, table)
    print("\n".join(f"{k}: {v}" for k, v in env.items()))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
