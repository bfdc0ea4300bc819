"""GPU measurements of flashcute's integrations (issue 17).

1. ``llama``: training-step time of a 2-layer randomly initialised Llama (hidden 2048, 16 heads,
   seq 4096, bf16; no download) through ``flashcute.integrations.transformers``
   (``attn_implementation="cute_attention"``) against transformers' own ``"sdpa"`` (the backend
   torch picks by default: cuDNN on H100/H200 with torch 2.11, its FA2 on A100; the table names
   it), same weights, same batch. A step is forward + cross-entropy + backward + AdamW step;
   forward + backward alone is reported too. Also the torch-registry route (transformers'
   ``"sdpa"`` with ``activate_flash_attention_impl("FLASHCUTE")``, which also puts SDPA's flash
   backend first: flashcute's kernels, checked in the table's "sdpa backend" column).

       python scripts/bench_integrations.py llama [--batch 1 --seqlen 4096 --pairs 300]

2. ``ring``: ``flashcute.distributed.ring_attention`` on 2 GPUs (NCCL, zigzag load balance)
   against flashcute.attention on one GPU, causal, head dim 128, 128k tokens; throughput in
   tokens/s for forward and forward + backward, and the speedup. Run with torchrun:

       NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
           torchrun --nproc_per_node 2 scripts/bench_integrations.py ring [--seqlen 131072 --nheads 16]

   ``--torch-cp`` also times torch's own context_parallel over flashcute's kernels (the
   registry route).

3. ``gpt``: one GPT block (pre-LayerNorm, causal self-attention, 4x GELU MLP; b4, s4096, 16
   heads of 128, bf16, issue 16's figure), forward + backward through ``torch.compile``, with
   ``flashcute.attention`` against ``F.scaled_dot_product_attention`` (torch's default backend
   choice: cuDNN on H100/H200 with torch 2.11), same weights, same input.

       python scripts/bench_integrations.py gpt [--batch 4 --seqlen 4096 --nheads 16 --headdim 128]

4. ``host``: the host (CPU) time of one attention call, forward and forward + backward, without
   a sync (a tiny causal problem, so the GPU keeps up): ``flashcute.attention``, the HF
   integration's attention function, ``F.scaled_dot_product_attention`` and transformers' own
   sdpa attention function. In a CPU-bound training step every microsecond of it is GPU idle time.

       python scripts/bench_integrations.py host [--seqlen 256 --calls 300]

All print a table and write JSON (--out, default bench_integrations_<what>.json). The
"Done when" bars: llama speedup (the median over turns, the routes stepping in turn, of sdpa's step
time / flashcute's; printed with its 95% confidence interval) >= 1.0; ring speedup >= 1.7; gpt
speedup (the same median of sdpa fwd+bwd time / flashcute fwd+bwd time) >= 1.0.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import flashcute
from flashcute.bench import event_ms

for _var in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
    os.environ.setdefault(_var, "0" if _var == "NCCL_NVLS_ENABLE" else "1")


def _time_cuda(fn, warmup, iters):
    """Median milliseconds of fn() over iters runs (CUDA events), after warmup runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = [event_ms(fn) for _ in range(iters)]
    return statistics.median(times), times


def _paired_steps(steps, warmup, pairs):
    """Per-step milliseconds of each route's step (CUDA events, a sync after each), the routes taking
    turns step by step, `pairs` turns, the order rotated every turn. `steps`: (fn, context) per
    route; the context (e.g. the registry's activation) is entered outside the timed span.

    The steps of one turn run within milliseconds of each other, so the GPU's clock and power
    drift, which moves 20-step medians by 1-3% between rounds seconds apart (session 27), acts on
    them alike: the per-turn ratios are paired samples."""
    for fn, context in steps:
        with context():
            for _ in range(warmup):
                fn()
    torch.cuda.synchronize()
    times = [[] for _ in steps]
    for turn in range(pairs):
        for j in [(turn + i) % len(steps) for i in range(len(steps))]:
            fn, context = steps[j]
            with context():
                times[j].append(event_ms(fn))
    return times


