"""The CUDA kernels of torch.ops.flashcute.attention (marker `gpu`; skipped without a GPU).

Run on an sm80+ GPU (scripts/gpu_check.sh runs them on an H100/H200). The references are
computed on the GPU: ref32 in float32 (TF32 off), pt in the inputs' dtype.

- forward: out under the SPEC criterion and lse within 1e-3, over seqlen pairs from
  {1, 7, 64, 113, 128, 255, 1023, 2048, 4096}, every head dim (32..256 and the padded
  72, 40, 8), float16 / bfloat16, causal on/off, GQA 1/4/8, BHSD and padded views;
  outputs fully written (the allocator is poisoned with NaN before each call);
- backward: dq, dk, dv under the criterion on a subset, bitwise reproducibility with
  deterministic=True;
- torch.compile(fullgraph=True) of a transformer block on CUDA, matching eager.

A build restricted with FLASHCUTE_HEADDIMS / FLASHCUTE_DTYPES skips the head dims and dtypes
it has no kernel for.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flashcute
from conftest import (LAYOUTS, check_lse, check_precision, gpu, make_qkv, randn,
                      reference_grads, reference_outputs)

pytestmark = gpu.marks

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
HDIMS = [32, 64, 96, 128, 192, 256, 72, 40, 8]
GQA = [(4, 4), (8, 2), (8, 1)]  # (nheads, nheads_kv): ratios 1, 4, 8


# Every test runs under each kernel family of the build (the forward differs; the backward
# then consumes that family's out and lse).
FAMILIES = flashcute.kernels.available() or ["auto"]


@pytest.fixture(autouse=True, params=FAMILIES)
def family(request):
    if request.param == "auto" or not torch.cuda.is_available():
        yield request.param
        return
    if request.param == "sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 family needs a compute capability 9.0 GPU")
    with flashcute.kernels(request.param):
        yield request.param


def test_family_runs_its_kernels(family):
    """The forced family's forward kernel is the one that runs (profiler kernel names)."""
    q, k, v = _qkv(1, 300, 300, 4, 4, 64, torch.bfloat16)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        _or_skip(lambda: flashcute.attention(q, k, v, causal=True))
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if "flashcute_fwd_kernel" in e.name]
    assert names, "no forward kernel in the trace"
    if family in ("sm80", "sm90"):
        assert all(family + "::" in n for n in names), names


