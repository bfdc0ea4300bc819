"""The dispatcher op and its integrations, on CPU (opcheck on CUDA as well).

- torch.library.opcheck on torch.ops.flashcute.attention and attention_backward (schema,
  autograd registration, fake kernel, AOT dispatch with dynamic shapes), on CPU and on CUDA
  (marker gpu);
- torch.compile(fullgraph=True) of a small attention block, forward and backward, matching
  eager, with the aot_eager and the inductor backends; compiled autograd of the backward;
- flashcute.sdpa against torch.nn.functional.scaled_dot_product_attention, and its fallback
  to PyTorch with exactly one warning per reason.
"""
from __future__ import annotations

import shutil
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import flashcute
import flashcute.api
from conftest import gpu, make_qkv

OP = torch.ops.flashcute.attention
OP_BWD = torch.ops.flashcute.attention_backward


# ---- opcheck -------------------------------------------------------------------------------
DEVICES = [pytest.param("cpu", id="cpu"), pytest.param("cuda", id="cuda", marks=gpu.marks)]

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, scale, dtype) per device. The
# CUDA kernels have no float32: there bfloat16 and head dim 64, which every build has (CI's too).
OPCHECK_CASES = {
    "cpu": [
        (2, 17, 17, 2, 2, 32, False, None, torch.float32),
        (1, 33, 20, 4, 1, 64, True, None, torch.float32),    # GQA 4:1, causal, empty rows
        (1, 9, 40, 4, 2, 40, True, 0.3, torch.bfloat16),     # GQA 2:1, padded head dim, scale
    ],
    "cuda": [
        (2, 17, 17, 2, 2, 64, False, None, torch.bfloat16),
        (1, 33, 20, 4, 1, 64, True, None, torch.bfloat16),   # GQA 4:1, causal, empty rows
        (1, 9, 40, 4, 2, 64, True, 0.3, torch.bfloat16),     # GQA 2:1, scale
    ],
}


def _opcheck_id(c):
    b, sq, sk, h, hkv, d, causal, scale, dtype = c
    return f"sq{sq}-sk{sk}-h{h}:{hkv}-d{d}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


OPCHECK_PARAMS = [pytest.param(device, case, id=f"{device}-{_opcheck_id(case)}",
                               marks=gpu.marks if device == "cuda" else ())
                  for device, cases in OPCHECK_CASES.items() for case in cases]


@pytest.mark.parametrize("device,case", OPCHECK_PARAMS)
def test_opcheck_attention(device, case):
    b, sq, sk, h, hkv, d, causal, scale, dtype = case
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, device=device, requires_grad=True)
    torch.library.opcheck(OP, (q, k, v, causal, scale, False))
    # kwargs and non-contiguous inputs
    qt, kt, vt = make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, device=device, layout="bhsd",
                          requires_grad=True)
    torch.library.opcheck(OP, (qt, kt, vt), {"causal": causal, "scale": scale,
                                             "deterministic": True})


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_attention_no_grad(device):
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(1, 16, 24, 2, 1, 64, dtype=dtype, device=device)
    torch.library.opcheck(OP, (q, k, v, True, None, False))


@pytest.mark.parametrize("with_dlse", [False, True], ids=["dout", "dout+dlse"])
@pytest.mark.parametrize("device,case", OPCHECK_PARAMS)
def test_opcheck_attention_backward(device, case, with_dlse):
    b, sq, sk, h, hkv, d, causal, scale, dtype = case
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, device=device)
    out, lse = OP(q, k, v, causal, scale, False)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    s = scale if scale is not None else d ** -0.5
    torch.library.opcheck(OP_BWD, (dout, q, k, v, out, lse, dlse, causal, s, False))


# ---- torch.compile ----------------------------------------------------------------------
class AttentionBlock(nn.Module):
    """qkv projection -> flashcute.attention (GQA, causal) -> out projection."""

    def __init__(self, dim=64, nheads=4, nheads_kv=2, headdim=32, causal=True):
        super().__init__()
        self.h, self.hkv, self.d, self.causal = nheads, nheads_kv, headdim, causal
        self.qkv = nn.Linear(dim, (nheads + 2 * nheads_kv) * headdim)
        self.proj = nn.Linear(nheads * headdim, dim)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        # Views into the packed projection: stride(-1) == 1, rows not packed (no copies).
        q = q.view(b, s, self.h, self.d)
        k = k.view(b, s, self.hkv, self.d)
        v = v.view(b, s, self.hkv, self.d)
        o, lse = flashcute.attention(q, k, v, causal=self.causal, return_lse=True)
        # lse enters the loss too, so that its gradient path is compiled as well.
        return self.proj(o.reshape(b, s, self.h * self.d)), lse


def _train_step(model, x):
    y, lse = model(x)
    loss = (y * y).mean() + 1e-2 * lse.mean()
    params = [x] + list(model.parameters())
    grads = torch.autograd.grad(loss, params)
    return loss.detach(), y.detach(), grads