def _speedup(base_ms, route_ms):
    """The median over turns of base / route, with its distribution-free 95% confidence interval
    (the order statistics n/2 -+ 1.96 sqrt(n)/2 of the sorted ratios) and the share of turns >= 1."""
    ratios = sorted(b / r for b, r in zip(base_ms, route_ms))
    n, half = len(ratios), 1.96 * math.sqrt(len(ratios)) / 2
    lo, hi = max(0, math.floor(n / 2 - half)), min(n - 1, math.ceil(n / 2 + half))
    return {"speedup": statistics.median(ratios), "ci95": (ratios[lo], ratios[hi]),
            "turns_ge_1": sum(x >= 1.0 for x in ratios) / n}


def _speedup_text(sp):
    return f"{sp['speedup']:7.3f}x [{sp['ci95'][0]:.3f}, {sp['ci95'][1]:.3f}] {100 * sp['turns_ge_1']:5.1f}%"


def _kernel_table(label, fn, steps=3, top=18):
    """Print the CUDA kernels of `steps` calls of fn() by total GPU time (torch.profiler), so two
    routes of one benchmark can be compared kernel by kernel (--profile). (flashcute's chained
    kernels, the backward's after its first, count from when their CTAs became resident: run with
    FLASHCUTE_CHAINED_LAUNCH=0 for their own times.)"""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events) / steps / 1e3
    print(f"\n{label}: GPU time per call {total:.3f} ms in {sum(e.count for e in events) // steps} kernels")
    print(f"{'ms/call':>8s} {'calls':>5s}  kernel")
    for e in events[:top]:
        print(f"{e.self_device_time_total / steps / 1e3:8.3f} {e.count // steps:5d}  {e.key[:110]}")


def _host_table(label, fn, steps=5, top=14):
    """Print the Python functions of `steps` calls of fn() by own host time (cProfile): where a
    CPU-bound step spends its launches, and which calls wait for the GPU (--profile)."""
    import cProfile
    import io
    import pstats

    fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    torch.cuda.synchronize()
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    print(f"\n{label}: host time per call {stats.total_tt / steps * 1e3:.3f} ms (cProfile), top functions by own time")
    stats.sort_stats("tottime").print_stats(top)
    lines = text.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    print("\n".join(line for line in lines[start:] if line.strip()))


def _env():
    return {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "flashcute": flashcute.__version__, "kernel_family_setting": flashcute.kernels.current(),
            "date": datetime.datetime.now().isoformat(timespec="seconds")}


# ---- 1. transformers Llama training step ---------------------------------------------------
class _LlamaRoute:
    """One way to run the model: its attn_implementation, optionally under the torch registry."""

    def __init__(self, label, impl, registry):
        self.label, self.impl, self.registry = label, impl, registry

    def build(self, transformers, config, state, ids):
        self.model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                                   attn_implementation=self.impl,
                                                                   dtype=torch.bfloat16)
        self.model.load_state_dict(state)
        self.model.to("cuda").train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=True)
        with self._registry():
            with torch.no_grad():
                self.first_loss = self._loss(ids).item()
            self.sdpa_backend = _sdpa_backend(config, ids) if self.impl == "sdpa" else "-"

    def _registry(self):
        import contextlib

        from flashcute.integrations import torch_registry

        @contextlib.contextmanager
        def active():
            torch_registry.activate()
            try:
                yield
            finally:
                torch_registry.deactivate()

        return active() if self.registry else contextlib.nullcontext()

    def _loss(self, ids):
        logits = self.model(ids).logits
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())

    def fwd_bwd(self, ids):
        self.model.zero_grad(set_to_none=True)
        self._loss(ids).backward()

    def step(self, ids):
        self.fwd_bwd(ids)  # (model.zero_grad: the optimiser's parameters are the model's)
        self.opt.step()


