"""The CUDA kernels of torch.ops.flashcute.attention (marker `gpu`; skipped without a GPU),
and the properties they share with the CPU backend, on both devices.

Run on an sm80+ GPU (scripts/gpu_check.sh runs them on an H100/H200). The references are
computed on the GPU: ref32 in float32 (TF32 off), pt in the inputs' dtype.

- forward: out under the SPEC criterion and lse within 1e-3, over seqlen pairs from
  {1, 7, 64, 113, 128, 255, 1023, 2048, 4096}, every head dim (32..256 and the padded
  72, 40, 8), float16 / bfloat16, causal on/off, GQA 1/4/8, BHSD and padded views;
  outputs fully written (the allocator is poisoned with NaN before each call);
- backward: dq, dk, dv under the criterion on a subset;
- on the CPU and on CUDA (``on_devices``; the CUDA cases under each kernel family): custom
  scales, mixed layouts, empty inputs, the gradient through lse with GQA, the bitwise
  reproducible backward of deterministic=True;
- torch.compile(fullgraph=True) of a transformer block on CUDA, matching eager.

A build restricted with FLASHCUTE_HEADDIMS / FLASHCUTE_DTYPES skips the head dims and dtypes
it has no kernel for.
"""
from __future__ import annotations

import copy
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flashcute
from conftest import (LAYOUTS, check_attention, check_lse, check_precision, gpu, make_qkv,
                      or_skip, randn, reference_grads, reference_outputs, run_attention)

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
CPU_DTYPES = [torch.float32, *DTYPES]  # for the CPU cases of on_devices
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
HDIMS = [32, 64, 96, 128, 192, 256, 72, 40, 8]
GQA = [(4, 4), (8, 2), (8, 1)]  # (nheads, nheads_kv): ratios 1, 4, 8


# Every CUDA test runs under each kernel family of the build (the forward differs; the
# backward then consumes that family's out and lse). The params carry the marker gpu, and so
# does every test here but the CPU cases of on_devices (which parametrise `family` themselves).
FAMILIES = flashcute.kernels.available() or ["auto"]


@pytest.fixture(autouse=True, params=[pytest.param(f, marks=gpu.marks) for f in FAMILIES])
def family(request):
    if request.param in (None, "auto") or not torch.cuda.is_available():
        yield request.param
        return
    if request.param not in flashcute.kernels.runnable():
        pytest.skip(f"this build's {request.param} family does not run on this GPU "
                    f"(it runs {flashcute.kernels.runnable()})")
    with flashcute.kernels(request.param):
        yield request.param


def on_devices(argnames, cpu, cuda, ids):
    """Parametrises a test of a property both backends share over ("device", "family",
    *argnames): each case of ``cpu`` once on the CPU (family None), each case of ``cuda`` on
    CUDA under every kernel family (marker gpu). A case holds the argnames' values (a tuple;
    the value itself for one name); ``ids(*case)`` names it after "cpu-" or "cuda-<family>-"."""
    names = argnames.split(",")
    cpu, cuda = ([c if len(names) > 1 else (c,) for c in cases] for cases in (cpu, cuda))
    params = [pytest.param("cpu", None, *c, id=f"cpu-{ids(*c)}") for c in cpu]
    params += [pytest.param("cuda", f, *c, id=f"cuda-{f}-{ids(*c)}", marks=gpu.marks)
               for f in FAMILIES for c in cuda]
    return pytest.mark.parametrize(["device", "family", *names], params, indirect=["family"])


def test_family_runs_its_kernels(family):
    """The forced family's forward and backward kernels are the ones that run (profiler kernel
    names; both families have both directions at d 64)."""
    q, k, v = (x.requires_grad_() for x in _qkv(1, 300, 300, 4, 4, 64, torch.bfloat16))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        out = or_skip(lambda: flashcute.attention(q, k, v, causal=True))
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    for kernel in ("flashcute_fwd_kernel", "flashcute_bwd_kernel"):
        names = [e.name for e in prof.events() if kernel in e.name]
        assert names, f"no {kernel} in the trace"
        if family in ("sm80", "sm90"):
            assert all(family + "::" in n for n in names), names