def _compare_compiled(backend, dynamic=False, shapes=((2, 37),)):
    torch._dynamo.reset()
    model = AttentionBlock()
    compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=dynamic)
    for b, s in shapes:
        x = torch.randn(b, s, 64, requires_grad=True)
        loss_e, y_e, g_e = _train_step(model, x)
        loss_c, y_c, g_c = _train_step(compiled, x)
        torch.testing.assert_close(y_c, y_e, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(loss_c, loss_e, rtol=1e-4, atol=1e-6)
        for i, (a, e) in enumerate(zip(g_c, g_e)):
            torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5, msg=lambda m, i=i: f"grad {i}: {m}")


def test_compile_aot_eager():
    _compare_compiled("aot_eager")


def test_compile_aot_eager_dynamic():
    """Dynamic shapes: the fake kernel sees symbolic sizes; two sequence lengths."""
    _compare_compiled("aot_eager", dynamic=True, shapes=((2, 37), (1, 50)))


@pytest.mark.skipif(not any(shutil.which(c) for c in ("g++", "c++", "clang++")),
                    reason="inductor's CPU backend needs a C++ compiler")
def test_compile_inductor():
    _compare_compiled("inductor")


def test_compiled_autograd():
    """Compiled autograd traces the C++ autograd kernel's backward (is_traceable) into one graph
    (fullgraph: a node it cannot trace would raise), and the gradients, lse's included, equal
    eager's."""
    from torch._dynamo import compiled_autograd
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    q, k, v = make_qkv(2, 37, 37, 4, 2, 32, requires_grad=True)

    def loss_fn():
        o, lse = flashcute.attention(q, k, v, causal=True, return_lse=True)
        return (o * o).mean() + 1e-2 * lse.mean()

    expected = torch.autograd.grad(loss_fn(), (q, k, v))
    loss = loss_fn()
    with compiled_autograd._enable(torch.compile(backend="aot_eager", fullgraph=True)):
        loss.backward()
    assert counters["compiled_autograd"]["captures"] == 1
    for got, want in zip((q.grad, k.grad, v.grad), expected):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_compile_no_graph_break():
    """The op is one node of one graph (fullgraph=True would raise on a break)."""
    torch._dynamo.reset()
    counts = {"graphs": 0}

    def backend(gm, example_inputs):
        counts["graphs"] += 1
        targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
        assert any("flashcute" in str(t) for t in targets), targets
        return gm

    fn = torch.compile(lambda q, k, v: flashcute.attention(q, k, v, causal=True) * 2,
                       backend=backend, fullgraph=True)
    q, k, v = make_qkv(1, 20, 20, 2, 2, 32)
    torch.testing.assert_close(fn(q, k, v), flashcute.attention(q, k, v, causal=True) * 2)
    assert counts["graphs"] == 1


# ---- flashcute.sdpa -------------------------------------------------------------------------
def _bhsd(b, h, s, d, dtype=torch.float32, requires_grad=False):
    return torch.randn(b, h, s, d, dtype=dtype, requires_grad=requires_grad)


def _no_warnings(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sdpa_matches_torch(is_causal, dtype, tol):
    q = _bhsd(2, 4, 33, 64, dtype, requires_grad=True)
    k = _bhsd(2, 4, 33, 64, dtype, requires_grad=True)
    v = _bhsd(2, 4, 33, 64, dtype, requires_grad=True)
    ours = _no_warnings(lambda: flashcute.sdpa(q, k, v, is_causal=is_causal))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    torch.testing.assert_close(ours, ref, rtol=tol, atol=tol)
    g = torch.randn_like(ref)
    ga = torch.autograd.grad(ours, (q, k, v), g)
    gb = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * 2)