def _sdpa_backend(config, ids):
    """The backend SDPA picks now for the model's attention (causal, no mask, training), by name."""
    from torch.nn.attention import SDPBackend

    b, s = ids.shape
    h, h_kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or config.hidden_size // h
    q = torch.empty(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.empty(b, h_kv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    return SDPBackend(torch._fused_sdp_choice(q, kv, kv, is_causal=True, enable_gqa=h != h_kv)).name


def bench_llama(args):
    import transformers

    from flashcute.integrations import transformers as fct

    name = fct.register()
    config = transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                                      num_attention_heads=args.nheads,
                                      num_key_value_heads=args.nheads_kv or args.nheads,
                                      max_position_embeddings=args.seqlen, use_cache=False)
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa",
                                                         dtype=torch.bfloat16)
    state = base.state_dict()
    del base
    ids = torch.randint(0, args.vocab, (args.batch, args.seqlen), device="cuda")

    routes = [_LlamaRoute("sdpa", "sdpa", False), _LlamaRoute("flashcute", name, False)]
    if not args.no_registry:
        routes.append(_LlamaRoute("sdpa+FLASHCUTE registry", "sdpa", True))
    for route in routes:
        route.build(transformers, config, state, ids)
    # The routes take turns step by step (`_paired_steps`); speedup: the median over turns of
    # sdpa's step time / the route's, with its 95% confidence interval. Forward + backward alone is
    # timed the same way, after the steps.
    step_ms = _paired_steps([(lambda r=r: r.step(ids), r._registry) for r in routes], args.warmup, args.pairs)
    fwd_bwd_ms = _paired_steps([(lambda r=r: r.fwd_bwd(ids), r._registry) for r in routes], args.warmup,
                               args.pairs)
    tokens = args.batch * args.seqlen
    rows = [{"route": r.label, "attn_implementation": r.impl, "sdpa_backend": r.sdpa_backend,
             "initial_loss": r.first_loss, "step_ms": statistics.median(st), "fwd_bwd_ms": statistics.median(fb),
             "tokens_per_s": tokens / (statistics.median(st) / 1e3),
             "step": _speedup(step_ms[0], st), "fwd_bwd": _speedup(fwd_bwd_ms[0], fb)}
            for r, st, fb in zip(routes, step_ms, fwd_bwd_ms)]
    if args.profile:
        for r in routes:
            with r._registry():
                _kernel_table(f"llama fwd+bwd, {r.label}", lambda r=r: r.fwd_bwd(ids))
                _host_table(f"llama fwd+bwd, {r.label}", lambda r=r: r.fwd_bwd(ids))

    print(f"\n{args.layers}-layer random Llama (hidden {args.hidden}, {args.nheads} heads, kv heads "
          f"{args.nheads_kv or args.nheads}, seq {args.seqlen}, batch {args.batch}, bf16) on "
          f"{torch.cuda.get_device_name()}: {args.pairs} turns of one step per route; ms: medians; "
          f"speedup vs sdpa: median of the turns' ratios [95% CI] share of turns >= 1")
    print(f"{'route':24s} {'sdpa backend':>16s} {'loss0':>8s} {'fwd+bwd ms':>10s} {'step ms':>8s} "
          f"{'tokens/s':>9s} {'step speedup':>31s} {'fwd+bwd speedup':>31s}")
    for r in rows:
        r["speedup_vs_sdpa"] = r["step"]["speedup"]
        print(f"{r['route']:24s} {r['sdpa_backend']:>16s} {r['initial_loss']:8.4f} {r['fwd_bwd_ms']:10.2f} "
              f"{r['step_ms']:8.2f} {r['tokens_per_s']:9.0f} {_speedup_text(r['step']):>31s} "
              f"{_speedup_text(r['fwd_bwd']):>31s}")
    registry_rows = [r for r in rows if "registry" in r["route"]]
    if registry_rows and registry_rows[0]["sdpa_backend"] != "FLASH_ATTENTION":
        print(f"WARNING: the registry route ran SDPA's {registry_rows[0]['sdpa_backend']} backend, not flashcute")
    ok = rows[1]["speedup_vs_sdpa"] >= 1.0
    print(f"flashcute integration {'>=' if ok else '<'} sdpa speed: {'PASS' if ok else 'FAIL'} "
          f"({_speedup_text(rows[1]['step']).strip()}, bar 1.0x)")
    return {"what": "llama", "env": _env(), "args": vars(args), "rows": rows, "pass": ok}


# ---- 3. compiled GPT block ------------------------------------------------------------------
class _GPTBlock(torch.nn.Module):
    """x + attn(ln1(x)), then + mlp(ln2(.)); attention causal, through `attend` on (b, s, h, d)."""

    def __init__(self, hidden, nheads, attend):
        super().__init__()
        self.nheads, self.attend = nheads, attend
        self.ln1, self.ln2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        b, s, hidden = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.nheads, hidden // self.nheads).unbind(2)
        x = x + self.proj(self.attend(q, k, v).reshape(b, s, hidden))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def _sdpa_attend(q, k, v):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          is_causal=True).transpose(1, 2)