def test_chained_launches_overlap(family):
    """On sm90 GPUs the kernels that wait for another of ours are launched chained (programmatic
    dependent launch, common/utils.h): the backward's dQ conversion and the KV cache's combine
    become resident (and wait) before the kernel whose results they read has ended, so their
    profiler spans start before its span ends. (Shapes that leave SMs free for them, a decode long
    enough that the host launches the combine before the attention ends, warmed up.)"""
    if torch.cuda.get_device_capability() < (9, 0) or os.environ.get("FLASHCUTE_CHAINED_LAUNCH") == "0":
        pytest.skip("chained launches need an sm90 GPU and FLASHCUTE_CHAINED_LAUNCH unset")
    q, k, v = (x.requires_grad_() for x in _qkv(1, 2048, 2048, 2, 2, 64, torch.bfloat16))
    qd = randn((1, 1, 8, 64), dtype=torch.bfloat16, device="cuda")
    kc, vc = (randn((1, 65536, 8, 64), dtype=torch.bfloat16, device="cuda") for _ in range(2))

    def calls():
        out = or_skip(lambda: flashcute.attention(q, k, v))
        out.backward(torch.ones_like(out))
        with flashcute.kernels("auto"):  # (a forced sm90 family would decode on its forward)
            # 128 CTAs of the sm80 KV-cache kernel (more splits than the sm90 decoding kernel's
            # clusters hold, dispatch.cu), then its combine
            flashcute.attention_with_kvcache(qd, kc, vc, num_splits=16)
        torch.cuda.synchronize()

    calls()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        calls()
    spans = {}
    for e in (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA):
        for key in ("flashcute_bwd_kernel", "flashcute_bwd_convert_dq_kernel", "KvCacheTileScheduler",
                    "flashcute_kvcache_combine_kernel"):
            if key in e.name:
                spans.setdefault(key, []).append((e.time_range.start, e.time_range.end))
    assert all(len(spans.get(key, ())) == 1 for key in spans) and len(spans) == 4, spans
    for first, then in (("flashcute_bwd_kernel", "flashcute_bwd_convert_dq_kernel"),
                        ("KvCacheTileScheduler", "flashcute_kvcache_combine_kernel")):
        assert spans[then][0][0] < spans[first][0][1], (first, then, spans)




def _poison(q):
    """On CUDA: fills freed allocator blocks of out's and lse's sizes with NaN, so that an
    output element the kernel forgets to write shows up as NaN instead of a stale value."""
    if not q.is_cuda:
        return
    b, sq, h, d = q.shape
    bufs = [torch.full((b, sq, h, d), float("nan"), dtype=q.dtype, device=q.device),
            torch.full((b, h, sq), float("nan"), dtype=torch.float32, device=q.device)]
    del bufs


def run(q, k, v, dout=None, dlse=None, **kw):
    """conftest's run_attention, the allocator poisoned first."""
    _poison(q)
    return run_attention(q, k, v, dout, dlse, **kw)


def check(q, k, v, dout=None, dlse=None, **kw):
    """conftest's check_attention, the allocator poisoned first."""
    _poison(q)
    return check_attention(q, k, v, dout, dlse, **kw)


def _dout(q):
    return randn(q.shape, dtype=q.dtype, device=q.device)


def _qkv(b, sq, sk, h, hkv, d, dtype, layout="bshd"):
    return make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, device="cuda", layout=layout)


def _batch(sq, sk):
    return 2 if max(sq, sk) <= 1023 else 1


# ---- forward ------------------------------------------------------------------------------
# Seqlen pairs (Sq != Sk in most); each pair gets a head dim, a layout and a GQA ratio in
# turn, and runs for both dtypes and causal on/off.
FWD_PAIRS = [
    (1, 1), (1, 7), (7, 1), (7, 7), (1, 4096), (7, 2048), (64, 64), (64, 128), (128, 64),
    (113, 113), (113, 255), (255, 113), (128, 128), (64, 1023), (255, 1023), (1023, 255),
    (1023, 1023), (128, 2048), (2048, 128), (2048, 2048), (4096, 4096), (2048, 4096),
    (4096, 1), (4096, 255),
]
FWD_CASES = [(sq, sk, HDIMS[i % len(HDIMS)], LAYOUTS[i % len(LAYOUTS)], GQA[i % len(GQA)])
             for i, (sq, sk) in enumerate(FWD_PAIRS)]