def test_sdpa_non_causal_different_lengths():
    q, k, v = _bhsd(1, 2, 10, 32), _bhsd(1, 2, 27, 32), _bhsd(1, 2, 27, 32)
    ours = _no_warnings(lambda: flashcute.sdpa(q, k, v))
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_sdpa_enable_gqa(is_causal):
    q, k, v = _bhsd(2, 8, 29, 32), _bhsd(2, 2, 29, 32), _bhsd(2, 2, 29, 32)
    ours = _no_warnings(lambda: flashcute.sdpa(q, k, v, is_causal=is_causal, enable_gqa=True))
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
    torch.testing.assert_close(ours, ref, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("scale", [0.05, 0.3, 1.0])
def test_sdpa_scale(scale):
    q, k, v = _bhsd(1, 2, 19, 64), _bhsd(1, 2, 23, 64), _bhsd(1, 2, 23, 64)
    ours = _no_warnings(lambda: flashcute.sdpa(q, k, v, scale=scale))
    ref = F.scaled_dot_product_attention(q, k, v, scale=scale)
    torch.testing.assert_close(ours, ref, rtol=5e-5, atol=5e-5)


@pytest.fixture
def fresh_warnings(monkeypatch):
    """flashcute.sdpa warns once per reason per process; start from a clean slate."""
    monkeypatch.setattr(flashcute.api, "_warned", set())


def _fallback_calls():
    """(name, kwargs for sdpa and torch's SDPA, q, k, v) of three unsupported calls."""
    q, k, v = _bhsd(1, 2, 12, 32), _bhsd(1, 2, 12, 32), _bhsd(1, 2, 12, 32)
    mask = torch.randn(12, 12)
    kq = _bhsd(1, 2, 7, 32)
    strided = _bhsd(1, 2, 12, 64)[..., ::2]  # stride(-1) == 2
    return [
        ("attn_mask", dict(attn_mask=mask), q, k, v),
        ("stride", dict(), strided, k, v),
        ("causal", dict(is_causal=True), kq, k, v),  # seq_q != seq_k: top-left alignment
    ]


@pytest.mark.parametrize("index", [0, 1, 2], ids=["attn_mask", "stride", "is_causal_sq_ne_sk"])
def test_sdpa_fallback_one_warning(index, fresh_warnings):
    name, kw, q, k, v = _fallback_calls()[index]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        results = []
        for _ in range(3):
            results.append(flashcute.sdpa(q, k, v, **kw))
    ours_warnings = [w for w in rec if "flashcute.sdpa" in str(w.message)]
    assert len(ours_warnings) == 1, [str(w.message) for w in rec]
    ref = F.scaled_dot_product_attention(q, k, v, **kw)
    for r in results:
        torch.testing.assert_close(r, ref, rtol=0, atol=0)


def test_sdpa_fallback_one_warning_per_reason(fresh_warnings):
    calls = _fallback_calls()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        for _ in range(2):
            for _name, kw, q, k, v in calls:
                flashcute.sdpa(q, k, v, **kw)
    msgs = [str(w.message) for w in rec if "flashcute.sdpa" in str(w.message)]
    assert len(msgs) == len(calls), msgs
    assert len(set(msgs)) == len(calls), msgs
    joined = "\n".join(msgs)
    for word in ("attn_mask", "stride(-1)", "is_causal"):
        assert word in joined, joined


def test_sdpa_supported_call_does_not_warn(fresh_warnings):
    q, k, v = _bhsd(1, 2, 12, 32), _bhsd(1, 2, 12, 32), _bhsd(1, 2, 12, 32)
    _no_warnings(lambda: flashcute.sdpa(q, k, v, is_causal=True))


def _reason_cases():
    """(expected reason fragment or None, args of flashcute.api._unsupported) for each check."""
    q, k, v = _bhsd(1, 4, 8, 32), _bhsd(1, 4, 8, 32), _bhsd(1, 4, 8, 32)
    k2, v2 = _bhsd(1, 2, 8, 32), _bhsd(1, 2, 8, 32)
    return [
        (None, (q, k, v, None, 0.0, False, False)),
        (None, (q, k2, v2, None, 0.5, True, True)),  # GQA with enable_gqa; p = 0.5 is allowed
        ("attn_mask", (q, k, v, torch.zeros(8, 8), 0.0, False, False)),
        ("dropout_p", (q, k, v, None, 1.0, False, False)),
        ("dropout_p", (q, k, v, None, True, False, False)),  # a bool is not a rate
        ("dropout_p", (q, k, v, None, "0.1", False, False)),
        ("4-D", (q[0], k, v, None, 0.0, False, False)),
        ("4-D", (q, k, [v], None, 0.0, False, False)),
        ("dtype", (q.double(), k.double(), v.double(), None, 0.0, False, False)),
        ("dtype", (q, k.half(), v, None, 0.0, False, False)),
        ("head dims", (_bhsd(1, 4, 8, 12), _bhsd(1, 4, 8, 12), _bhsd(1, 4, 8, 12), None, 0.0, False, False)),
        ("head dims", (q, k, _bhsd(1, 4, 8, 64), None, 0.0, False, False)),
        ("enable_gqa", (q, k2, v2, None, 0.0, False, False)),
        ("multiple of key heads", (q, _bhsd(1, 3, 8, 32), _bhsd(1, 3, 8, 32), None, 0.0, False, True)),
        ("is_causal", (q, _bhsd(1, 4, 9, 32), _bhsd(1, 4, 9, 32), None, 0.0, True, False)),
        ("stride(-1)", (q, _bhsd(1, 4, 8, 64)[..., ::2], v, None, 0.0, False, False)),
        ("device type meta", (q.to("meta"), k.to("meta"), v.to("meta"), None, 0.0, False, False)),
        ("different devices", (q, k.to("meta"), v, None, 0.0, False, False)),
    ]


@pytest.mark.parametrize("index", range(len(_reason_cases())))
def test_unsupported_names_each_reason(index):
    """flashcute.api._unsupported (flashcute.sdpa's and the integrations' gate, written for host
    time) returns None for what the kernels serve and a reason naming the check otherwise."""
    expected, args = _reason_cases()[index]
    reason = flashcute.api._unsupported(*args)
    if expected is None:
        assert reason is None
    else:
        assert reason is not None and expected in reason, reason