def _flashcute_attend(q, k, v):
    return flashcute.attention(q, k, v, causal=True)


def bench_gpt(args):
    hidden = args.nheads * args.headdim
    torch.manual_seed(0)
    ref = _GPTBlock(hidden, args.nheads, _sdpa_attend).to("cuda", torch.bfloat16)
    x = torch.randn(args.batch, args.seqlen, hidden, device="cuda", dtype=torch.bfloat16)
    grad = torch.randn_like(x)
    routes = {}
    for label, attend in [("sdpa", _sdpa_attend), ("flashcute", _flashcute_attend)]:
        block = copy.deepcopy(ref)
        block.attend = attend
        compiled = torch.compile(block)
        xr = x.detach().requires_grad_(True)

        def fwd_bwd(compiled=compiled, block=block, xr=xr):
            torch.autograd.grad(compiled(xr), (xr, *block.parameters()), grad)

        out = compiled(xr)  # compile, and the outputs of the two routes compared once
        routes[label] = {"fn": fwd_bwd, "out": out.detach().float()}
    # both routes compute the same block: a wrong kernel would show here, not only in the tests
    a, b = routes["sdpa"]["out"], routes["flashcute"]["out"]
    rel = float((a - b).norm() / a.norm())
    # the routes take turns step by step, as in the Llama step
    ms = _paired_steps([(r["fn"], contextlib.nullcontext) for r in routes.values()], args.warmup, args.pairs)
    rows = [{"route": label, "fwd_bwd_ms": statistics.median(t), **_speedup(ms[0], t)}
            for label, t in zip(routes, ms)]
    if args.profile:
        for label, r in routes.items():
            _kernel_table(f"gpt block, {label}", r["fn"])
    print(f"\ncompiled GPT block (b{args.batch}, s{args.seqlen}, {args.nheads} heads of {args.headdim}, bf16, "
          f"causal) on {torch.cuda.get_device_name()}: {args.pairs} turns of one fwd+bwd per route; outputs "
          f"differ by {rel:.2e} (relative); speedup vs sdpa: median of the turns' ratios [95% CI] share of "
          f"turns >= 1")
    print(f"{'route':12s} {'fwd+bwd ms':>11s} {'speedup':>31s}")
    for r in rows:
        r["speedup_vs_sdpa"] = r["speedup"]
        print(f"{r['route']:12s} {r['fwd_bwd_ms']:11.3f} {_speedup_text(r):>31s}")
    ok = rows[1]["speedup_vs_sdpa"] >= 1.0 and rel < 2e-2
    print(f"compiled GPT block with flashcute {'>=' if ok else '<'} sdpa speed: {'PASS' if ok else 'FAIL'} "
          f"({_speedup_text(rows[1]).strip()}, bar 1.0x)")
    return {"what": "gpt", "env": _env(), "args": vars(args), "rows": rows, "output_rel_diff": rel, "pass": ok}


# ---- 4. host time per call ------------------------------------------------------------------
def bench_host(args):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from flashcute.integrations import transformers as fct

    fct.register()

    class Module(torch.nn.Module):  # what transformers' attention functions read of the layer
        is_causal = True
        config = None
        num_key_value_groups = 1

    module = Module().train()
    shape = (args.batch, args.nheads, args.seqlen, args.headdim)  # (b, h, s, d), transformers' layout
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(args.batch, args.seqlen, args.nheads, args.headdim, device="cuda", dtype=torch.bfloat16)

    def host_us(fn):
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.calls):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        return (t1 - t0) / args.calls * 1e6

    routes = {
        "flashcute.attention": lambda: flashcute.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                           causal=True),
        "HF integration": lambda: fct.attention_forward(module, q, k, v, None, dropout=0.0, scaling=None)[0],
        "F.sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2),
        "HF sdpa_attention_forward": lambda: sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=None,
                                                                    is_causal=True)[0],
    }
    times = {label: {"fwd_us": [], "fwd_bwd_us": []} for label in routes}
    labels = list(routes)
    for r in range(args.rounds):  # rotated orders: the host's drift falls on every route alike
        for label in labels[r % len(labels):] + labels[:r % len(labels)]:
            fn = routes[label]
            times[label]["fwd_us"].append(host_us(fn))
            times[label]["fwd_bwd_us"].append(host_us(lambda fn=fn: torch.autograd.grad(fn(), (q, k, v), grad)))
    print(f"\nhost time per attention call (b{args.batch}, s{args.seqlen}, {args.nheads} heads of {args.headdim}, "
          f"bf16, causal) on {torch.cuda.get_device_name()}: {args.calls} calls without a sync; median of "
          f"{args.rounds} rounds (min..max)")
    print(f"{'route':28s} {'fwd us':>20s} {'fwd+bwd us':>22s}")
    rows = []
    for label, t in times.items():
        row = {"route": label, **{k: statistics.median(v) for k, v in t.items()}, "rounds": t}
        rows.append(row)
        print(f"{label:28s} {row['fwd_us']:7.1f} ({min(t['fwd_us']):5.1f}..{max(t['fwd_us']):5.1f}) "
              f"{row['fwd_bwd_us']:8.1f} ({min(t['fwd_bwd_us']):5.1f}..{max(t['fwd_bwd_us']):5.1f})")
    return {"what": "host", "env": _env(), "args": vars(args), "rows": rows}


