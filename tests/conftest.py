"""Shared helpers of flashcute's tests.

- ``gpu``: marks a test (or, as ``pytestmark = gpu``, a module) as needing a CUDA GPU; it
  carries the ``gpu`` marker and skips when ``torch.cuda.is_available()`` is False. Every
  test marked ``gpu`` by any other means is skipped without a GPU as well.
- ``check_precision``: the SPEC's criterion for out, dq, dk, dv:
  max|ours - ref32| <= 2 * max|pt - ref32| + 1e-5.
- ``check_lse``: lse within 1e-3 absolute of the float32 reference, -inf exactly where it is.
- ``make_qkv`` / ``randn``: random inputs (never zeros), in several memory layouts, from a
  generator seeded per test.
- ``reference_outputs`` / ``reference_grads``: out / lse and dq, dk, dv of
  ``flashcute.reference.attention``, as ref (float32 upcasts; float64 for float32 inputs,
  see ``ref_dtype``) and pt (the inputs' own dtype).
- ``run_attention`` / ``check_attention``: ours (out, lse and, given dout, dq, dk, dv) on the
  inputs' device, and the check of all of them against the reference; ``or_skip`` skips a
  test where a restricted CUDA build has no kernel for the call.

The tests import ``flashcute`` as installed (``pip install .``); they never add ``python/``
to ``sys.path``. For a build tree, set ``FLASHCUTE_LIBRARY`` and ``PYTHONPATH`` by hand.
"""
from __future__ import annotations

import contextlib
import zlib

import pytest
import torch

import flashcute
from flashcute import reference

HAS_CUDA = torch.cuda.is_available()

# `@gpu` on a test, or `pytestmark = gpu` in a module.
_skip_no_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def gpu(obj=None):
    """Decorator: the test needs a CUDA GPU (marker `gpu`, skipped without one)."""
    return _skip_no_gpu(pytest.mark.gpu(obj))


gpu.marks = [pytest.mark.gpu, _skip_no_gpu]  # for `pytestmark = gpu.marks`


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(_skip_no_gpu)