def _fwd_id(c):
    sq, sk, d, layout, (h, hkv) = c
    return f"sq{sq}-sk{sk}-d{d}-{layout}-h{h}:{hkv}"


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", FWD_CASES, ids=_fwd_id)
def test_forward_seqlens(case, dtype, causal):
    sq, sk, d, layout, (h, hkv) = case
    q, k, v = _qkv(_batch(sq, sk), sq, sk, h, hkv, d, dtype, layout)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("shape", [(113, 255, False), (255, 113, True), (128, 128, True),
                                   (1, 1023, False)],
                         ids=lambda s: f"sq{s[0]}-sk{s[1]}-{'causal' if s[2] else 'full'}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", HDIMS, ids=lambda d: f"d{d}")
def test_forward_headdims(d, dtype, shape):
    sq, sk, causal = shape
    q, k, v = _qkv(2, sq, sk, 4, 2, d, dtype)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("step", [7.0, 4.5, -7.0], ids=["jumps", "just-below-2^8", "falls"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
def test_forward_moving_row_max(d, dtype, causal, step):
    """Scores that rise by `step` (softmax units) from one 128-key tile to the next, so that each
    row's running max moves at every tile edge by more than 8 in log2 units (O and l rescaled at
    every step, by factors below 2^-8), by 5 to 8 (just below FlashAttention-4's stale-max
    threshold of 8, which a kernel keeping a stale max would cross every second tile), or not at
    all (the first tile's max kept). Random inputs almost never move the max after the first tile."""
    sq = sk = 1024
    q, k, v = _qkv(2, sq, sk, 4, 4, d, torch.float32)
    u = torch.full((d,), d ** -0.5, device="cuda")  # a unit vector
    rise = step * (torch.arange(sk, device="cuda") // 128).float()  # per key
    q = (0.3 * q + d ** 0.5 * u).to(dtype)  # q.k / sqrt(d) ~ rise + N(0, ~0.4)
    k = (0.3 * k + rise[None, :, None, None] * u).to(dtype)
    v = v.to(dtype)
    # The premise: the running max of each row moves by the intended amount at the tile edges.
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * d ** -0.5 * math.log2(math.e)
    tile_max = s[:, :, -1].unflatten(-1, (sk // 128, 128)).amax(-1)  # the last row sees every key
    jumps = tile_max.cummax(-1).values.diff(dim=-1)
    if step > 0:
        assert (jumps > 8 if step > 5 else (jumps > 5) & (jumps < 8)).float().mean() > 0.9, jumps
    else:
        assert (jumps == 0).all()
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("b,sq,sk", [(8, 512, 512), (8, 1000, 1000), (8, 1050, 1050), (2, 1000, 4500),
                                     (2, 1050, 4500)],
                         ids=["s512", "s1000", "s1050", "s1000-k4500", "s1050-k4500"])
@pytest.mark.parametrize("d", [64, 128], ids=lambda d: f"d{d}")
def test_forward_rows_past_sequence(d, b, sq, sk, causal):
    """Last query tiles with whole warpgroups of rows past the sequence: the sm90 forward's d64
    192-row tiles (dense calls; causal ones over 4096 keys) leave one (512 = 2 x 192 + 128, 1050)
    or two (1000 = 5 x 192 + 40) of three, d128's 128-row tiles one of two at 1050. With 8 x 16
    heads and at most 4096 keys, dense calls have more query tiles than the H100/H200 has SMs (the
    persistent walk); over 4500 keys one CTA per tile. (Session 45 measured those warpgroups
    skipping their work: not kept, docs/NOTES.md.)"""
    q, k, v = _qkv(b, sq, sk, 16, 4, d, torch.bfloat16)
    check(q, k, v, causal=causal)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gqa", GQA, ids=lambda g: f"h{g[0]}:{g[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_gqa_layouts(dtype, gqa, layout):
    """Every layout, misaligned views included (the op copies those), per GQA ratio."""
    h, hkv = gqa
    q, k, v = _qkv(2, 255, 1023, h, hkv, 128, dtype, layout)
    check(q, k, v, causal=True)


def test_forward_packed_qkv_views():
    """q, k, v as views into one packed qkv projection (rows of (h + 2 h_kv) * d elements)."""
    b, s, h, hkv, d = 2, 333, 8, 2, 64
    qkv = torch.randn(b, s, (h + 2 * hkv) * d, device="cuda", dtype=torch.float16)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, s, h, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)
    check(q, k, v, causal=True)


@pytest.mark.parametrize("b,h,hkv", [(65535, 1, 1), (1, 65535, 1), (300, 300, 100), (66000, 1, 1), (1, 66000, 1),
                                     (1, 66000, 66000)],
                         ids=["batch65535", "heads65535", "b300-h300", "batch66000", "heads66000", "kvheads66000"])
def test_large_grid(b, h, hkv):
    """Batch and head counts up to and past a CUDA grid's y and z extents (65535): the kernels whose
    grid is (query block, batch, head) (common/scheduler.h: the sm80 forward's plain kernels, the dQ
    conversion) take a 1-D grid past them; the others have 1-D grids. Forward and backward."""
    q, k, v = _qkv(b, 3, 70, h, hkv, 32, torch.bfloat16)
    check(q, k, v, _dout(q), causal=True)


def test_forward_side_stream():
    """The kernel runs on the current stream: inputs made on a side stream are seen."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q, k, v = _qkv(2, 1023, 1023, 8, 2, 128, torch.bfloat16)
        out, lse = or_skip(lambda: torch.ops.flashcute.attention(q, k, v, True, None, False))
        ref = reference_outputs(q, k, v, causal=True)
    s.synchronize()
    check_precision("out", out, ref[0], ref[2])
    check_lse(lse, ref[1])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_forward_second_device():
    q, k, v = make_qkv(1, 200, 300, 4, 2, 64, dtype=torch.float16, device="cuda:1")
    out, _ = check(q, k, v, causal=True)
    assert out.device == torch.device("cuda:1")


def test_forward_repeatable():
    """The forward is bitwise the same run to run."""
    q, k, v = _qkv(2, 1023, 2048, 8, 2, 128, torch.bfloat16)
    a = run(q, k, v, causal=True)
    b = run(q, k, v, causal=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- backward ---------------------------------------------------------------------------
BWD_PAIRS = [(1, 1), (7, 113), (113, 7), (64, 128), (128, 128), (255, 1023), (1023, 255),
             (1023, 1023), (2048, 2048), (1, 2048)]
BWD_CASES = [(sq, sk, HDIMS[(3 * i) % len(HDIMS)], LAYOUTS[i % len(LAYOUTS)], GQA[i % len(GQA)])
             for i, (sq, sk) in enumerate(BWD_PAIRS)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", BWD_CASES, ids=_fwd_id)
def test_backward_seqlens(case, dtype, causal):
    sq, sk, d, layout, (h, hkv) = case
    q, k, v = _qkv(_batch(sq, sk), sq, sk, h, hkv, d, dtype, layout)
    check(q, k, v, _dout(q), causal=causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", HDIMS, ids=lambda d: f"d{d}")
def test_backward_headdims(d, dtype):
    q, k, v = _qkv(2, 113, 255, 4, 2, d, dtype)
    check(q, k, v, _dout(q), causal=True)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
def test_backward_extra_memory(deterministic):
    """The backward allocates dq, dk, dv and its workspace (the fp32 dQ accumulator, per dQ split
    in deterministic mode, and D and L per query row), nothing of size seqlen^2."""
    b, s, h, d = 1, 4096, 2, 64
    q, k, v = (randn((b, s, h, d), dtype=torch.bfloat16, device="cuda") for _ in range(3))
    out, lse = torch.ops.flashcute.attention(q, k, v, True, None, deterministic)
    dout = randn((b, s, h, d), dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.ops.flashcute.attention_backward(dout, q, k, v, out, lse, None, True, d ** -0.5, deterministic)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    rows = b * h * (-(-s // 128) * 128)
    splits = 16 if deterministic else 1  # the workspace's most dQ splits (common/bwd_pre_post.h)
    workspace = 4 * rows * (2 + splits * d)
    grads_bytes = sum(g.numel() * g.element_size() for g in grads)
    assert extra <= grads_bytes + workspace + (1 << 20), (extra, grads_bytes, workspace)
    if not deterministic:  # 3 MB of gradients, 2 MB of workspace: far below one fp32 S (134 MB)
        assert extra < b * h * s * s * 4 // 16


# ---- on both devices --------------------------------------------------------------------
# Properties the CPU backend shares: small sizes there (float32 too), larger ones on CUDA.
def _causal_id(causal):
    return "causal" if causal else "full"


@on_devices("dtype,scale,causal,backward",
            cpu=[(dt, s, True, True) for dt in (torch.float32, torch.bfloat16) for s in (0.05, 1.0, 2.5)],
            cuda=[(torch.bfloat16, s, True, False) for s in (0.05, 0.5, 2.0)]
            + [(torch.float16, 0.3, False, True)],
            ids=lambda dt, s, causal, bwd: f"{DTYPE_NAMES[dt]}-scale{s}-{_causal_id(causal)}"
                                           + ("-bwd" if bwd else ""))
def test_custom_scale(device, dtype, scale, causal, backward):
    b, sq, sk, h, hkv = (1, 37, 50, 4, 2) if device == "cpu" else (1, 200, 300, 4, 1)
    q, k, v = make_qkv(b, sq, sk, h, hkv, 64, dtype=dtype, device=device)
    check(q, k, v, _dout(q) if backward else None, causal=causal, scale=scale)


@on_devices("dtype,backward", cpu=[(torch.bfloat16, True)],
            cuda=[(torch.float16, False), (torch.bfloat16, False)],
            ids=lambda dt, bwd: DTYPE_NAMES[dt] + ("-bwd" if bwd else ""))
def test_mixed_layouts(device, dtype, backward):
    """q, k, v in three different layouts; the upstream gradient a transposed view."""
    b, sq, sk, h, hkv = (2, 50, 70, 4, 2) if device == "cpu" else (2, 300, 511, 8, 2)
    q = randn((b, sq, h, 64), dtype=dtype, device=device, layout="bhsd")
    k = randn((b, sk, hkv, 64), dtype=dtype, device=device, layout="padded")
    v = randn((b, sk, hkv, 64), dtype=dtype, device=device, layout="bshd")
    dout = None
    if backward:
        dout = randn((b, sq, h, 64), dtype=dtype, device=device, layout="bhsd")
        assert not dout.is_contiguous()
    check(q, k, v, dout, causal=True)


@on_devices("dtype", cpu=[torch.bfloat16], cuda=[torch.float16, torch.bfloat16], ids=lambda dt: DTYPE_NAMES[dt])
def test_expanded_views(device, dtype):
    """k and v expand()ed over heads and q over the batch (zero strides), forward and backward:
    the CUDA op copies them (the sm90 family's TMA copies need positive strides)."""
    b, sq, sk, h = (2, 37, 50, 4) if device == "cpu" else (2, 300, 511, 8)
    q = randn((1, sq, h, 64), dtype=dtype, device=device).expand(b, sq, h, 64)
    k = randn((b, sk, 1, 64), dtype=dtype, device=device).expand(b, sk, h, 64)
    v = randn((b, sk, 1, 64), dtype=dtype, device=device).expand(b, sk, h, 64)
    assert q.stride(0) == 0 and k.stride(2) == 0
    check(q, k, v, _dout(q), causal=True)


# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim) with a size 0
EMPTY_CPU = [(0, 5, 7, 2, 2, 64), (2, 0, 7, 2, 2, 64), (2, 5, 0, 2, 1, 64), (2, 0, 0, 4, 2, 32)]
EMPTY_CUDA = [(0, 7, 9, 4, 2, 64), (2, 0, 9, 4, 2, 64), (2, 7, 0, 4, 2, 64), (2, 0, 0, 4, 4, 64)]


@on_devices("shape,causal", cpu=[(s, c) for s in EMPTY_CPU for c in (False, True)],
            cuda=[(s, c) for s in EMPTY_CUDA for c in (False, True)],
            ids=lambda s, causal: "b{}-sq{}-sk{}-h{}:{}-d{}-".format(*s) + _causal_id(causal))
def test_empty(device, shape, causal):
    b, sq, sk, h, hkv, d = shape
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, device=device)
    out, lse, dq, dk, dv = run(q, k, v, _dout(q), causal=causal)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    if sk == 0:
        # No key at all: every row is empty (out 0, lse -inf), as in the reference.
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isneginf(lse).all()
    out_ref, lse32, _ = reference_outputs(q, k, v, causal=causal)
    torch.testing.assert_close(out.float(), out_ref.float())
    torch.testing.assert_close(lse, lse32)
    for g, t in zip((dq, dk, dv), (q, k, v)):
        assert g.shape == t.shape and torch.equal(g, torch.zeros_like(g))


@on_devices("dtype,causal,gqa",
            cpu=[(dt, c, (4, 2)) for dt in CPU_DTYPES for c in (False, True)],
            cuda=[(dt, True, g) for dt in DTYPES for g in GQA],
            ids=lambda dt, causal, g: f"{DTYPE_NAMES[dt]}-{_causal_id(causal)}-h{g[0]}:{g[1]}")
def test_lse_gradient(device, dtype, causal, gqa):
    """A gradient through lse as well as out; GQA (dK/dV summed over the group)."""
    h, hkv = gqa
    b, sq, sk, layout = (2, 45, 80, "bshd") if device == "cpu" else (2, 300, 200, "padded")
    q, k, v = make_qkv(b, sq, sk, h, hkv, 64, dtype=dtype, device=device, layout=layout)
    dlse = torch.randn(b, h, sq, device=device)
    check(q, k, v, _dout(q), dlse, causal=causal)


@on_devices("dtype", cpu=[torch.float32, torch.bfloat16], cuda=DTYPES, ids=DTYPE_NAMES.get)
def test_deterministic_backward(device, dtype):
    """deterministic=True: bitwise the same run to run (20 runs on CUDA), and under the criterion."""
    b, sq, sk, h, hkv, d = (2, 130, 97, 8, 2, 64) if device == "cpu" else (2, 1023, 1023, 8, 2, 128)
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, device=device, layout="bhsd")
    dout = _dout(q)
    runs = [run(q, k, v, dout, causal=True, deterministic=True) for _ in range(3 if device == "cpu" else 20)]
    for r in runs[1:]:
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), runs[0], r):
            assert torch.equal(x, y), f"{name} differs between deterministic runs"
    ref = reference_grads(q, k, v, dout, causal=True)
    for name, i in (("dq", 2), ("dk", 3), ("dv", 4)):
        check_precision(name, runs[0][i], ref["ref"][i], ref["pt"][i])


# ---- torch.compile ----------------------------------------------------------------------
class TransformerBlock(nn.Module):
    """Pre-norm block: LN -> qkv -> flashcute.attention (GQA, causal) -> proj; LN -> MLP.

    Parameters in float32; the attention runs in `attn_dtype`.
    """

    def __init__(self, dim=256, nheads=8, nheads_kv=2, attn_dtype=torch.bfloat16):
        super().__init__()
        self.h, self.hkv, self.d = nheads, nheads_kv, dim // nheads
        self.attn_dtype = attn_dtype
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, (nheads + 2 * nheads_kv) * self.d)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, s, dim = x.shape
        qkv = self.qkv(self.ln1(x)).to(self.attn_dtype)
        q, k, v = qkv.split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        o = flashcute.attention(q.view(b, s, self.h, self.d), k.view(b, s, self.hkv, self.d),
                                v.view(b, s, self.hkv, self.d), causal=True)
        x = x + self.proj(o.reshape(b, s, dim).to(x.dtype))
        return x + self.mlp(self.ln2(x))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _assert_rel(name, a, b, tol=1e-2):
    r = _rel(a, b)
    assert r <= tol, f"{name}: relative error {r:.3e} > {tol}"


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_inference(backend):
    torch._dynamo.reset()
    model = TransformerBlock().cuda()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(2, 300, 256, device="cuda")
    with torch.no_grad():
        ye = or_skip(lambda: model(x))
        yc = compiled(x)
    _assert_rel("y", yc, ye)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compile_training_step(backend):
    torch._dynamo.reset()
    torch.manual_seed(0)
    eager = TransformerBlock().cuda()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 300, 256, device="cuda")
    target = torch.randn(2, 300, 256, device="cuda")

    def step(m, opt):
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(m(x), target)
        or_skip(loss.backward)
        opt.step()
        return loss.detach()

    loss_e = step(eager, opt_e)
    loss_c = step(compiled, opt_c)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-3, atol=1e-4)
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        _assert_rel(f"grad {name}", pc.grad, pe.grad, tol=2e-2)
        _assert_rel(f"param {name}", pc.detach(), pe.detach(), tol=1e-3)