# ---- 2. ring attention on 2 GPUs ------------------------------------------------------------
def bench_ring(args):
    import torch.distributed as dist

    import flashcute.distributed as fcd

    if "RANK" not in os.environ:
        sys.exit("bench_integrations.py ring: run it under torchrun --nproc_per_node 2 (see the docstring)")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    b, s, h, d = args.batch, args.seqlen, args.nheads, args.headdim
    h_kv = args.nheads_kv or h
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = torch.bfloat16

    def make(n_heads, length):
        return torch.randn(b, length, n_heads, d, device="cuda", dtype=dtype, generator=gen)

    results = {}
    # one GPU: the whole sequence on rank 0 while the others wait
    if rank == 0:
        q, k, v = make(h, s), make(h_kv, s), make(h_kv, s)
        dout = torch.randn_like(q)
        qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
        fwd_ms, _ = _time_cuda(lambda: flashcute.attention(q, k, v, causal=True), args.warmup, args.iters)

        def fb():
            out = flashcute.attention(qg, kg, vg, causal=True)
            torch.autograd.grad(out, (qg, kg, vg), dout)

        fb_ms, _ = _time_cuda(fb, args.warmup, args.iters)
        results["1gpu"] = {"fwd_ms": fwd_ms, "fwd_bwd_ms": fb_ms}
        del q, k, v, dout, qg, kg, vg
        torch.cuda.empty_cache()
    dist.barrier()

    # P GPUs: each holds s / P tokens (zigzag chunks)
    local = s // world
    q, k, v = make(h, local), make(h_kv, local), make(h_kv, local)
    dout = torch.randn_like(q)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))

    def ring_fwd():
        fcd.ring_attention(q, k, v, causal=True)

    def ring_fb():
        out = fcd.ring_attention(qg, kg, vg, causal=True)
        torch.autograd.grad(out, (qg, kg, vg), dout)

    def timed(fn):
        dist.barrier()
        ms, all_ms = _time_cuda(fn, args.warmup, args.iters)
        worst = torch.tensor([ms], device="cuda")
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank does
        return worst.item()

    results[f"{world}gpu_ring"] = {"fwd_ms": timed(ring_fwd), "fwd_bwd_ms": timed(ring_fb)}

    if args.torch_cp:
        results[f"{world}gpu_torch_cp"] = _bench_torch_cp(args, world, rank, h, h_kv, d, dtype, timed)

    if rank == 0:
        tokens = b * s
        one = results["1gpu"]
        print(f"\nring attention, causal, {tokens} tokens (batch {b} x {s}), {h} heads (kv {h_kv}), d{d}, bf16, "
              f"on {world} x {torch.cuda.get_device_name()}; median of {args.iters}")
        print(f"{'setup':22s} {'fwd ms':>9s} {'fwd Mtok/s':>11s} {'speedup':>8s} {'fwd+bwd ms':>11s} "
              f"{'f+b Mtok/s':>11s} {'speedup':>8s}")
        for label, r in results.items():
            r["fwd_tokens_per_s"] = tokens / (r["fwd_ms"] / 1e3)
            r["fwd_bwd_tokens_per_s"] = tokens / (r["fwd_bwd_ms"] / 1e3)
            r["fwd_speedup"] = one["fwd_ms"] / r["fwd_ms"]
            r["fwd_bwd_speedup"] = one["fwd_bwd_ms"] / r["fwd_bwd_ms"]
            print(f"{label:22s} {r['fwd_ms']:9.2f} {r['fwd_tokens_per_s'] / 1e6:11.3f} {r['fwd_speedup']:7.3f}x "
                  f"{r['fwd_bwd_ms']:11.2f} {r['fwd_bwd_tokens_per_s'] / 1e6:11.3f} {r['fwd_bwd_speedup']:7.3f}x")
        ring = results[f"{world}gpu_ring"]
        ok = ring["fwd_speedup"] >= 1.7 and ring["fwd_bwd_speedup"] >= 1.7
        print(f"ring on {world} GPUs >= 1.7x one GPU (fwd and fwd+bwd): {'PASS' if ok else 'FAIL'}")
        report = {"what": "ring", "env": _env(), "world_size": world, "args": vars(args), "results": results,
                  "pass": ok}
    else:
        report = None
    dist.barrier()
    dist.destroy_process_group()
    return report