# ---- seeding ----------------------------------------------------------------------------
def _seed_of(nodeid: str) -> int:
    return zlib.crc32(nodeid.encode()) & 0x7FFFFFFF


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Seeds torch's global generators from the test's id: reruns see the same inputs."""
    seed = _seed_of(request.node.nodeid)
    torch.manual_seed(seed)
    yield seed


# ---- inputs -----------------------------------------------------------------------------
LAYOUTS = ("bshd", "bhsd", "padded", "misaligned")


def randn(shape, *, dtype=torch.float32, device="cpu", layout="bshd", generator=None,
          requires_grad=False):
    """torch.randn of the logical shape (batch, seqlen, heads, headdim) in a memory layout:

    - ``bshd``: contiguous;
    - ``bhsd``: a ``(b, h, s, d)`` contiguous tensor seen through ``.transpose(1, 2)``;
    - ``padded``: a slice ``[..., 8:8 + d]`` of a buffer with a larger head dim
      (stride(-1) == 1, rows not packed, 16-byte aligned);
    - ``misaligned``: the same with offset 3: rows start off 16-byte boundaries (the CUDA
      op copies such inputs; the result must not change).
    """
    b, s, h, d = shape
    kw = dict(dtype=torch.float32, device=device, generator=generator)
    # Drawn in float32 and cast before taking the view, so that every dtype gets the layout.
    if layout == "bshd":
        t = torch.randn(b, s, h, d, **kw).to(dtype)
    elif layout == "bhsd":
        t = torch.randn(b, h, s, d, **kw).to(dtype).transpose(1, 2)
    elif layout in ("padded", "misaligned"):
        off = 8 if layout == "padded" else 3
        t = torch.randn(b, s, h, d + 24, **kw).to(dtype)[..., off:off + d]
    else:
        raise ValueError(f"unknown layout {layout!r}")
    assert t.shape == (b, s, h, d) and t.stride(-1) == 1
    if requires_grad:
        t.requires_grad_(True)
    return t


def make_qkv(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, *, dtype=torch.float32,
             device="cpu", layout="bshd", requires_grad=False, seed=None):
    """Random q, k, v (torch.randn: never zeros) in the given layout.

    With ``seed`` the tensors come from a private generator; otherwise from torch's global
    one, which the autouse fixture seeds per test.
    """
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    q = randn((batch, seqlen_q, nheads, headdim), dtype=dtype, device=device, layout=layout,
              generator=gen, requires_grad=requires_grad)
    k = randn((batch, seqlen_k, nheads_kv, headdim), dtype=dtype, device=device, layout=layout,
              generator=gen, requires_grad=requires_grad)
    v = randn((batch, seqlen_k, nheads_kv, headdim), dtype=dtype, device=device, layout=layout,
              generator=gen, requires_grad=requires_grad)
    return q, k, v


# ---- precision --------------------------------------------------------------------------
def _maxabs(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def precision_numbers(ours, ref32, pt):
    """(err, bound): err = max|ours - ref32|, bound = 2 * max|pt - ref32| + 1e-5."""
    ref32 = ref32.double()
    err = _maxabs(ours.double() - ref32)
    base = _maxabs(pt.double() - ref32)
    return err, 2.0 * base + 1e-5


def check_precision(name, ours, ref32, pt, mult=2.0):
    """The SPEC's criterion: max|ours - ref32| <= mult * max|pt - ref32| + 1e-5 (mult 2; 3 with
    softcap).

    ``ref32``: the reference on float32 upcasts (for float32 inputs: on float64 copies, see
    ``ref_dtype``); ``pt``: the reference in the inputs' dtype.
    NaNs in ours (where ref32 has none) fail the check.
    """
    assert ours.shape == ref32.shape == pt.shape, \
        f"{name}: shapes differ: ours {tuple(ours.shape)}, ref32 {tuple(ref32.shape)}, pt {tuple(pt.shape)}"
    assert torch.isfinite(ref32).all(), f"{name}: the float32 reference is not finite"
    n_bad = (~torch.isfinite(ours)).sum().item()
    assert n_bad == 0, f"{name}: {n_bad} non-finite values in ours (the reference has none)"
    err, bound2 = precision_numbers(ours, ref32, pt)
    base = (bound2 - 1e-5) / 2
    bound = mult * base + 1e-5
    assert err <= bound, (
        f"{name}: max|ours - ref32| = {err:.3e} > bound {mult:g}*max|pt - ref32| + 1e-5 = {bound:.3e} "
        f"(max|pt - ref32| = {base:.3e}, max|ref32| = {_maxabs(ref32.float()):.3e})")
    return err, bound


def check_lse(ours, ref, atol=1e-3, name="lse"):
    """lse: float32, within atol of the float32 reference; -inf exactly where it is -inf."""
    assert ours.dtype == torch.float32, f"{name}: dtype {ours.dtype}, expected float32"
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
    ref = ref.float()
    ref_empty = torch.isneginf(ref)
    ours_empty = torch.isneginf(ours)
    mismatch = (ref_empty != ours_empty).sum().item()
    assert mismatch == 0, (
        f"{name}: -inf at {ours_empty.sum().item()} rows, the reference at {ref_empty.sum().item()} "
        f"({mismatch} rows differ)")
    finite = ~ref_empty
    n_nan = (~torch.isfinite(ours[finite])).sum().item()
    assert n_nan == 0, f"{name}: {n_nan} non-finite values where the reference is finite"
    err = _maxabs(ours[finite] - ref[finite])
    assert err <= atol, f"{name}: max|ours - ref32| = {err:.3e} > {atol:.1e}"
    return err


# ---- reference ----------------------------------------------------------------------------
# ref32 is the math in float32 on upcast copies. For float32 inputs that is the very math of
# pt (max|pt - ref32| == 0 and the criterion would collapse to a bare 1e-5, below float32's
# own rounding on logits of size ~10), so float32 inputs are measured against the math in
# float64 instead: max|ours - ref64| <= 2 * max|pt32 - ref64| + 1e-5, the SPEC's criterion one
# precision up. float16 / bfloat16 inputs use ref32 exactly as the SPEC says.
def ref_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float32 else torch.float32


def _reference(q, k, v, *, causal, scale, dtype, block_mask=None):
    """reference.attention in `dtype` (float32 or float64) on copies; returns (out, lse)."""
    q, k, v = (t.to(dtype) for t in (q, k, v))
    # upcast=True is the float32 math (ref32 proper); it would round float64 down to float32.
    return reference.attention(q, k, v, causal=causal, scale=scale, block_mask=block_mask,
                               return_lse=True, upcast=dtype == torch.float32)


def reference_outputs(q, k, v, *, causal=False, scale=None, block_mask=None):
    """(ref_out, ref_lse, pt_out): the reference forward in float32 (float64 for float32
    inputs, see above) and in the inputs' dtype."""
    with torch.no_grad():
        q, k, v = q.detach(), k.detach(), v.detach()
        out_ref, lse_ref = _reference(q, k, v, causal=causal, scale=scale,
                                      dtype=ref_dtype(q.dtype), block_mask=block_mask)
        pt = reference.attention(q, k, v, causal=causal, scale=scale, block_mask=block_mask,
                                 upcast=False)
    return out_ref, lse_ref.float(), pt