@pytest.fixture(autouse=True)
def _exact_float32_reference():
    """ref32 must be float32 math, not TF32."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _or_skip(fn):
    """Runs fn; skips the test where this build has no kernel (a restricted build)."""
    try:
        return fn()
    except RuntimeError as e:
        msg = str(e)
        if "no kernel in this build" in msg:
            pytest.skip(f"restricted build: {msg.splitlines()[0]}")
        raise


def _poison(q, nheads):
    """Fills freed allocator blocks of out's and lse's sizes with NaN, so that an output
    element the kernel forgets to write shows up as NaN instead of a stale value."""
    b, sq, _, d = q.shape
    bufs = [torch.full((b, sq, nheads, d), float("nan"), dtype=q.dtype, device=q.device),
            torch.full((b, nheads, sq), float("nan"), dtype=torch.float32, device=q.device)]
    del bufs


def run_fwd(q, k, v, causal=False, scale=None, deterministic=False):
    _poison(q, q.shape[2])
    out, lse = _or_skip(lambda: torch.ops.flashcute.attention(q, k, v, causal, scale, deterministic))
    torch.cuda.synchronize()
    return out, lse


def check_fwd(q, k, v, causal=False, scale=None):
    out, lse = run_fwd(q, k, v, causal, scale)
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    out_ref, lse_ref, pt = reference_outputs(q, k, v, causal=causal, scale=scale)
    empty = torch.isneginf(lse_ref)  # (b, h, sq): rows with no key
    # Fully written: out finite everywhere, lse finite except on empty rows.
    n_bad = (~torch.isfinite(out)).sum().item()
    assert n_bad == 0, f"out has {n_bad} non-finite values (of {out.numel()})"
    n_bad = (~torch.isfinite(lse[~empty])).sum().item()
    assert n_bad == 0, f"lse has {n_bad} non-finite values on rows that have keys"
    check_precision("out", out, out_ref, pt)
    check_lse(lse, lse_ref)
    if empty.any():
        rows = empty.transpose(1, 2)  # (b, sq, h)
        assert torch.equal(out[rows], torch.zeros_like(out[rows])), "empty rows must give out = 0"
    return out, lse


def _fwd_bwd(q, k, v, dout, dlse=None, **kw):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = _or_skip(lambda: flashcute.attention(q, k, v, return_lse=True, **kw))
    outs, grads = [out], [dout]
    if dlse is not None:
        outs.append(lse)
        grads.append(dlse)
    dq, dk, dv = _or_skip(lambda: torch.autograd.grad(outs, (q, k, v), grads))
    torch.cuda.synchronize()
    return out.detach(), lse.detach(), dq, dk, dv


def check_fwd_bwd(q, k, v, causal=False, scale=None, dlse=None):
    b, sq, h, d = q.shape
    dout = torch.randn(b, sq, h, d, device=q.device).to(q.dtype)
    ours = _fwd_bwd(q, k, v, dout, dlse, causal=causal, scale=scale)
    ref = reference_grads(q, k, v, dout, dlse, causal=causal, scale=scale)
    for name, i in (("out", 0), ("dq", 2), ("dk", 3), ("dv", 4)):
        assert ours[i].dtype == q.dtype and ours[i].shape == ref["ref"][i].shape, name
        check_precision(name, ours[i], ref["ref"][i], ref["pt"][i])
    check_lse(ours[1], ref["ref"][1])
    return ours


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
    check_fwd(q, k, v, causal)


@pytest.mark.parametrize("shape", [(113, 255, False), (255, 113, True), (128, 128, True),
                                   (1, 1023, False)],
                         ids=lambda s: f"sq{s[0]}-sk{s[1]}-{'causal' if s[2] else 'full'}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", HDIMS, ids=lambda d: f"d{d}")
def test_forward_headdims(d, dtype, shape):
    sq, sk, causal = shape
    q, k, v = _qkv(2, sq, sk, 4, 2, d, dtype)
    check_fwd(q, k, v, causal)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("gqa", GQA, ids=lambda g: f"h{g[0]}:{g[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_gqa_layouts(dtype, gqa, layout):
    """Every layout, misaligned views included (the op copies those), per GQA ratio."""
    h, hkv = gqa
    q, k, v = _qkv(2, 255, 1023, h, hkv, 128, dtype, layout)
    check_fwd(q, k, v, causal=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_forward_mixed_layouts(dtype):
    q = randn((2, 300, 8, 64), dtype=dtype, device="cuda", layout="bhsd")
    k = randn((2, 511, 2, 64), dtype=dtype, device="cuda", layout="padded")
    v = randn((2, 511, 2, 64), dtype=dtype, device="cuda", layout="bshd")
    check_fwd(q, k, v, causal=True)


@pytest.mark.parametrize("scale", [0.05, 0.5, 2.0])
def test_forward_scale(scale):
    q, k, v = _qkv(1, 200, 300, 4, 1, 64, torch.bfloat16)
    check_fwd(q, k, v, causal=True, scale=scale)


def test_forward_packed_qkv_views():
    """q, k, v as views into one packed qkv projection (rows of (h + 2 h_kv) * d elements)."""
    b, s, h, hkv, d = 2, 333, 8, 2, 64
    qkv = torch.randn(b, s, (h + 2 * hkv) * d, device="cuda", dtype=torch.float16)
    q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, s, h, d), k.view(b, s, hkv, d), v.view(b, s, hkv, d)
    check_fwd(q, k, v, causal=True)


@pytest.mark.parametrize("shape", [(0, 7, 9, 4, 2), (2, 0, 9, 4, 2), (2, 7, 0, 4, 2),
                                   (2, 0, 0, 4, 4)],
                         ids=["batch0", "seqlen_q0", "seqlen_k0", "both0"])
def test_empty(shape):
    b, sq, sk, h, hkv = shape
    q, k, v = _qkv(b, sq, sk, h, hkv, 64, torch.float16)
    for causal in (False, True):
        out, lse = run_fwd(q, k, v, causal)
        assert out.shape == q.shape and lse.shape == (b, h, sq)
        if sk == 0:
            assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    qg, kg, vg = (t.detach().requires_grad_(True) for t in (q, k, v))
    out = flashcute.attention(qg, kg, vg, causal=True)
    grads = torch.autograd.grad(out, (qg, kg, vg), torch.randn_like(out))
    for g, t in zip(grads, (q, k, v)):
        assert g.shape == t.shape and torch.equal(g, torch.zeros_like(g))


@pytest.mark.parametrize("b,h,hkv", [(65535, 1, 1), (1, 65535, 1), (300, 300, 100), (66000, 1, 1), (1, 66000, 1)],
                         ids=["batch65535", "heads65535", "b300-h300", "batch66000", "heads66000"])
def test_forward_large_grid(b, h, hkv):
    """Batch and head counts past a CUDA grid dimension's 65535: the kernels' 1-D grids serve them."""
    q, k, v = _qkv(b, 3, 70, h, hkv, 32, torch.bfloat16)
    check_fwd(q, k, v, causal=True)


def test_forward_side_stream():
    """The kernel runs on the current stream: inputs made on a side stream are seen."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        q, k, v = _qkv(2, 1023, 1023, 8, 2, 128, torch.bfloat16)
        out, lse = _or_skip(lambda: torch.ops.flashcute.attention(q, k, v, True, None, False))
        ref = reference_outputs(q, k, v, causal=True)
    s.synchronize()
    check_precision("out", out, ref[0], ref[2])
    check_lse(lse, ref[1])


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_forward_second_device():
    q, k, v = make_qkv(1, 200, 300, 4, 2, 64, dtype=torch.float16, device="cuda:1")
    out, _ = check_fwd(q, k, v, causal=True)
    assert out.device == torch.device("cuda:1")