def _bench_torch_cp(args, world, rank, h, h_kv, d, dtype, timed):
    """torch's context_parallel (its load-balanced ring) over flashcute's aten overrides."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from flashcute.integrations import torch_registry

    mesh = init_device_mesh("cuda", (world,))
    b, s = args.batch, args.seqlen
    q, k, v, dout = (torch.randn(b, n, s, d, device="cuda", dtype=dtype) for n in (h, h_kv, h_kv, h))
    torch_registry.activate()  # puts SDPA's flash backend first; sdpa_kernel makes any other choice an error
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION), context_parallel(
                mesh, buffers=[q, k, v, dout], buffer_seq_dims=[2, 2, 2, 2], no_restore_buffers={q, k, v, dout}):
            def fwd():
                F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=h != h_kv)

            qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (q, k, v))

            def fb():
                out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, enable_gqa=h != h_kv)
                torch.autograd.grad(out, (qg, kg, vg), dout)

            return {"fwd_ms": timed(fwd), "fwd_bwd_ms": timed(fb)}
    except Exception as e:  # noqa: BLE001 (reported, not fatal: the ring numbers stand alone)
        if rank == 0:
            print(f"torch context_parallel over FLASHCUTE failed: {type(e).__name__}: {e}")
        return {"fwd_ms": float("nan"), "fwd_bwd_ms": float("nan"), "error": f"{type(e).__name__}: {e}"}
    finally:
        torch_registry.deactivate()


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    p = sub.add_parser("llama", help="transformers Llama training step: flashcute vs sdpa")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--nheads-kv", type=int, default=None)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--pairs", type=int, default=300,
                   help="turns of one step per route (speedup: median of the turns' ratios)")
    p.add_argument("--no-registry", action="store_true", help="skip the sdpa + FLASHCUTE registry route")
    p.add_argument("--profile", action="store_true",
                   help="also print each route's CUDA kernels by GPU time and Python functions by host time")
    p.add_argument("--out", default="bench_integrations_llama.json")
    p = sub.add_parser("gpt", help="compiled GPT block fwd+bwd: flashcute vs F.scaled_dot_product_attention")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--pairs", type=int, default=300,
                   help="turns of one fwd+bwd per route (speedup: median of the turns' ratios)")
    p.add_argument("--profile", action="store_true", help="also print each route's CUDA kernels by GPU time")
    p.add_argument("--out", default="bench_integrations_gpt.json")
    p = sub.add_parser("host", help="host (CPU) time of one attention call, fwd and fwd+bwd")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqlen", type=int, default=256)
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--rounds", type=int, default=5, help="rounds, each route once per round in a rotated order")
    p.add_argument("--out", default="bench_integrations_host.json")
    p = sub.add_parser("ring", help="ring attention on torchrun's GPUs vs one GPU")
    p.add_argument("--seqlen", type=int, default=131072, help="total tokens of the sequence")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--nheads-kv", type=int, default=None)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--torch-cp", action="store_true", help="also time torch's context_parallel over FLASHCUTE")
    p.add_argument("--out", default="bench_integrations_ring.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("bench_integrations.py needs CUDA GPUs")
    report = {"llama": bench_llama, "ring": bench_ring, "gpt": bench_gpt, "host": bench_host}[args.what](args)
    if report is not None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