def _ref_fwd_bwd(q, k, v, dout, dlse, *, causal, scale, dtype, block_mask=None):
    upcast = dtype == torch.float32 and q.dtype != torch.float32  # ref32 proper, as above
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    out, lse = reference.attention(q, k, v, causal=causal, scale=scale, block_mask=block_mask,
                                   return_lse=True, upcast=upcast)
    outs, grads = [out], [dout.to(out.dtype)]
    if dlse is not None:
        # Empty rows have lse = -inf; their dlse must not reach the math (inf * 0 = nan).
        outs.append(lse.masked_fill(torch.isneginf(lse), 0.0))
        grads.append(dlse.to(lse.dtype))
    dq, dk, dv = torch.autograd.grad(outs, (q, k, v), grads, allow_unused=True)
    dq, dk, dv = (g if g is not None else torch.zeros_like(t) for g, t in zip((dq, dk, dv), (q, k, v)))
    return out.detach(), lse.detach().float(), dq, dk, dv


def reference_grads(q, k, v, dout, dlse=None, *, causal=False, scale=None, block_mask=None):
    """{"ref": (out, lse, dq, dk, dv), "pt": (...)} of flashcute.reference.attention.

    "ref" is the math on float32 copies (float64 for float32 inputs, see above), "pt" the same
    math in q's dtype (``upcast=False``); gradients by autograd with upstream dout (and dlse).
    """
    return {
        "ref": _ref_fwd_bwd(q, k, v, dout, dlse, causal=causal, scale=scale,
                            dtype=ref_dtype(q.dtype), block_mask=block_mask),
        "pt": _ref_fwd_bwd(q, k, v, dout, dlse, causal=causal, scale=scale, dtype=q.dtype,
                           block_mask=block_mask),
    }


def empty_rows(seqlen_q, seqlen_k, causal):
    """Number of leading query rows with no visible key (bottom-right causal)."""
    if seqlen_k == 0:
        return seqlen_q
    return max(0, seqlen_q - seqlen_k) if causal else 0


# ---- ours, on either device -------------------------------------------------------------
# The targets of tests that run on the CPU and on each CUDA kernel family (the family's tests
# skip where this build or the GPU lacks it; see on()).
TARGETS = [
    pytest.param(("cpu", None), id="cpu"),
    pytest.param(("cuda", "sm80"), id="cuda-sm80", marks=gpu.marks),
    pytest.param(("cuda", "sm90"), id="cuda-sm90", marks=gpu.marks),
]


def target_cases(cpu_cases, cuda_cases, targets=None):
    """pytest params (target, case) for each of `targets` (default TARGETS): the cpu_cases dict on
    the CPU, cuda_cases on each CUDA family, with ids "<target>-<name>"."""
    out = []
    for t in targets or TARGETS:
        device = t.values[0][0]
        for name, case in (cpu_cases if device == "cpu" else cuda_cases).items():
            out.append(pytest.param(t.values[0], case, id=f"{t.id}-{name}", marks=t.marks))
    return out


def prepare_softcap(q, kw):
    """flash-attn's trick: scale q with the softcap so that the scores reach into tanh's
    saturation (here |s / c| ~ 1)."""
    c = kw.get("softcap", 0.0)
    return q * c if c > 0 else q