def test_forward_repeatable():
    """The forward is bitwise the same run to run."""
    q, k, v = _qkv(2, 1023, 2048, 8, 2, 128, torch.bfloat16)
    a = run_fwd(q, k, v, True)
    b = run_fwd(q, k, v, True)
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
    check_fwd_bwd(q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("d", HDIMS, ids=lambda d: f"d{d}")
def test_backward_headdims(d, dtype):
    q, k, v = _qkv(2, 113, 255, 4, 2, d, dtype)
    check_fwd_bwd(q, k, v, causal=True)


@pytest.mark.parametrize("gqa", GQA, ids=lambda g: f"h{g[0]}:{g[1]}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_gqa_lse_grad(dtype, gqa):
    """GQA (dK/dV summed over the group) with a gradient through lse; padded layout."""
    h, hkv = gqa
    q, k, v = _qkv(2, 300, 200, h, hkv, 64, dtype, "padded")
    dlse = torch.randn(2, h, 300, device="cuda")
    check_fwd_bwd(q, k, v, causal=True, dlse=dlse)


def test_backward_scale():
    q, k, v = _qkv(1, 200, 300, 4, 1, 64, torch.float16)
    check_fwd_bwd(q, k, v, causal=False, scale=0.3)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_backward_deterministic(dtype):
    q, k, v = _qkv(2, 1023, 1023, 8, 2, 128, dtype, "bhsd")
    dout = torch.randn(2, 1023, 8, 128, device="cuda").to(dtype)
    runs = [_fwd_bwd(q, k, v, dout, causal=True, deterministic=True) for _ in range(3)]
    for r in runs[1:]:
        for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), runs[0], r):
            assert torch.equal(a, b), f"{name} differs between deterministic runs"
    ref = reference_grads(q, k, v, dout, causal=True)
    for name, i in (("dq", 2), ("dk", 3), ("dv", 4)):
        check_precision(name, runs[0][i], ref["ref"][i], ref["pt"][i])


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
    splits = 16 if deterministic else 1  # the workspace's most dQ splits (sm80/bwd_launch.h)
    workspace = 4 * rows * (2 + splits * d)
    grads_bytes = sum(g.numel() * g.element_size() for g in grads)
    assert extra <= grads_bytes + workspace + (1 << 20), (extra, grads_bytes, workspace)
    if not deterministic:  # 3 MB of gradients, 2 MB of workspace: far below one fp32 S (134 MB)
        assert extra < b * h * s * s * 4 // 16


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
        ye = _or_skip(lambda: model(x))
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
        _or_skip(loss.backward)
        opt.step()
        return loss.detach()

    loss_e = step(eager, opt_e)
    loss_c = step(compiled, opt_c)
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-3, atol=1e-4)
    for (name, pe), pc in zip(eager.named_parameters(), model.parameters()):
        _assert_rel(f"grad {name}", pc.grad, pe.grad, tol=2e-2)
        _assert_rel(f"param {name}", pc.detach(), pe.detach(), tol=1e-3)
