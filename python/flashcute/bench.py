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

Issue 14's sweeps (each excludes the others and --block-sparse; defaults: its figures):

``--window [W ...]`` (default 1024 4096; d=128, seqlen 8192 16384, causal, fwd and fwdbwd)
times flashcute with a W-token sliding window against dense flashcute (same causal, no
window) and FlexAttention with the equivalent BlockMask (``create_block_mask`` of the
mask_mod, 128 x 128 blocks). Causal points use ``window_size=(W - 1, 0)``, the W most recent
keys including the query's own (HF/Mistral), Flex's ``q_idx >= kv_idx and q_idx - kv_idx < W``;
non-causal points (``--causal false``) a symmetric ``(W // 2, W // 2)``. FLOPs count only the
kept scores: ``kept_fraction`` (counted per query row) x the dense call's; the bound is
``1.15 * kept_fraction * dense_ms + 0.020`` ms, and flex rows must be >= 1.3x flashcute's
time. (With --block-sparse, ``--window W`` keeps its old meaning: the sliding mask's width.)

``--varlen`` times flashcute.attention_varlen on one packed batch of --num-seqs sequences
(default 64) with lengths drawn uniformly from --lengths (64 4096), scaled to --tokens in all
(131072), seeded, against ``torch.nn.attention.varlen.varlen_attn`` on the same batch and SDPA's
cuDNN backend on the batch padded to the longest sequence, d=64 (32 heads) and d=128 (16
heads), causal and not, fwd and fwdbwd. The padded run is exact for causal points (right
padding: a real query never sees a padded key); otherwise it takes a key-padding attn_mask,
and when cuDNN refuses one it runs unmasked (the padding waste users pay): the ``padding``
column says which. FLOPs (for every impl) count only the real pairs of each sequence.

``--score-mods`` times flashcute with ``softcap=--softcap`` (30) and with ALiBi (float32
slopes ``2^(-8 (h + 1) / H)``) against plain flashcute, d=64 and 128, seqlen 2048..16384 at
16k tokens, causal and not, fwd and fwdbwd; rows give the overhead % (bar: 10 %).

Without a GPU these run the CPU backend at small sizes (varlen: against torch's CPU SDPA on
the padded batch; no FlexAttention, varlen_attn or cuDNN).

``--decode`` (``--decode-quick``: a reduced grid for smoke tests) times
``flashcute.attention_with_kvcache`` decoding: one query per sequence (bf16, h=32, d=128) against
a full cache of --caches keys (8k 32k 128k) for --batches (1 8 32) and --kv-heads (32 8 1), no
append in the timed call (k = v = None), on a contiguous cache and on paged ones (--layouts
contig paged16 paged128; the block table a random permutation of the pages), against
SDPA-flash and SDPA-cuDNN (``sdpa_kernel``; ``enable_gqa`` when h_k < h) on (b, h, 1, d) queries
and contiguous (b, h_k, sk, d) caches; peers have no paged API. It reports GB/s of the unique
K/V bytes (2 * b * sk * h_k * d * sizeof(dtype)), each peer's time over flashcute's (n/a where the
peer refuses the point) and, for paged layouts, flashcute contig's time over the paged one. Also
rows with one appended token (b=1, --append-cache 32k; peers pay the copy into their cache) and a
chunked-prefill point (--chunk 512 queries against --chunk-cache 32k keys, causal bottom-right,
h_k 32 and 8) in TFLOP/s, against SDPA-flash through ``causal_lower_right`` and SDPA-cuDNN with
that mask materialised. Timing: CUDA-graph replays (--decode-timing eager: eager calls), rotating
through enough K/V copies that max(4 x L2, 200 MB) is touched per cycle; points whose K/V exceed
--mem-fraction (0.6) of the GPU's memory are skipped with a note. Where memory allows, every
layout and peer holds the same K/V values and their outputs are checked against flashcute's
contiguous one (rel_err; a MISMATCH note over 2e-2). On the CPU: small sizes against torch's CPU
SDPA.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import functools
import itertools
import json
import math
import platform
import statistics
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


def event_ms(fn):
    """Milliseconds of one fn() between CUDA events, synchronised after."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _cuda_event_timer(fn, reps=50):
    for _ in range(5):
        fn()
    times = [event_ms(fn) for _ in range(reps)]
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
    # The bwd timing replays one backward (retain_graph=True), which a compiled backward with
    # donated buffers refuses (seen on the H100, 2026-11-23).
    torch._functorch.config.donated_buffer = False
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


def sdpa_forward(backend_name, causal, dropout_p=0.0):
    """forward(q, k, v) -> out through F.scaled_dot_product_attention on one SDPBackend (by name),
    in flashcute's (b, s, h, d) layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def fwd(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=causal, dropout_p=dropout_p).transpose(1, 2)
    return fwd


def _peers(device, causal, seqlen, headdim, math_max_seqlen, wanted):
    """name -> forward(q, k, v) in flashcute's (b, s, h, d) layout, for the wanted peers that apply."""
    peers = {}
    if device == "cuda":
        for name, backend in SDPA_BACKENDS.items():
            if name not in wanted or (name == "sdpa_math" and seqlen > math_max_seqlen):
                continue
            peers[name] = sdpa_forward(backend, causal)
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
        print("# no CUDA GPU: timing the CPU backend " + dict(
            block_sparse="with block masks against its dense path; FlexAttention skipped",
            window="with sliding windows against its dense path; FlexAttention skipped",
            varlen="on a packed batch against torch's CPU SDPA on the padded batch; varlen_attn and cuDNN skipped",
            score_mods="with softcap and ALiBi against its plain path",
            decode="on KV-cache decoding at small sizes against torch's CPU SDPA; SDPA-flash and SDPA-cuDNN skipped",
        ).get(getattr(args, "sweep", "block_sparse" if args.block_sparse else "dense"),
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


def _family_of(name):
    """The kernel family an impl name forces ("flashcute[sm80]", "dense[sm80]" -> "sm80"), or None."""
    return name[name.index("[") + 1:-1] if name.endswith("]") and "[" in name else None


def _base_impl(name):
    """An impl name without its forced family ("softcap[sm80]" -> "softcap")."""
    return name.split("[")[0]


def _family_impls(args, device, forward, name="flashcute"):
    """`name` under each forced kernel family of --families (besides `name` itself, the default
    choice), when this build and GPU have more than one."""
    if device != "cuda" or args.families == ["none"]:
        return {}
    runnable = flashcute.kernels.runnable()
    families = [f for f in (args.families or runnable) if f in runnable]
    return {f"{name}[{f}]": forward for f in families} if len(families) > 1 or args.families else {}


# Rounds of _time_all (--rounds): each impl is timed once per round, in an order rotated by one
# every round, and reports the median over the rounds, so drifts of the GPU's clocks over a point
# (power, temperature) fall on every impl alike instead of on whichever ran last.
_ROUNDS = 1


def _time_all(timer, impls, q, k, v, mode, where, inputs=None):
    """name -> median ms of each impl; one that cannot run is skipped with a message. An impl
    named "flashcute[family]" runs with that kernel family forced; one in `inputs` (name ->
    (q, k, v)) runs on those tensors instead of q, k, v."""
    samples = {name: [] for name in impls}
    names = list(impls)
    for r in range(_ROUNDS):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if samples[name] is None:
                continue
            try:
                with warnings.catch_warnings(), flashcute.kernels(_family_of(name) or flashcute.kernels.current()):
                    warnings.simplefilter("ignore")
                    samples[name].append(timer(_make_runner(impls[name], *(inputs or {}).get(name, (q, k, v)), mode)))
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run this point is skipped
                print(f"# {name} skipped at {where}: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}",
                      file=sys.stderr)
                samples[name] = None
    return {name: statistics.median(t) for name, t in samples.items() if t}


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
        ours = lambda q, k, v: flashcute.attention(q, k, v, causal=causal)  # noqa: E731
        impls = {"flashcute": ours, **_family_impls(args, device, ours)}
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
            if args.families:  # the forced families' rows go to the CSV (the table shows the default's)
                impls.update(_family_impls(args, device, impls["flashcute"]))
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


def window_size_of(window, causal):
    """flashcute's window_size for a `window`-token window: causal, (W - 1, 0), the W most recent
    keys including the query's own (HF/Mistral); otherwise symmetric, (W // 2, W // 2)."""
    return (window - 1, 0) if causal else (window // 2, window // 2)


def window_fraction(seqlen_q, seqlen_k, window_size, causal):
    """The scores a window (with `causal`) keeps over those the dense call with the same `causal`
    computes, counted per query row (bottom-right aligned, -1: unbounded on that side)."""
    left, right = window_size
    right = 0 if causal else right
    pos = torch.arange(seqlen_q, dtype=torch.int64) + seqlen_k - seqlen_q  # query i's key position
    first = (pos - left).clamp(min=0) if left >= 0 else torch.zeros_like(pos)
    last = (pos + right).clamp(max=seqlen_k - 1) if right >= 0 else torch.full_like(pos, seqlen_k - 1)
    kept = (last - first + 1).clamp(min=0).sum()
    dense = (pos + 1).clamp(0, seqlen_k).sum() if causal else torch.tensor(seqlen_q * seqlen_k)
    return float(kept.double() / dense.double())


def window_mask_mod(window_size, causal):
    """FlexAttention's mask_mod of flashcute's `window_size` and `causal` for seqlen_q == seqlen_k:
    for a causal W-token window (W - 1, 0), q_idx >= kv_idx and q_idx - kv_idx < W."""
    left, right = window_size
    right = 0 if causal else right

    def mask_mod(b, h, q_idx, kv_idx):
        kept = q_idx - kv_idx <= left if left >= 0 else q_idx >= 0
        return kept & (kv_idx - q_idx <= right) if right >= 0 else kept
    return mask_mod


def _flex_window_forward(window_size, causal, seqlen, device):
    """FlexAttention's forward(q, k, v) with the BlockMask (128 x 128 blocks) of flashcute's
    `window_size` and `causal`, built by create_block_mask from window_mask_mod, or None."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask

        flex = _compiled_flex()
        block_mask = create_block_mask(window_mask_mod(window_size, causal), None, None, seqlen, seqlen,
                                       device=device)
    except Exception as exc:  # noqa: BLE001 - FlexAttention is optional
        print(f"# FlexAttention skipped: {exc}", file=sys.stderr)
        return None
    return lambda q, k, v: flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                block_mask=block_mask).transpose(1, 2)


def _window_row(name, point, ms, flops, window, window_size, fraction, dense_ms=None, flex_ms=None):
    """A --window row: the point, the window's columns, the time, and for flashcute rows the
    dense time, the bound and flex's time over this one."""
    bound = 1.15 * fraction * dense_ms + 0.020 if dense_ms is not None and window is not None else None
    return _row(name, *point, ms, flops, mask_cols=dict(window=window, window_size=str(window_size),
                                                        kept_fraction=fraction),
                dense_ms=dense_ms, bound_ms=bound, meets_bound=None if bound is None else ms <= bound,
                flex_ms=flex_ms, flex_over_flashcute=flex_ms / ms if flex_ms else None)


def run_window_sweep(args):
    """Per point: dense flashcute (impl "dense", window None), then per --window W flashcute with
    the window and FlexAttention with the same mask ("flex"); each family of --families too."""
    device, dtype = _device_and_dtype(args)
    timer = _timer(device)
    rows = []
    for idx, count, headdim, seqlen, causal, mode, batch, nheads, q, k, v in _points(args, device, dtype):
        dense_flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, mode)
        point = (mode, dtype, headdim, seqlen, batch, nheads, causal)

        def ours(window_size):
            return lambda q, k, v: flashcute.attention(q, k, v, causal=causal, window_size=window_size)
        where = f"d={headdim} s={seqlen} causal={causal} {mode}"
        dense = _time_all(timer, {"dense": ours((-1, -1)), **_family_impls(args, device, ours((-1, -1)), "dense")},
                          q, k, v, mode, where + " dense")
        rows += [_window_row(name, point, ms, dense_flops, None, (-1, -1), 1.0, dense_ms=ms)
                 for name, ms in dense.items()]
        log = ["dense: " + " / ".join(f"{n} {t:.3f}" for n, t in dense.items())]
        for window in args.windows:
            window_size = window_size_of(window, causal)
            fraction = window_fraction(seqlen, seqlen, window_size, causal)
            impls = {"flashcute": ours(window_size), **_family_impls(args, device, ours(window_size))}
            if device == "cuda" and not args.no_peers and "flex" in args.peers:
                flex = _flex_window_forward(window_size, causal, seqlen, device)
                if flex is not None:
                    impls["flex"] = flex
            times = _time_all(timer, impls, q, k, v, mode, f"{where} window {window_size}")
            for name, ms in times.items():
                dense_ms = dense.get(name.replace("flashcute", "dense")) if name != "flex" else None
                rows.append(_window_row(name, point, ms, fraction * dense_flops, window, window_size, fraction,
                                        dense_ms=dense_ms, flex_ms=times.get("flex") if name != "flex" else None))
            log.append(f"W={window} kept {fraction:.3f}: " + " / ".join(f"{n} {t:.3f}" for n, t in times.items()))
        print(f"[{idx}/{count}] {where} (ms): " + ", ".join(log), file=sys.stderr, flush=True)
    return device, rows


def varlen_lengths(num_seqs, low, high, total, seed=0):
    """`num_seqs` lengths drawn uniformly from [low, high] (seeded), scaled to sum to `total`
    and kept within [low, high]."""
    if not num_seqs * low <= total <= num_seqs * high:
        raise ValueError(f"{total} tokens do not fit {num_seqs} sequences of {low}..{high}")
    gen = torch.Generator().manual_seed(seed)
    drawn = torch.randint(low, high + 1, (num_seqs,), generator=gen, dtype=torch.int64).double()
    lengths = (drawn * total / drawn.sum()).round().long().clamp(low, high)
    step = 0
    while (excess := int(lengths.sum()) - total) != 0:  # one token at a time, round robin
        i, step = step % num_seqs, step + 1
        if low <= lengths[i] - (1 if excess > 0 else -1) <= high:
            lengths[i] -= 1 if excess > 0 else -1
    return lengths.tolist()


def varlen_flops(lengths, nheads, headdim, causal, mode):
    """attention_flops summed over the sequences: the real (unpadded) pairs only."""
    return sum(attention_flops(1, nheads, n, n, headdim, causal, mode) for n in lengths)


def _varlen_points(args, device, dtype):
    """(index, count, headdim, causal, mode, nheads, q, k, v, cu_seqlens) for each point of --varlen:
    one packed batch of the same lengths for every point, q, k, v (total, nheads, headdim)."""
    points = [(d, c, m) for d in args.headdims for c in args.causal for m in args.modes]
    cu = torch.tensor([0, *args.lengths_drawn], dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    for idx, (headdim, causal, mode) in enumerate(points, 1):
        nheads = max(1, args.hidden // headdim)
        gen = torch.Generator(device=device).manual_seed(idx)
        q, k, v = (torch.randn(int(cu[-1]), nheads, headdim, device=device, dtype=dtype, generator=gen)
                   for _ in range(3))
        yield idx, len(points), headdim, causal, mode, nheads, q, k, v, cu


def _pad(x, lengths, max_len):
    """A packed (total, h, d) tensor as (n, max_len, h, d), zeros after each sequence's end."""
    keep = torch.arange(max_len, device=x.device) < torch.tensor(lengths, device=x.device)[:, None]
    padded = x.new_zeros(len(lengths), max_len, *x.shape[1:])
    padded[keep] = x
    return padded


def _padded_sdpa_variants(device, lengths, max_len, causal):
    """[(padding, forward(q, k, v))] to try in order on the padded batch: SDPA with the cuDNN
    backend (CPU: torch's CPU SDPA). Causal needs no mask (right padding: a real query sees no
    padded key); otherwise a key-padding attn_mask, then, if refused, none (padding waste)."""
    def sdpa(**kw):
        def fwd(q, k, v):
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION) if device == "cuda" else contextlib.nullcontext():
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                      **kw).transpose(1, 2)
        return fwd

    if causal:
        return [("causal, no mask needed", sdpa(is_causal=True))]
    keys = torch.arange(max_len, device=device) < torch.tensor(lengths, device=device)[:, None]
    return [("key-padding mask", sdpa(attn_mask=keys[:, None, None, :])), ("none (unmasked: padding waste)", sdpa())]


def _varlen_attn_forward(cu, max_len, causal):
    """torch.nn.attention.varlen.varlen_attn(q, k, v) on the packed batch, or None without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as exc:
        print(f"# varlen_attn skipped: {exc}", file=sys.stderr)
        return None
    window_size = (-1, 0) if causal else (-1, -1)
    return lambda q, k, v: varlen_attn(q, k, v, cu, cu, max_len, max_len, window_size=window_size)


def run_varlen_sweep(args):
    """Per point: flashcute.attention_varlen ("flashcute", each family of --families too),
    varlen_attn and padded SDPA (cuDNN on CUDA, CPU SDPA otherwise) on the same packed batch."""
    device, dtype = _device_and_dtype(args)
    timer = _timer(device)
    lengths = args.lengths_drawn
    max_len, total = max(lengths), sum(lengths)
    padded_name = "sdpa_cudnn_padded" if device == "cuda" else "sdpa_cpu_padded"
    print(f"# varlen batch: {len(lengths)} sequences, {total} tokens, lengths {min(lengths)}..{max_len} "
          f"(padded: {len(lengths) * max_len} tokens)", file=sys.stderr)
    rows = []
    for idx, count, headdim, causal, mode, nheads, q, k, v, cu in _varlen_points(args, device, dtype):
        flops = varlen_flops(lengths, nheads, headdim, causal, mode)
        ours = functools.partial(flashcute.attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len,
                                 max_seqlen_k=max_len, causal=causal)
        impls = {"flashcute": ours, **_family_impls(args, device, ours)}
        if device == "cuda" and not args.no_peers and "varlen_attn" in args.peers:
            peer = _varlen_attn_forward(cu, max_len, causal)
            if peer is not None:
                impls["varlen_attn"] = peer
        where = f"d={headdim} causal={causal} {mode} varlen"
        times = _time_all(timer, impls, q, k, v, mode, where)
        padding = None
        if not args.no_peers and (device != "cuda" or "sdpa_cudnn" in args.peers):
            padded = tuple(_pad(t, lengths, max_len) for t in (q, k, v))
            for padding, fwd in _padded_sdpa_variants(device, lengths, max_len, causal):
                got = _time_all(timer, {padded_name: fwd}, q, k, v, mode, f"{where} padding: {padding}",
                                inputs={padded_name: padded})
                if got:
                    times.update(got)
                    break
            del padded
        ref = times.get("flashcute")
        for name, ms in times.items():
            rows.append(_row(name, mode, dtype, headdim, max_len, len(lengths), nheads, causal, ms, flops,
                             mask_cols=dict(num_seqs=len(lengths), total_tokens=total, min_len=min(lengths),
                                            padding=padding if name == padded_name else None),
                             peer_over_flashcute=ms / ref if ref else None))
        print(f"[{idx}/{count}] {where}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()),
              file=sys.stderr, flush=True)
    return device, rows


SCORE_MODS = ["none", "softcap", "alibi", "dropout"]
SCORE_MOD_BAR = 10.0  # percent over plain flashcute (issues 14 and 15)


def alibi_slopes(nheads, device):
    """The standard ALiBi slopes 2^(-8 (h + 1) / H), float32 (nheads,)."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / nheads) for h in range(nheads)], dtype=torch.float32,
                        device=device)


def run_score_mods_sweep(args):
    """Per point: plain flashcute ("flashcute") and with each of --mods: softcap ("softcap"), ALiBi
    ("alibi"), dropout ("dropout", p = --dropout-p), each under every family of --families too;
    overhead against the plain call of the same family. With dropout on CUDA, SDPA's flash backend
    with the same dropout too (vs_sdpa_flash = its time / flashcute's, auto family)."""
    device, dtype = _device_and_dtype(args)
    timer = _timer(device)
    rows = []
    for idx, count, headdim, seqlen, causal, mode, batch, nheads, q, k, v in _points(args, device, dtype):
        flops = attention_flops(batch, nheads, seqlen, seqlen, headdim, causal, mode)
        slopes = alibi_slopes(nheads, device)
        all_mods = {"flashcute": {}, "softcap": dict(softcap=args.softcap), "alibi": dict(alibi_slopes=slopes),
                    "dropout": dict(dropout_p=args.dropout_p)}
        mods = {name: kw for name, kw in all_mods.items() if name == "flashcute" or name in args.mods}
        impls = {}
        for name, kw in mods.items():
            fwd = functools.partial(flashcute.attention, causal=causal, **kw)
            impls.update({name: fwd, **_family_impls(args, device, fwd, name)})
        impls = dict(sorted(impls.items(), key=lambda item: (_family_of(item[0]) or "", list(mods).index(
            _base_impl(item[0])))))  # plain first within each family
        if "dropout" in mods and device == "cuda":
            impls["sdpa_flash+dropout"] = sdpa_forward("FLASH_ATTENTION", causal, args.dropout_p)
        where = f"d={headdim} s={seqlen} causal={causal} {mode}"
        times = _time_all(timer, impls, q, k, v, mode, where)
        peer = times.pop("sdpa_flash+dropout", None)
        for name, ms in times.items():
            base, family = _base_impl(name), _family_of(name)
            plain = times.get("flashcute" if family is None else f"flashcute[{family}]")
            overhead = 100.0 * (ms / plain - 1) if plain else None
            mine = base == "dropout" and family is None and peer is not None
            versus = dict(sdpa_flash_ms=peer if mine else None, vs_sdpa_flash=peer / ms if mine else None)
            rows.append(_row(name, mode, dtype, headdim, seqlen, batch, nheads, causal, ms, flops,
                             mask_cols=dict(score_mod=SCORE_MODS[list(all_mods).index(base)],
                                            softcap=args.softcap if base == "softcap" else 0.0,
                                            dropout_p=args.dropout_p if base == "dropout" else 0.0),
                             plain_ms=plain, overhead_pct=overhead,
                             within_bar=None if base == "flashcute" or overhead is None else overhead <= SCORE_MOD_BAR,
                             **versus))
        if peer is not None:
            times["sdpa_flash+dropout"] = peer
        print(f"[{idx}/{count}] {where}: " + ", ".join(f"{n} {t:.3f} ms" for n, t in times.items()),
              file=sys.stderr, flush=True)
    return device, rows


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


def _sweep_of(rows):
    """Which sweep made `rows`: "dense", "block_sparse", "window", "varlen", "score_mods" or "decode"."""
    first = rows[0] if rows else {}
    for key, sweep in [("kv_bytes", "decode"), ("pattern", "block_sparse"), ("window_size", "window"),
                       ("total_tokens", "varlen"), ("score_mod", "score_mods")]:
        if key in first:
            return sweep
    return "dense"


def _mode_order(mode):
    return list(MODE_FLOP_FACTOR).index(mode)


def _ours_impls(rows, base="flashcute"):
    """`base` then its forced-family variants, as they appear in rows."""
    return [base] + sorted({r["impl"] for r in rows if r["impl"].startswith(base + "[")})


def _window_cases(rows):
    """[((mode, headdim, causal, seqlen, window), flashcute-like row)] in order: every windowed
    row of flashcute and its forced families (dense and flex times are columns of those)."""
    impls = _ours_impls(rows)
    cases = [((r["mode"], r["headdim"], r["causal"], r["seqlen"], r["window"]), r) for r in rows
             if r["window"] is not None and r["impl"] in impls]
    return sorted(cases, key=lambda c: (_mode_order(c[0][0]), *c[0][1:], impls.index(c[1]["impl"])))


def _window_summary(rows):
    parts = []
    for impl in _ours_impls(rows):
        ours = [r for _, r in _window_cases(rows) if r["impl"] == impl and r["bound_ms"] is not None]
        vs_flex = [r for r in ours if r["flex_over_flashcute"]]
        label = "window rows" if impl == "flashcute" else impl
        parts.append(f"{label} within the bound: {sum(r['meets_bound'] for r in ours)}/{len(ours)}" +
                     (f"; >= 1.3x flex: {sum(r['flex_over_flashcute'] >= 1.3 for r in vs_flex)}/{len(vs_flex)}"
                      if vs_flex else ""))
    return "; ".join(parts)


def format_window_table(rows):
    """One line per point, window and flashcute impl: kept fraction, ms, TFLOP/s, dense ms, the
    bound, and flex's time and its ratio to this one."""
    head = (f"{'mode':7}{'d':>5}{'causal':>7}{'seqlen':>7}{'window':>8}{'kept':>7}  {'impl':16}{'ms':>9}"
            f"{'TFLOP/s':>9}{'dense':>9}{'bound':>9}{'ok':>4}{'flex':>9}{'x flex':>8}")
    lines = [head, "-" * len(head)]
    for (mode, d, c, s, w), r in _window_cases(rows):
        line = f"{mode:7}{d:5}{str(c):>7}{s:7}{w:8}{r['kept_fraction']:7.3f}  {r['impl']:16}{r['ms']:9.3f}"
        line += f"{r['tflops']:9.1f}" + (f"{r['dense_ms']:9.3f}" if r["dense_ms"] is not None else f"{'-':>9}")
        line += (f"{r['bound_ms']:9.3f}{'yes' if r['meets_bound'] else 'NO':>4}" if r["bound_ms"] is not None
                 else f"{'-':>9}{'-':>4}")
        line += (f"{r['flex_ms']:9.3f}{r['flex_over_flashcute']:8.2f}" if r["flex_ms"] else f"{'-':>9}{'-':>8}")
        lines.append(line)
    lines += ["bound = 1.15 * kept fraction * dense ms + 0.020 ms; x flex = flex time / flashcute time (bar: 1.3)",
              _window_summary(rows)]
    return "\n".join(lines)


def window_markdown_report(env, rows, command, plot=None):
    """BENCHMARKS.md-style section for --window: one table per mode."""
    out = _markdown_head(env, command)
    cases = _window_cases(rows)
    for mode in sorted({r["mode"] for r in rows}, key=_mode_order):
        out += [f"### {mode}", "",
                "| d | causal | seqlen | batch x heads | window | window_size | kept fraction | impl | ms | TFLOP/s | "
                "dense ms | bound ms | meets bound | flex ms | flex / flashcute |", "|" + "---|" * 15]
        for (m, d, c, s, w), r in cases:
            if m != mode:
                continue
            bound = r["bound_ms"] is not None
            out.append("| " + " | ".join([
                str(d), str(c), str(s), f"{r['batch']}x{r['nheads']}", str(w), f"`{r['window_size']}`",
                f"{r['kept_fraction']:.4f}", r["impl"], f"{r['ms']:.3f}", f"{r['tflops']:.1f}",
                f"{r['dense_ms']:.3f}" if r["dense_ms"] is not None else "-",
                f"{r['bound_ms']:.3f}" if bound else "-", ("yes" if r["meets_bound"] else "**no**") if bound else "-",
                f"{r['flex_ms']:.3f}" if r["flex_ms"] else "-",
                f"{r['flex_over_flashcute']:.2f}" if r["flex_ms"] else "-"]) + " |")
        out.append("")
    out += ["window_size: causal (W − 1, 0), the W most recent keys including the query's own; non-causal "
            "(W // 2, W // 2). dense = flashcute with the same causal and no window. kept fraction = the scores "
            "the window keeps over the dense call's, counted per query row; TFLOP/s count only those. "
            "bound = 1.15 · kept fraction · dense ms + 0.020 ms (issue 14); flex = FlexAttention with the "
            f"BlockMask of the same mask (bar: flex / flashcute ≥ 1.3). {_window_summary(rows)}.", ""]
    if plot:
        out += [f"![time vs window]({plot})", ""]
    return "\n".join(out)


def _varlen_points_of(rows):
    """{(mode, headdim, causal): {impl: row}} in order."""
    points = {}
    for r in sorted(rows, key=lambda r: (_mode_order(r["mode"]), r["headdim"], r["causal"])):
        points.setdefault((r["mode"], r["headdim"], r["causal"]), {})[r["impl"]] = r
    return points


def _varlen_peers(rows):
    return sorted({r["impl"] for r in rows} - {"flashcute"},
                  key=lambda p: (p.startswith("flashcute"), "padded" in p, p))


def _varlen_paddings(rows):
    """"non-causal: key-padding mask; causal: ..." for the padded peer's rows."""
    seen = {}
    for r in rows:
        if r["padding"]:
            seen.setdefault("causal" if r["causal"] else "non-causal", set()).add(r["padding"])
    return "; ".join(f"{c}: {' / '.join(sorted(p))}" for c, p in sorted(seen.items(), reverse=True))


def _varlen_summary(rows):
    parts = []
    for peer in _varlen_peers(rows):
        ratios = sorted(r["peer_over_flashcute"] for r in rows if r["impl"] == peer and r["peer_over_flashcute"])
        if ratios and not peer.startswith("flashcute"):
            parts.append(f"faster than {peer}: {sum(x > 1 for x in ratios)}/{len(ratios)} "
                         f"(median {peer} / flashcute {ratios[len(ratios) // 2]:.2f})")
    return "varlen rows " + ("; ".join(parts) if parts else f"timed: {sum(r['impl'] == 'flashcute' for r in rows)}")


def format_varlen_table(rows):
    """One line per point: flashcute's ms and TFLOP/s (real pairs), and each peer's time over it."""
    peers = _varlen_peers(rows)
    head = f"{'mode':7}{'d':>5}{'heads':>6}{'causal':>7}{'ms':>9}{'TFLOP/s':>9}" + "".join(
        f"{'x ' + p:>20}" for p in peers)
    lines = [head, "-" * len(head)]
    for (mode, d, c), impls in _varlen_points_of(rows).items():
        ours = impls.get("flashcute")
        any_row = next(iter(impls.values()))
        line = f"{mode:7}{d:5}{any_row['nheads']:6}{str(c):>7}"
        line += f"{ours['ms']:9.3f}{ours['tflops']:9.1f}" if ours else f"{'-':>9}{'-':>9}"
        for p in peers:
            r = impls.get(p)
            line += f"{r['ms'] / ours['ms']:20.2f}" if (r and ours) else f"{'-':>20}"
        lines.append(line)
    r = rows[0] if rows else None
    if r:
        lines.append(f"packed batch: {r['num_seqs']} sequences, {r['total_tokens']} tokens, lengths "
                     f"{r['min_len']}..{r['seqlen']}; TFLOP/s over the real pairs")
    lines.append("x peer = peer time / flashcute time (> 1: flashcute faster)" +
                 (f"; padded SDPA's key padding: {_varlen_paddings(rows)}" if _varlen_paddings(rows) else ""))
    lines.append(_varlen_summary(rows))
    return "\n".join(lines)


def varlen_markdown_report(env, rows, command, plot=None):
    """BENCHMARKS.md-style section for --varlen: one table per mode."""
    out = _markdown_head(env, command)
    peers = _varlen_peers(rows)
    if rows:
        r = rows[0]
        out += [f"Packed batch: {r['num_seqs']} sequences, {r['total_tokens']} tokens, lengths "
                f"{r['min_len']}..{r['seqlen']} (padded: {r['num_seqs'] * r['seqlen']} tokens); TFLOP/s count "
                "only the real pairs of each sequence, for every impl.", ""]
    for mode in sorted({r["mode"] for r in rows}, key=_mode_order):
        out += [f"### {mode}", "",
                "| d | causal | heads | flashcute ms | flashcute TFLOP/s | " +
                " | ".join(f"{p} TFLOP/s | {p} / flashcute" for p in peers) + " | padded SDPA's key padding |",
                "|" + "---|" * (5 + 2 * len(peers) + 1)]
        for (m, d, c), impls in _varlen_points_of(rows).items():
            ours = impls.get("flashcute")
            if m != mode or ours is None:
                continue
            cells = [str(d), str(c), str(ours["nheads"]), f"{ours['ms']:.3f}", f"{ours['tflops']:.1f}"]
            for p in peers:
                r = impls.get(p)
                cells += [f"{r['tflops']:.1f}", f"{r['ms'] / ours['ms']:.2f}"] if r else ["-", "-"]
            cells.append(next((r["padding"] for r in impls.values() if r["padding"]), "-"))
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    notes = {"varlen_attn": "varlen_attn: `torch.nn.attention.varlen.varlen_attn` on the same packed batch "
                            "(causal: `window_size=(-1, 0)`).",
             "sdpa_cudnn_padded": "sdpa_cudnn_padded: SDPA's cuDNN backend on the batch padded to the longest "
                                  "sequence; causal needs no mask (right padding), non-causal takes a key-padding "
                                  "mask, or runs unmasked where cuDNN refuses one (the padding waste users pay).",
             "sdpa_cpu_padded": "sdpa_cpu_padded: torch's CPU SDPA on the batch padded to the longest sequence."}
    out += [" ".join(notes[p] for p in peers if p in notes) +
            f" peer / flashcute > 1: flashcute faster. {_varlen_summary(rows)}.", ""]
    if plot:
        out += [f"![TFLOP/s per impl]({plot})", ""]
    return "\n".join(out)


def _score_mod_cases(rows):
    """[((mode, headdim, causal, seqlen), family, {score_mod: row})] in order; family None: auto."""
    cases = {}
    for r in rows:
        key = ((r["mode"], r["headdim"], r["causal"], r["seqlen"]), _family_of(r["impl"]))
        cases.setdefault(key, {})[r["score_mod"]] = r
    return [(key, family, mods) for (key, family), mods in
            sorted(cases.items(), key=lambda c: (_mode_order(c[0][0][0]), *c[0][0][1:], c[0][1] or ""))]


def _score_mods_summary(rows):
    parts = []
    for family in [None, *sorted({_family_of(r["impl"]) for r in rows} - {None})]:
        counts = []
        for mod in SCORE_MODS[1:]:
            got = [r for r in rows if r["score_mod"] == mod and _family_of(r["impl"]) == family
                   and r["within_bar"] is not None]
            if got:
                counts.append(f"{mod} {sum(r['within_bar'] for r in got)}/{len(got)}")
        if counts:
            parts.append(("score-mod rows within 10% of plain flashcute: " if family is None else f"[{family}]: ")
                         + ", ".join(counts))
    return "; ".join(parts)


def format_score_mods_table(rows):
    """One line per point and family: plain flashcute's ms and TFLOP/s, and each mod's ms and overhead %."""
    head = (f"{'mode':7}{'d':>5}{'causal':>7}{'seqlen':>7} {'family':7}{'plain ms':>9}{'TFLOP/s':>9}"
            + "".join(f"{m + ' ms':>12}{'+%':>7}" for m in SCORE_MODS[1:]))
    lines = [head, "-" * len(head)]
    for (mode, d, c, s), family, mods in _score_mod_cases(rows):
        plain = mods.get("none")
        line = f"{mode:7}{d:5}{str(c):>7}{s:7} {family or 'auto':7}"
        line += f"{plain['ms']:9.3f}{plain['tflops']:9.1f}" if plain else f"{'-':>9}{'-':>9}"
        for m in SCORE_MODS[1:]:
            r = mods.get(m)
            line += f"{r['ms']:12.3f}" if r else f"{'-':>12}"
            line += f"{r['overhead_pct']:+7.1f}" if r and r["overhead_pct"] is not None else f"{'-':>7}"
        lines.append(line)
    lines += [f"+% = mod time / plain time - 1 (bar: {SCORE_MOD_BAR:.0f}%); softcap = {_softcap_of(rows)}, "
              f"alibi = slopes 2^(-8(h+1)/H), dropout_p = {_dropout_p_of(rows)}", _score_mods_summary(rows)]
    versus = [r for r in rows if r.get("vs_sdpa_flash") is not None]
    if versus:
        lines += ["dropout vs SDPA-flash with the same dropout (its time / ours): " + ", ".join(
            f"{r['mode']} d{r['headdim']} {'causal' if r['causal'] else 'full'} {r['seqlen']}: "
            f"{r['vs_sdpa_flash']:.2f}x" for r in versus)]
    return "\n".join(lines)


def _softcap_of(rows):
    return next((r["softcap"] for r in rows if r["score_mod"] == "softcap"), "-")


def _dropout_p_of(rows):
    return next((r["dropout_p"] for r in rows if r["score_mod"] == "dropout"), "-")


def score_mods_markdown_report(env, rows, command, plot=None):
    """BENCHMARKS.md-style section for --score-mods: one table per mode."""
    out = _markdown_head(env, command)
    for mode in sorted({r["mode"] for r in rows}, key=_mode_order):
        out += [f"### {mode}", "",
                "| d | causal | seqlen | batch x heads | family | plain ms | plain TFLOP/s | " +
                " | ".join(f"{m} ms | {m} overhead" for m in SCORE_MODS[1:]) + " |",
                "|" + "---|" * (7 + 2 * len(SCORE_MODS[1:]))]
        for (m, d, c, s), family, mods in _score_mod_cases(rows):
            plain = mods.get("none")
            if m != mode or plain is None:
                continue
            cells = [str(d), str(c), str(s), f"{plain['batch']}x{plain['nheads']}", family or "auto",
                     f"{plain['ms']:.3f}", f"{plain['tflops']:.1f}"]
            for mod in SCORE_MODS[1:]:
                r = mods.get(mod)
                pct = f"{r['overhead_pct']:+.1f}%" if r and r["overhead_pct"] is not None else "-"
                cells += [f"{r['ms']:.3f}" if r else "-", pct if not r or r["within_bar"] is not False
                          else f"**{pct}**"]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    out += [f"softcap = {_softcap_of(rows)}; alibi: float32 slopes 2^(−8(h+1)/H); dropout_p = {_dropout_p_of(rows)}. "
            f"overhead = mod ms / plain ms − 1 (issues 14 and 15: ≤ {SCORE_MOD_BAR:.0f}%, bold when over). "
            f"{_score_mods_summary(rows)}.", ""]
    versus = [r for r in rows if r.get("vs_sdpa_flash") is not None]
    if versus:
        pairs = ", ".join(f"{r['mode']} d={r['headdim']} {'causal' if r['causal'] else 'full'} {r['seqlen']}: "
                          f"{r['vs_sdpa_flash']:.2f}×" for r in versus)
        out += [f"Dropout against SDPA-flash with the same dropout_p (its time / flashcute's, auto family): {pairs}.",
                ""]
    if plot:
        out += [f"![overhead vs seqlen]({plot})", ""]
    return "\n".join(out)


def format_table(rows):
    """One line per point: flashcute's ms and TFLOP/s, and its speed over each peer's (the
    other sweeps: their own tables)."""
    sweep = _sweep_of(rows)
    if sweep != "dense":
        return dict(block_sparse=format_sparse_table, window=format_window_table, varlen=format_varlen_table,
                    score_mods=format_score_mods_table, decode=format_decode_table)[sweep](rows)
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
    TFLOP/s and each peer's time over flashcute's (> 1: flashcute faster); the other sweeps:
    their own sections."""
    sweep = _sweep_of(rows)
    if sweep != "dense":
        return dict(block_sparse=sparse_markdown_report, window=window_markdown_report,
                    varlen=varlen_markdown_report, score_mods=score_mods_markdown_report,
                    decode=decode_markdown_report)[sweep](env, rows, command, plot)
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


def write_outputs(out_dir: Path, env, rows, table, argv=None):
    """bench.json, bench.csv, bench.md (its command from `argv`, default sys.argv), bench.txt, bench.png."""
    argv = sys.argv[1:] if argv is None else argv
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    with open(out_dir / "bench.csv", "w", newline="") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    command = "python -m flashcute.bench " + " ".join(map(str, argv))
    (out_dir / "bench.md").write_text(markdown_report(env, rows, command,
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


def _sweep_panels(rows, env, path, xlabel, draw):
    """One panel per (mode, head dim, causal) in rows and seqlen in columns; draw(ax, here) plots a
    panel's rows; the common axes, titles and legend here."""
    plt = _pyplot()
    panels = sorted({(_mode_order(r["mode"]), r["mode"], r["headdim"], r["causal"]) for r in rows})
    seqlens = sorted({r["seqlen"] for r in rows})
    if plt is None or not panels:
        return
    fig, axes = plt.subplots(len(panels), len(seqlens), figsize=(3.8 * len(seqlens), 3.0 * len(panels)),
                             squeeze=False)
    for i, (_, mode, d, c) in enumerate(panels):
        for j, s in enumerate(seqlens):
            ax = axes[i][j]
            draw(ax, [r for r in rows if (r["mode"], r["headdim"], r["causal"], r["seqlen"]) == (mode, d, c, s)])
            ax.set_ylim(bottom=0)
            ax.set_title(f"{mode}  d={d}  causal={c}  s={s}", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel("ms", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6)
    fig.suptitle(f"{env['device']}, {env['date']}, {env.get('torch', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# flashcute's time, its bound and flex's time: the lines of the density and window plots.
_BOUND_LINES = [("flashcute", "ms", "flashcute", dict(linewidth=2.5, marker="o")),
                ("flashcute", "bound_ms", "flashcute bound", dict(linestyle="--")),
                ("flex", "ms", "flex", dict(marker="o"))]


def plot_density(rows, env, path):
    """Time vs density (log axis): lines for flashcute, its bound and flex over the random masks
    (density 1: dense); crosses: sliding."""
    def draw(ax, here):
        for impl, key, label, style in _BOUND_LINES:
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

    _sweep_panels(rows, env, path, "density (blocks kept)", draw)


def plot_window(rows, env, path):
    """Time vs window: lines for flashcute, its bound and flex; dense flashcute as a horizontal line."""
    def draw(ax, here):
        for impl, key, label, style in _BOUND_LINES:
            pts = sorted((r["window"], r[key]) for r in here if r["impl"] == impl and r["window"] and r[key])
            if pts:
                ax.plot(*zip(*pts), label=label, **style)
        dense = [r["ms"] for r in here if r["impl"] == "dense"]
        if dense:
            ax.axhline(dense[0], color="gray", linestyle=":", label="dense flashcute")
        ax.set_xscale("log", base=2)

    _sweep_panels(rows, env, path, "window (tokens)", draw)


def plot_varlen(rows, env, path):
    """TFLOP/s (real pairs) per impl, bars grouped by (head dim, causal), one panel per mode."""
    plt = _pyplot()
    modes = sorted({r["mode"] for r in rows}, key=_mode_order)
    if plt is None or not modes:
        return
    impls = ["flashcute", *_varlen_peers(rows)]
    groups = sorted({(r["headdim"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(modes), figsize=(1.2 + 1.1 * len(groups) * len(modes) * len(impls) / 2, 3.2),
                             squeeze=False)
    width = 0.8 / len(impls)
    for ax, mode in zip(axes[0], modes):
        for n, impl in enumerate(impls):
            tf = {(r["headdim"], r["causal"]): r["tflops"] for r in rows if r["mode"] == mode and r["impl"] == impl}
            ax.bar([g + n * width for g in range(len(groups))], [tf.get(g, 0) for g in groups], width, label=impl)
        ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))],
                      [f"d={d}\n{'causal' if c else 'full'}" for d, c in groups], fontsize=7)
        ax.set_title(mode, fontsize=9)
        ax.set_ylabel("TFLOP/s (real pairs)", fontsize=8)
        ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=6)
    fig.suptitle(f"{env['device']}, {env['date']}, {env.get('torch', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_score_mods(rows, env, path):
    """Overhead % over plain flashcute vs seqlen, one panel per (mode, head dim, causal): a line
    per score mod (the auto family) and the 10 % bar."""
    plt = _pyplot()
    panels = sorted({(_mode_order(r["mode"]), r["mode"], r["headdim"], r["causal"]) for r in rows})
    if plt is None or not panels:
        return
    cols = sorted({(d, c) for _, _, d, c in panels})
    modes = sorted({m for _, m, _, _ in panels}, key=_mode_order)
    fig, axes = plt.subplots(len(modes), len(cols), figsize=(3.6 * len(cols), 2.9 * len(modes)), squeeze=False)
    for i, mode in enumerate(modes):
        for j, (d, c) in enumerate(cols):
            ax = axes[i][j]
            for mod in SCORE_MODS[1:]:
                pts = sorted((r["seqlen"], r["overhead_pct"]) for r in rows if r["impl"] == mod and
                             (r["mode"], r["headdim"], r["causal"]) == (mode, d, c) and r["overhead_pct"] is not None)
                if pts:
                    ax.plot(*zip(*pts), marker="o", label=mod)
            ax.axhline(SCORE_MOD_BAR, color="gray", linestyle="--", label="bar")
            ax.axhline(0, color="black", linewidth=0.5)
            ax.set_xscale("log", base=2)
            ax.set_title(f"{mode}  d={d}  causal={c}", fontsize=9)
            ax.set_xlabel("seqlen", fontsize=8)
            ax.set_ylabel("overhead %", fontsize=8)
            ax.tick_params(labelsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{env['device']}, {env['date']}, {env.get('torch', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot(rows, env, path):
    """TFLOP/s vs seqlen, one panel per (mode, head dim, causal): modes in rows (time vs density
    for --block-sparse rows; the other sweeps: their own plots)."""
    sweep = _sweep_of(rows)
    if sweep != "dense":
        return dict(block_sparse=plot_density, window=plot_window, varlen=plot_varlen,
                    score_mods=plot_score_mods, decode=plot_decode)[sweep](rows, env, path)
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


# ---- --decode: KV-cache decoding and chunked prefill (features.md 6.5) ----------------------------
DECODE_PEERS = ["sdpa_flash", "sdpa_cudnn"]  # on CUDA; on the CPU: sdpa_cpu
DECODE_PEER_NAMES = {"sdpa_flash": "SDPA-flash", "sdpa_cudnn": "SDPA-cuDNN", "sdpa_cpu": "SDPA-CPU"}
DECODE_PEER_SHORT = {"sdpa_flash": "flash", "sdpa_cudnn": "cuDNN", "sdpa_cpu": "CPU"}
DECODE_KINDS = ["decode", "append", "chunked"]
DECODE_SMALL_BYTES = 200 * 10**6  # K/V under this (or under 4x L2) is rotated through several copies
DECODE_CHECK_TOL = 2e-2  # ||flashcute - other|| / ||other|| over this flags a MISMATCH (bf16: ~3e-3)


def decode_kv_bytes(batch, seqlen_k, nheads_kv, headdim, itemsize):
    """The unique K/V bytes one call must read: 2 * sum_b sk_b * h_k * d * sizeof(dtype);
    `seqlen_k` an int (every sequence) or the per-sequence lengths."""
    total = seqlen_k * batch if isinstance(seqlen_k, int) else sum(seqlen_k)
    if not isinstance(seqlen_k, int) and len(seqlen_k) != batch:
        raise ValueError(f"{len(seqlen_k)} lengths for batch {batch}")
    return 2 * total * nheads_kv * headdim * itemsize


def decode_flops(batch, seqlen_q, seqlen_k, nheads, headdim, causal):
    """4 * b * h * d * (the keys each query sees, summed): all seqlen_k, or bottom-right causal
    (query i sees seqlen_k - seqlen_q + i + 1 keys)."""
    if causal:
        keys = sum(min(max(seqlen_k - seqlen_q + i + 1, 0), seqlen_k) for i in range(seqlen_q))
    else:
        keys = seqlen_q * seqlen_k
    return 4.0 * batch * nheads * headdim * keys


def decode_copies(kv_bytes, l2_bytes):
    """How many K/V buffer sets a timed run rotates through, so that L2 cannot serve repeated
    calls: enough to exceed max(4 x L2, 200 MB) together (1 when one set does)."""
    return max(1, math.ceil(max(4 * l2_bytes, DECODE_SMALL_BYTES) / max(kv_bytes, 1)))


def decode_page_size(layout):
    """None for "contig", N for "pagedN"; ValueError for anything else."""
    if layout == "contig":
        return None
    if layout.startswith("paged") and layout[5:].isdigit() and int(layout[5:]) > 0 and int(layout[5:]) % 16 == 0:
        return int(layout[5:])
    raise ValueError(f"--layouts: {layout!r} is not 'contig' or 'paged<N>' with N a multiple of 16")


def _cache_label(n):
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def decode_grid(args):
    """The points of --decode, as dicts: kind ("decode": one query per sequence against a full
    cache, k = v = None; "append": the same with one new token appended (k, v of seqlen 1);
    "chunked": a chunk of queries against a cache, causal), batch, cache (keys attended to),
    seqlen_q, nheads, nheads_kv, headdim, layouts."""
    points = []
    for d in args.headdims:
        for b in args.batches:
            for sk in args.caches:
                for hk in args.kv_heads:
                    points.append(dict(kind="decode", batch=b, cache=sk, seqlen_q=1, nheads=args.nheads,
                                       nheads_kv=hk, headdim=d, layouts=list(args.layouts)))
        if args.append_cache:
            points += [dict(kind="append", batch=1, cache=args.append_cache, seqlen_q=1, nheads=args.nheads,
                            nheads_kv=hk, headdim=d, layouts=["contig"]) for hk in args.kv_heads]
        if args.chunk:
            points += [dict(kind="chunked", batch=1, cache=args.chunk_cache, seqlen_q=args.chunk, nheads=args.nheads,
                            nheads_kv=hk, headdim=d, layouts=["contig"]) for hk in args.chunk_kv_heads]
    for pt in points:
        if pt["nheads"] % pt["nheads_kv"]:
            raise ValueError(f"--nheads {pt['nheads']} is not a multiple of --kv-heads {pt['nheads_kv']}")
        if pt["seqlen_q"] > pt["cache"]:
            raise ValueError(f"--chunk {pt['seqlen_q']} is longer than --chunk-cache {pt['cache']}")
    return points


def _l2_bytes(device):
    if device != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or 60 * 2**20


def _decode_memory_limit(args, device):
    if device != "cuda":
        return None
    return args.mem_fraction * torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def _graph_time(timer, calls, n_calls):
    """Median ms of one call: a CUDA graph of n_calls calls cycling through `calls`, its replays
    timed by `timer` (each call warmed up eagerly before, as CUDA graphs require)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:
            call()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(n_calls):
            calls[i % len(calls)]()
    graph.replay()
    torch.cuda.synchronize()
    try:
        return timer(graph.replay) / n_calls
    finally:
        del graph


def _decode_time(args, device, timer, calls, kv_bytes):
    """(median ms of one call, how it was timed): CUDA graph replays (--decode-timing graph;
    eager when capture fails) or eager calls, rotating through `calls` (one per buffer set);
    on the CPU a wall clock on calls[0]."""
    if device != "cuda":
        return timer(calls[0]), "cpu"
    if args.decode_timing == "graph":
        n_calls = max(len(calls), min(20, max(2, math.ceil(2e9 / max(kv_bytes, 1)))))
        try:
            return _graph_time(timer, calls, n_calls), "graph"
        except Exception as exc:  # noqa: BLE001 - a call that cannot be captured is timed eagerly
            torch.cuda.synchronize()
            print(f"# CUDA graph capture failed ({type(exc).__name__}: {str(exc).splitlines()[0][:100]}); "
                  "timing eager calls", file=sys.stderr)
    cycle = itertools.cycle(calls)
    return timer(lambda: next(cycle)()), "eager"


def _short(exc):
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {(text[0] if text else '')[:140]}"


def _rel_err(out, ref):
    if out is None or ref is None:
        return None
    out, ref = out.float(), ref.float()
    return float((out - ref).norm() / ref.norm().clamp(min=1e-30))


def _free(device):
    """Hands the freed K/V buffers back (their last references were just dropped; no gc.collect:
    it costs a quarter second per call in a big process)."""
    if device == "cuda":
        torch.cuda.empty_cache()


def _to_paged(cache, page, block_table):
    """A paged copy (num_pages, page, h_k, d) of a contiguous cache (b, capacity, h_k, d):
    position t of sequence b at page block_table[b, t // page], slot t % page. Pages and slots
    past the capacity get random values (never zeros)."""
    b, cap, hk, d = cache.shape
    paged = torch.randn(block_table.numel(), page, hk, d, dtype=cache.dtype, device=cache.device)
    full, rem = divmod(cap, page)
    if full:
        src = cache[:, :full * page].reshape(b * full, page, hk, d)
        paged.index_copy_(0, block_table[:, :full].reshape(-1).long(), src)
    if rem:
        paged[block_table[:, full].long(), :rem] = cache[:, full * page:]
    return paged


def _decode_peer(name, qp, device, causal, seqlen_q, seqlen_k, gqa, new_kv, cache_len):
    """forward(kp, vp) of a peer on (b, h, sq, d) queries and (b, h_k, sk, d) caches; with
    new_kv, the new token is copied into the caches first (what SDPA users pay for an append).
    Bottom-right causal (chunked prefill): SDPA-flash through
    torch.nn.attention.bias.causal_lower_right, which runs the flash kernel (checked, so that
    it never silently runs another backend); SDPA-cuDNN with the mask materialised (bool) as
    attn_mask; the CPU peer with causal_lower_right."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if causal:
        from torch.nn.attention.bias import causal_lower_right  # a slow import: only where needed
    backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}.get(name)
    kw = {"enable_gqa": True} if gqa else {}
    if causal and seqlen_q == seqlen_k:
        kw["is_causal"] = True
    elif causal and name == "sdpa_cudnn":
        kw["attn_mask"] = causal_lower_right(seqlen_q, seqlen_k)._materialize(device)[None, None]
    elif causal:
        kw["attn_mask"] = causal_lower_right(seqlen_q, seqlen_k)

    def fwd(kp, vp):
        if new_kv is not None:
            kp[:, :, cache_len:cache_len + 1].copy_(new_kv[0].transpose(1, 2))
            vp[:, :, cache_len:cache_len + 1].copy_(new_kv[1].transpose(1, 2))
        with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
            return F.scaled_dot_product_attention(qp, kp, vp, **kw)

    if name == "sdpa_flash" and causal and "attn_mask" in kw:
        def checked(kp, vp):
            from torch.backends.cuda import SDPAParams, can_use_flash_attention

            if not can_use_flash_attention(SDPAParams(qp, kp, vp, None, 0.0, False, bool(gqa)), False):
                raise RuntimeError("causal_lower_right would not run the flash kernel on these inputs")
            return fwd(kp, vp)
        return checked
    return fwd


def _decode_row(point, dtype, impl, layout, ms, kv_bytes, flops, copies, timing=None, note=None, rel_err=None,
                contig_ms=None, flashcute_ms=None):
    """One --decode row (the same keys for every row: CSV needs them)."""
    return dict(impl=impl, kind=point["kind"], dtype=str(dtype).replace("torch.", ""), headdim=point["headdim"],
                batch=point["batch"], cache=point["cache"], seqlen_q=point["seqlen_q"], nheads=point["nheads"],
                nheads_kv=point["nheads_kv"], causal=point["kind"] == "chunked", layout=layout, copies=copies,
                kv_bytes=kv_bytes, flops=flops, ms=ms, us=ms * 1e3 if ms else None,
                gbps=kv_bytes / ms / 1e6 if ms else None, tflops=flops / ms / 1e9 if ms else None, timing=timing,
                contig_ms=contig_ms, flashcute_ms=flashcute_ms,
                peer_over_flashcute=ms / flashcute_ms if ms and flashcute_ms else None,
                contig_over_this=contig_ms / ms if ms and contig_ms else None, rel_err=rel_err, note=note)


def run_decode_point(args, device, dtype, timer, point, l2_bytes=0, limit=None, seed=0):
    """The rows of one --decode point: flashcute on each layout, then each peer (contiguous
    (b, h_k, sk, d) caches). Where memory allows, every layout holds the same K/V values
    (paged: a permutation of pages; peers: transposed copies) and the outputs of the first
    buffer set are compared with flashcute's contiguous one (rel_err)."""
    b, sk, sq, h, hk, d = (point[k] for k in ("batch", "cache", "seqlen_q", "nheads", "nheads_kv", "headdim"))
    kind = point["kind"]
    causal, s_new = kind == "chunked", 1 if kind == "append" else 0
    cache_len = sk - s_new  # tokens in the cache before the call; the call attends to sk keys
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_bytes = decode_kv_bytes(b, sk, hk, d, itemsize)
    flops = decode_flops(b, sq, sk, h, d, causal)
    copies = decode_copies(kv_bytes, l2_bytes) if device == "cuda" else 1
    row = functools.partial(_decode_row, point, dtype, kv_bytes=kv_bytes, flops=flops, copies=copies)
    peers = ([] if args.no_peers else [p for p in DECODE_PEERS if p in args.peers]) if device == "cuda" else (
        [] if args.no_peers else ["sdpa_cpu"])
    if limit is not None and kv_bytes * copies > limit:
        note = (f"skipped: {kv_bytes * copies / 2**30:.1f} GiB of K/V > {args.mem_fraction:.0%} of the GPU's "
                "memory")
        return [row("flashcute", layout, None, note=note) for layout in point["layouts"]] + [
            row(p, "contig", None, note=note) for p in peers]
    same_data = limit is None or 2 * kv_bytes * copies <= limit
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, dtype=dtype, device=device, generator=gen)

    q = randn(b, sq, h, d)
    new_kv = (randn(b, s_new, hk, d), randn(b, s_new, hk, d)) if s_new else None
    seqlens = torch.full((b,), cache_len, dtype=torch.int32, device=device)
    attend = flashcute.attention_with_kvcache

    def ours(block_table=None):
        k, v = new_kv or (None, None)
        return lambda kc, vc: attend(q, kc, vc, k, v, cache_seqlens=seqlens, block_table=block_table, causal=causal,
                                     num_splits=args.num_splits)

    def measure(forward, buffers):
        """(ms, timing, out of buffers[0], note) of forward over the buffer sets."""
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                calls = [functools.partial(forward, *bufs) for bufs in buffers]
                out = calls[0]()
                ms, timing = _decode_time(args, device, timer, calls, kv_bytes)
            return ms, timing, out, None
        except Exception as exc:  # noqa: BLE001 - an impl that cannot run this point is n/a
            if device == "cuda":
                with contextlib.suppress(Exception):
                    torch.cuda.synchronize()
            return None, None, None, _short(exc)

    rows = []
    try:
        contig = [(randn(b, sk, hk, d), randn(b, sk, hk, d)) for _ in range(copies)]
    except torch.cuda.OutOfMemoryError as exc:
        _free(device)
        return [row("flashcute", layout, None, note=_short(exc)) for layout in point["layouts"]]
    ref_ms, timing, ref_out, note = measure(ours(), contig)
    results = {"contig": (ref_ms, timing, note, None)}
    if not same_data:
        del contig
        _free(device)
    for p in peers:  # contiguous (b, h_k, sk, d) caches, SDPA's layout
        try:
            if same_data:
                bufs = [(kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()) for kc, vc in contig]
            else:
                bufs = [(randn(b, hk, sk, d), randn(b, hk, sk, d)) for _ in range(copies)]
        except torch.cuda.OutOfMemoryError as exc:
            _free(device)
            rows.append(row(p, "contig", None, note=_short(exc)))
            continue
        qp = q.transpose(1, 2).contiguous()
        forward = _decode_peer(p, qp, device, causal, sq, sk, hk < h, new_kv, cache_len)
        ms, p_timing, out, p_note = measure(forward, bufs)
        err = _rel_err(out.transpose(1, 2), ref_out) if same_data and out is not None else None
        rows.append(row(p, "contig", ms, timing=p_timing, note=p_note, rel_err=err, flashcute_ms=ref_ms))
        del bufs, out
        _free(device)
    for layout in point["layouts"]:
        page = decode_page_size(layout)
        if page is None:
            continue
        pages = math.ceil(sk / page)
        perm = torch.randperm(b * pages, generator=torch.Generator().manual_seed(seed + page))
        block_table = perm.view(b, pages).to(torch.int32).to(device)
        try:
            if same_data:
                bufs = [(_to_paged(kc, page, block_table), _to_paged(vc, page, block_table)) for kc, vc in contig]
            else:
                bufs = [(randn(b * pages, page, hk, d), randn(b * pages, page, hk, d)) for _ in range(copies)]
        except torch.cuda.OutOfMemoryError as exc:
            _free(device)
            results[layout] = (None, None, _short(exc), None)
            continue
        ms, p_timing, out, p_note = measure(ours(block_table), bufs)
        results[layout] = (ms, p_timing, p_note, _rel_err(out, ref_out) if same_data else None)
        del bufs, out
        _free(device)
    if same_data:
        del contig
    _free(device)
    for layout in point["layouts"]:
        ms, timing, note, err = results.get(layout, (None, None, "not run", None))
        rows.insert(point["layouts"].index(layout), row("flashcute", layout, ms, timing=timing, note=note,
                                                         rel_err=err, contig_ms=ref_ms if layout != "contig" else None))
    return rows


def run_decode_sweep(args):
    """--decode: every point of decode_grid, flashcute on each layout and the peers on
    contiguous caches, in this one process."""
    device, dtype = _device_and_dtype(args)
    timer = _timer(device)
    l2, limit = _l2_bytes(device), _decode_memory_limit(args, device)
    points = decode_grid(args)
    if device == "cuda":
        print(f"# L2 {l2 / 2**20:.0f} MiB: K/V under {max(4 * l2, DECODE_SMALL_BYTES) / 1e6:.0f} MB is rotated "
              f"through several copies; points over {limit / 2**30:.1f} GiB ({args.mem_fraction:.0%} of the GPU's "
              f"memory) are skipped; timing: {args.decode_timing}", file=sys.stderr)
    rows = []
    for idx, point in enumerate(points, 1):
        got = run_decode_point(args, device, dtype, timer, point, l2, limit, seed=args.seed + idx)
        rows += got
        where = (f"{point['kind']} b={point['batch']} cache={point['cache']} sq={point['seqlen_q']} "
                 f"h={point['nheads']}/{point['nheads_kv']} d={point['headdim']}")
        print(f"[{idx}/{len(points)}] {where}: " + ", ".join(
            f"{r['impl']}:{r['layout']} " + (f"{r['us']:.1f} us" if r["ms"] else "n/a") for r in got),
            file=sys.stderr, flush=True)
    return device, rows


def _decode_peers_in(rows):
    present = {r["impl"] for r in rows}
    return [p for p in [*DECODE_PEERS, "sdpa_cpu"] if p in present]


def _decode_points_of(rows, kind):
    """{(headdim, batch, cache, seqlen_q, nheads, nheads_kv): {(impl, layout): row}} of one kind, in order."""
    points = {}
    for r in rows:
        if r["kind"] == kind:
            key = (r["headdim"], r["batch"], r["cache"], r["seqlen_q"], r["nheads"], r["nheads_kv"])
            points.setdefault(key, {})[(r["impl"], r["layout"])] = r
    return dict(sorted(points.items(), key=lambda item: (item[0][0], item[0][1], item[0][2], item[0][3],
                                                         item[0][4], -item[0][5])))


def _decode_layouts_in(rows):
    layouts = {r["layout"] for r in rows}
    return sorted(layouts, key=lambda layout: decode_page_size(layout) or 0)


def _rate(r):
    """GB/s of a decode row, TFLOP/s of a chunked one."""
    if r["kind"] == "chunked":
        return f"{r['tflops']:.1f}"
    return f"{r['gbps']:.0f}" if r["gbps"] >= 100 else f"{r['gbps']:.2f}"


def _decode_cells(impls, layout, peers):
    """The cells of one line: flashcute's µs, GB/s (TFLOP/s for chunked lines), each peer's
    time over this one, contig's time over this one, each peer's GB/s (contig lines); and the
    line's notes."""
    ours = impls.get(("flashcute", layout))
    ok = ours is not None and ours["ms"] is not None
    cells = [f"{ours['us']:.1f}" if ok else "n/a", _rate(ours) if ok else "-"]
    notes = []
    if ours is not None and ours["note"]:
        notes.append(ours["note"] if ours["note"].startswith("skipped") else "flashcute n/a")
    peer_rows = [impls.get((p, "contig")) for p in peers]
    for r in peer_rows:
        if ok and r is not None and r["ms"] is not None:
            cells.append(f"{r['ms'] / ours['ms']:.2f}")
        else:
            cells.append("n/a" if r is not None and r["note"] and not r["note"].startswith("skipped") else "-")
    cells.append(f"{ours['contig_over_this']:.2f}" if ok and ours["contig_over_this"] else "-")
    cells += [_rate(r) if layout == "contig" and r is not None and r["ms"] is not None else "-" for r in peer_rows]
    # The checks: on the contig line the peers against flashcute, on a paged line flashcute against contig.
    for r in (peer_rows if layout == "contig" else [ours]):
        if r is not None and r["rel_err"] is not None and r["rel_err"] > DECODE_CHECK_TOL:
            against = "contig" if r["impl"] == "flashcute" else DECODE_PEER_NAMES[r["impl"]]
            notes.append(f"MISMATCH vs {against}: rel err {r['rel_err']:.1e}")
    timings = {r["timing"] for r in [ours, *peer_rows] if r and r["timing"]}
    if len(timings) > 1:
        notes.append("timed " + " / ".join(sorted(timings)) + " (a graph capture failed)")
    return cells, notes


def _decode_header(kind, peers, dims):
    lead = (["d"] if len(dims) > 1 else []) + (["b", "queries", "cache"] if kind == "chunked" else ["b", "cache"])
    rate = "TFLOP/s" if kind == "chunked" else "GB/s"
    return (lead + ["h/h_k", "layout", "flashcute µs", rate] + [f"x {DECODE_PEER_NAMES[p]}" for p in peers]
            + ["x contig"] + [f"{DECODE_PEER_SHORT[p]} {rate}" for p in peers] + ["note"])


def _decode_lines(rows):
    """[(kind, header, [[cell, ...] per line], notes)] for the kinds in rows; notes: why an impl
    was n/a, each reason once with the points it hit."""
    peers = _decode_peers_in(rows)
    dims = sorted({r["headdim"] for r in rows})  # more than one: a column d
    out = []
    for kind in DECODE_KINDS:
        lines, failures = [], {}
        for (d, b, sk, sq, h, hk), impls in _decode_points_of(rows, kind).items():
            for layout in _decode_layouts_in([r for r in impls.values() if r["impl"] == "flashcute"]):
                cells, line_notes = _decode_cells(impls, layout, peers)
                lead = ([str(d)] if len(dims) > 1 else []) + (
                    [str(b), str(sq), _cache_label(sk)] if kind == "chunked" else [str(b), _cache_label(sk)])
                lines.append(lead + [f"{h}/{hk}", layout] + cells + ["; ".join(line_notes)])
            for r in impls.values():
                if r["ms"] is None and r["note"] and not r["note"].startswith("skipped"):
                    name = DECODE_PEER_NAMES.get(r["impl"], r["impl"]) + (
                        f" {r['layout']}" if r["impl"] == "flashcute" else "")
                    failures.setdefault((name, r["note"]), []).append(
                        f"b={b} cache={_cache_label(sk)} h={h}/{hk}" + (f" d={d}" if d != 128 else ""))
        notes = [f"{name} n/a at {where[0]}" + (f" and {len(where) - 1} more" if len(where) > 1 else "")
                 + f": {reason}" for (name, reason), where in failures.items()]
        if lines:
            out.append((kind, _decode_header(kind, peers, dims), lines, notes))
    return out


_DECODE_TITLES = {
    "decode": "decode: one query per sequence, full cache, no append (k = v = None)",
    "append": "decode with one appended token (k, v of seqlen 1; peers: the copy into the cache + SDPA)",
    "chunked": "chunked prefill: a chunk of queries against the cache, causal (bottom-right)",
}


def _decode_legend(rows, peers):
    r = next((r for r in rows if r["ms"] is not None), rows[0] if rows else None)
    if r is None:
        return []
    timing = {r["timing"] for r in rows if r["timing"]}
    itemsize = torch.empty((), dtype=getattr(torch, r["dtype"])).element_size()
    dims = "/".join(str(d) for d in sorted({r["headdim"] for r in rows}))
    return [f"{r['dtype']}, d={dims}; GB/s = unique K/V bytes (2 * b * cache * h_k * d * {itemsize}) / time; "
            "chunked TFLOP/s = 4 * b * h * d * (keys each query sees, summed) / time",
            "x peer = peer time / flashcute time, the peers on contiguous (b, h_k, sk, d) caches (> 1: flashcute "
            "faster); x contig = flashcute contig time / this layout's time; flash / cuDNN GB/s: the peers' own; "
            "n/a: the impl refused the point (the reasons under each table)",
            f"timing: {', '.join(sorted(timing)) or '-'}" + (
                " (graph: CUDA-graph replays, eager: eager calls; rotating through K/V copies of at least "
                "max(4 x L2, 200 MB) in all)" if timing - {"cpu"} else " (wall clock, CPU backend)") +
            f"; peers: {', '.join(DECODE_PEER_NAMES[p] for p in peers) or 'none'}"]


def format_decode_table(rows):
    """One table per kind (decode, append, chunked): b, cache, h/h_k, layout, flashcute µs,
    GB/s (chunked: TFLOP/s), x each peer, x contig, each peer's GB/s, notes; then why an impl
    was n/a."""
    peers = _decode_peers_in(rows)
    text = []
    for kind, head, lines, notes in _decode_lines(rows):
        widths = [max(len(head[i]), *(len(line[i]) for line in lines)) for i in range(len(head))]
        left = {head.index("layout"), len(head) - 1}  # text columns

        def fmt(cells):
            return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
        text += ["", _DECODE_TITLES[kind], fmt(head), "-" * len(fmt(head))]
        text += [fmt(line) for line in lines]
        text += notes[:20] + ([f"... and {len(notes) - 20} more reasons (bench.json)"] if len(notes) > 20 else [])
    return "\n".join(text[1:] + [""] + _decode_legend(rows, peers))


def decode_markdown_report(env, rows, command, plot=None):
    """BENCHMARKS.md-style section for --decode: one table per kind."""
    out = _markdown_head(env, command)
    peers = _decode_peers_in(rows)
    for kind, head, lines, notes in _decode_lines(rows):
        out += [f"### {_DECODE_TITLES[kind]}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        out += ["| " + " | ".join(c or " " for c in line) + " |" for line in lines]
        out += [""] + [f"- {n}" for n in notes[:20]] + ([""] if notes else [])
    out += [" ".join(line + "." for line in _decode_legend(rows, peers)), ""]
    if plot:
        out += [f"![GB/s vs cache]({plot})", ""]
    return "\n".join(out)


def plot_decode(rows, env, path):
    """GB/s vs cache length, one panel per (batch, h_k) of the decode rows: a line per
    flashcute layout and per peer."""
    plt = _pyplot()
    rows = [r for r in rows if r["kind"] == "decode" and r["gbps"]]
    batches = sorted({r["batch"] for r in rows})
    kv_heads = sorted({r["nheads_kv"] for r in rows}, reverse=True)
    if plt is None or not rows:
        return
    fig, axes = plt.subplots(len(batches), len(kv_heads), figsize=(3.8 * len(kv_heads), 2.9 * len(batches)),
                             squeeze=False)
    lines = sorted({(r["impl"], r["layout"], r["headdim"]) for r in rows}, key=lambda il: (il[0] != "flashcute", il))
    several_dims = len({d for _, _, d in lines}) > 1
    for i, b in enumerate(batches):
        for j, hk in enumerate(kv_heads):
            ax = axes[i][j]
            for impl, layout, d in lines:
                key = (b, hk, impl, layout, d)
                pts = sorted((r["cache"], r["gbps"]) for r in rows
                             if (r["batch"], r["nheads_kv"], r["impl"], r["layout"], r["headdim"]) == key)
                if pts:
                    label = (f"{impl} {layout}" if impl == "flashcute" else impl) + (f" d{d}" if several_dims else "")
                    ax.plot(*zip(*pts), marker="o", label=label, linewidth=2.0 if impl == "flashcute" else 1.0)
            ax.set_xscale("log", base=2)
            ax.set_ylim(bottom=0)
            ax.set_title(f"b={b}  h_k={hk}", fontsize=9)
            ax.set_xlabel("cache (keys)", fontsize=8)
            ax.set_ylabel("GB/s (unique K/V)", fontsize=8)
            ax.tick_params(labelsize=7)
            ax.legend(fontsize=6)
    fig.suptitle(f"decode, {env['device']}, {env['date']}, {env.get('torch', '')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


SWEEPS = dict(dense=run_sweep, block_sparse=run_block_sparse_sweep, window=run_window_sweep,
              varlen=run_varlen_sweep, score_mods=run_score_mods_sweep, decode=run_decode_sweep)


def _sweep_defaults(args, on_gpu):
    """Fill in the options left None with the chosen sweep's defaults (the issues' figures on a
    GPU, small sizes on the CPU)."""
    sweep = args.sweep
    if sweep == "decode":
        return _decode_defaults(args, on_gpu)
    if args.seqlens is None:
        args.seqlens = {"block_sparse": [8192, 16384] if on_gpu else [512, 1024],
                        "window": [8192, 16384] if on_gpu else [512, 1024],
                        "score_mods": [2048, 4096, 8192, 16384] if on_gpu else [128, 256],
                        }.get(sweep, [512, 1024, 2048, 4096, 8192, 16384] if on_gpu else [128, 256, 512])
    args.headdims = args.headdims or ([128] if sweep in ("block_sparse", "window") else [64, 128])
    args.modes = args.modes or (["fwd"] if sweep == "dense" else ["fwd", "fwdbwd"])
    args.causal = args.causal or ([True] if sweep == "window" else [False, True])
    if args.tokens is None:
        args.tokens = (131072 if on_gpu else 512) if sweep == "varlen" else 16384 if on_gpu else 1024
    args.hidden = args.hidden or (2048 if on_gpu else 256)
    if sweep == "window":
        args.windows = args.window or ([1024, 4096] if on_gpu else [64, 256])
    if sweep == "block_sparse":
        args.window = args.window[0] if args.window else 1024
    if sweep == "varlen":
        args.num_seqs = args.num_seqs or (64 if on_gpu else 4)
        low, high = args.lengths or ((64, 4096) if on_gpu else (16, 256))
        args.lengths_drawn = varlen_lengths(args.num_seqs, low, high, args.tokens, seed=args.seed)


def _decode_defaults(args, on_gpu):
    """--decode's grid: the issue's on a GPU (--decode-quick: a reduced one), small sizes on the CPU."""
    quick = args.decode_quick
    if on_gpu:
        grid = dict(batches=[1, 8] if quick else [1, 8, 32], caches=[32768] if quick else [8192, 32768, 131072],
                    nheads=32, kv_heads=[32, 8] if quick else [32, 8, 1], headdims=[128], append_cache=32768,
                    chunk=512, chunk_cache=32768)
    else:
        grid = dict(batches=[1] if quick else [1, 2], caches=[256] if quick else [256, 1024], nheads=4,
                    kv_heads=[4, 1], headdims=[32], append_cache=256, chunk=32, chunk_cache=256 if quick else 1024)
    for name, value in grid.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.chunk_kv_heads is None:
        args.chunk_kv_heads = [args.nheads] if quick else sorted({args.nheads, max(1, args.nheads // 4)}, reverse=True)
    args.layouts = args.layouts or ["contig", "paged16", "paged128"]
    for layout in args.layouts:
        decode_page_size(layout)  # ValueError for a bad one
    if "contig" not in args.layouts:
        args.layouts = ["contig", *args.layouts]  # the reference of the paged layouts
    args.layouts = sorted(dict.fromkeys(args.layouts), key=lambda layout: decode_page_size(layout) or 0)
    if not 0 < args.mem_fraction <= 1:
        raise ValueError(f"--mem-fraction {args.mem_fraction} must be in (0, 1]")
    decode_grid(args)  # ValueError for an impossible point


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashcute.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--headdims", type=int, nargs="+", default=None,
                   help="default: 64 128 (--block-sparse, --window: 128)")
    p.add_argument("--seqlens", type=int, nargs="+", default=None,
                   help="default: 512..16384 on CUDA, 128 256 512 on CPU (--block-sparse, --window: 8192 16384 on "
                        "CUDA, 512 1024 on CPU; --score-mods: 2048..16384 on CUDA, 128 256 on CPU; not used by "
                        "--varlen)")
    p.add_argument("--causal", type=lambda s: s.lower() in ("1", "true", "yes"), nargs="+", default=None,
                   help="default: false true (--window: true; false adds symmetric windows)")
    p.add_argument("--modes", nargs="+", choices=list(MODE_FLOP_FACTOR), default=None,
                   help="default: fwd (--block-sparse, --window, --varlen, --score-mods: fwd fwdbwd)")
    p.add_argument("--block-sparse", action="store_true",
                   help="time block masks against dense flashcute and FlexAttention instead of the peers")
    p.add_argument("--densities", type=float, nargs="+", default=[0.05, 0.1, 0.25, 0.5],
                   help="--block-sparse: densities of the random masks")
    p.add_argument("--patterns", nargs="+", choices=["random", "sliding"], default=["random", "sliding"],
                   help="--block-sparse: random masks, and a causal sliding window on the causal points")
    p.add_argument("--window", type=int, nargs="*", default=None, metavar="W",
                   help="time sliding windows of W tokens against dense flashcute and FlexAttention (default "
                        "1024 4096 on CUDA, 64 256 on CPU); with --block-sparse: the sliding mask's width "
                        "(one W, default 1024)")
    p.add_argument("--varlen", action="store_true",
                   help="time attention_varlen on a packed batch against varlen_attn and padded cuDNN SDPA")
    p.add_argument("--num-seqs", type=int, default=None, help="--varlen: sequences (default 64; CPU 4)")
    p.add_argument("--lengths", type=int, nargs=2, default=None, metavar=("MIN", "MAX"),
                   help="--varlen: the uniform range of the lengths (default 64 4096; CPU 16 256)")
    p.add_argument("--seed", type=int, default=0, help="--varlen: the lengths' seed; --decode: the data's")
    p.add_argument("--score-mods", action="store_true",
                   help="time softcap, ALiBi and dropout against plain flashcute (overhead %%); dropout also "
                        "against SDPA-flash with the same dropout")
    p.add_argument("--softcap", type=float, default=30.0, help="--score-mods: the softcap")
    p.add_argument("--mods", nargs="+", choices=SCORE_MODS[1:], default=SCORE_MODS[1:],
                   help="--score-mods: which modifications (default all)")
    p.add_argument("--dropout-p", type=float, default=0.1, help="--score-mods: the dropout probability")
    p.add_argument("--decode", action="store_true",
                   help="time flashcute.attention_with_kvcache decoding (contiguous and paged caches) against "
                        "SDPA-flash and SDPA-cuDNN: GB/s of unique K/V bytes")
    p.add_argument("--decode-quick", action="store_true",
                   help="--decode on a reduced grid (b 1 8, cache 32k, h_k 32 8; CPU: smaller still)")
    p.add_argument("--batches", type=int, nargs="+", default=None, help="--decode: batch sizes (default 1 8 32)")
    p.add_argument("--caches", type=int, nargs="+", default=None,
                   help="--decode: cache lengths (keys attended to; default 8192 32768 131072; CPU 256 1024)")
    p.add_argument("--nheads", type=int, default=None, help="--decode: query heads (default 32; CPU 4)")
    p.add_argument("--kv-heads", type=int, nargs="+", default=None,
                   help="--decode: K/V heads (default 32 8 1; CPU 4 1)")
    p.add_argument("--layouts", nargs="+", default=None,
                   help="--decode: cache layouts, contig and pagedN (N a multiple of 16; default contig paged16 "
                        "paged128)")
    p.add_argument("--num-splits", type=int, default=0, help="--decode: flashcute's num_splits (0: its heuristic)")
    p.add_argument("--decode-timing", choices=["graph", "eager"], default="graph",
                   help="--decode: time CUDA-graph replays (default; no launch or host overhead, as decode loops "
                        "run) or eager calls (flashcute's wrapper checks cache_seqlens with one sync per call)")
    p.add_argument("--mem-fraction", type=float, default=0.6,
                   help="--decode: skip points whose K/V exceed this fraction of the GPU's memory")
    p.add_argument("--append-cache", type=int, default=None,
                   help="--decode: the cache length of the append rows (b=1, one new token; default 32768; 0: none)")
    p.add_argument("--chunk", type=int, default=None,
                   help="--decode: queries of the chunked-prefill rows (default 512; CPU 32; 0: none)")
    p.add_argument("--chunk-cache", type=int, default=None,
                   help="--decode: keys of the chunked-prefill rows (default 32768; CPU 1024)")
    p.add_argument("--chunk-kv-heads", type=int, nargs="+", default=None,
                   help="--decode: K/V heads of the chunked-prefill rows (default: nheads and nheads / 4)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--tokens", type=int, default=None,
                   help="batch * seqlen (default 16384; CPU 1024); --varlen: all the packed tokens (default "
                        "131072; CPU 512)")
    p.add_argument("--hidden", type=int, default=None, help="nheads * headdim (default 2048; CPU 256)")
    p.add_argument("--math-max-seqlen", type=int, default=2048)
    p.add_argument("--peers", nargs="+", choices=[*ALL_PEERS, "varlen_attn"], default=[*ALL_PEERS, "varlen_attn"],
                   help="GPU peers to time (the CPU peer is torch's CPU SDPA); --window times flex, --varlen "
                        "varlen_attn and sdpa_cudnn (padded)")
    p.add_argument("--no-peers", action="store_true")
    p.add_argument("--families", nargs="+", choices=["sm80", "sm90", "none"], default=None,
                   help="also time flashcute with each of these kernel families forced (default: every family "
                        "this build and GPU have, when more than one; none: no such columns)")
    p.add_argument("--kernels", choices=["auto", "sm80", "sm90"], default=None,
                   help="the process-wide kernel family (flashcute.kernels) of the \"flashcute\" rows; with "
                        "--families none a run times flashcute and its peers only, as a build from before the "
                        "families did (issue 11's before/after comparison)")
    p.add_argument("--cpu", action="store_true", help="time the CPU backend even when a GPU is there")
    p.add_argument("--rounds", type=int, default=1,
                   help="time every impl of a point this many times, in rotated orders, and report each one's "
                        "median (default 1)")
    p.add_argument("--out", type=Path, default=Path("bench_out"))
    args = p.parse_args(argv)
    global _ROUNDS
    _ROUNDS = max(1, args.rounds)
    chosen = [name for name, on in [("block_sparse", args.block_sparse),
                                    ("window", args.window is not None and not args.block_sparse),
                                    ("varlen", args.varlen), ("score_mods", args.score_mods),
                                    ("decode", args.decode or args.decode_quick)] if on]
    if len(chosen) > 1:
        p.error("--block-sparse, --window, --varlen, --score-mods and --decode exclude each other")
    if args.block_sparse and args.window is not None and len(args.window) != 1:
        p.error("with --block-sparse, --window takes one width")
    args.sweep = chosen[0] if chosen else "dense"
    on_gpu = torch.cuda.is_available() and not args.cpu
    if args.kernels is not None:
        try:
            flashcute.kernels(args.kernels)
        except (RuntimeError, ValueError) as exc:
            p.error(f"--kernels {args.kernels}: {exc}")
    try:
        _sweep_defaults(args, on_gpu)
    except ValueError as exc:
        p.error(str(exc))
    device, rows = SWEEPS[args.sweep](args)
    env = environment()
    table = format_table(rows)
    write_outputs(args.out, env, rows, table, argv if argv is not None else sys.argv[1:])
    print("\n".join(f"{k}: {v}" for k, v in env.items()))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