@contextlib.contextmanager
def on(target):
    """Runs the block on the target's device under its kernel family (skips when missing;
    "auto": the dispatcher's choice)."""
    device, family = target
    if device == "cpu":
        yield
        return
    if family != "auto" and family not in flashcute.kernels.available():
        pytest.skip(f"this build has no {family} kernels (it has {flashcute.kernels.available()})")
    try:
        ctx = flashcute.kernels(family)
    except RuntimeError as e:  # the GPU lacks the family
        pytest.skip(str(e).splitlines()[0])
    with ctx:
        yield


@pytest.fixture(autouse=True)
def _exact_float32_reference():
    """ref32 on the GPU must be float32 math, not TF32."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def skip_if_no_kernel(msg):
    """Skips the test where an error message says this build has no kernel for the call (a CUDA
    build restricted with FLASHCUTE_HEADDIMS / FLASHCUTE_DTYPES)."""
    if "no kernel in this build" in msg:
        pytest.skip(f"restricted build: {msg.splitlines()[0]}")


def or_skip(fn):
    """Runs fn; skips the test where this build has no kernel for the call (skip_if_no_kernel)."""
    try:
        return fn()
    except Exception as e:  # the op's RuntimeError, or opcheck's OpCheckError wrapping it
        skip_if_no_kernel(str(e))
        raise


def capture_graph(fn, between=None):
    """fn() run once on a side stream (library loading, allocator warm-up: outside the capture, as
    torch's CUDA-graph recipe asks), then between() if given (eager, e.g. to step past what the
    warm-up wrote), then fn() captured: (the graph, fn's outputs, which each replay rewrites in
    place)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    if between is not None:
        between()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def run_attention(q, k, v, dout=None, dlse=None, **kw):
    """Ours on q's device: (out, lse) of flashcute.attention(q, k, v, return_lse=True, **kw);
    given dout, (out, lse, dq, dk, dv) with the gradients by autograd from dout (and dlse)."""
    if dout is None:
        res = or_skip(lambda: flashcute.attention(q, k, v, return_lse=True, **kw))
    else:
        q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
        out, lse = or_skip(lambda: flashcute.attention(q, k, v, return_lse=True, **kw))
        outs, grads = [out], [dout]
        if dlse is not None:
            outs.append(lse)
            grads.append(dlse)
        dq, dk, dv = or_skip(lambda: torch.autograd.grad(outs, (q, k, v), grads))
        res = out.detach(), lse.detach(), dq, dk, dv
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    return res


def check_attention(q, k, v, dout=None, dlse=None, *, causal=False, scale=None):
    """run_attention against the reference: out (and, given dout, dq, dk, dv) in q's dtype under
    the SPEC's criterion (check_precision: NaN-free too), lse by check_lse (-inf exactly on the
    rows with no key, finite elsewhere), out exactly 0 on those rows. Returns ours."""
    ours = run_attention(q, k, v, dout, dlse, causal=causal, scale=scale)
    out, lse = ours[:2]
    b, sq, h, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    if dout is None:
        out_ref, lse_ref, pt_out = reference_outputs(q, k, v, causal=causal, scale=scale)
        ref, pt, names = (out_ref, lse_ref), (pt_out,), ("out",)
    else:
        refs = reference_grads(q, k, v, dout, dlse, causal=causal, scale=scale)
        ref, pt, names = refs["ref"], refs["pt"], ("out", "dq", "dk", "dv")
    for name, i in zip(names, (0, 2, 3, 4)):
        assert ours[i].dtype == q.dtype, f"{name} has dtype {ours[i].dtype}, expected {q.dtype}"
        check_precision(name, ours[i], ref[i], pt[i])
    check_lse(lse, ref[1])
    rows = torch.isneginf(ref[1]).transpose(1, 2)  # (b, sq, h): rows with no key
    assert torch.equal(out[rows], torch.zeros_like(out[rows])), "rows with no key must give out = 0"
    return ours


__all__ = [
    "HAS_CUDA", "gpu", "LAYOUTS", "randn", "make_qkv", "check_precision", "precision_numbers",
    "check_lse", "ref_dtype", "reference_outputs", "reference_grads", "empty_rows", "or_skip",
    "run_attention", "check_attention",
]
