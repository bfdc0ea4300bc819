"""The CPU backend of torch.ops.flashcute.attention against flashcute.reference.

Forward (out, lse) and backward (dq, dk, dv) under the SPEC's criterion, for float32,
float16 and bfloat16, over a representative grid of odd sizes, GQA ratios, causal on/off
(bottom-right aligned), memory layouts, custom scales, empty inputs, the gradient through
lse, and the bitwise reproducibility of deterministic=True.
"""
from __future__ import annotations

import pytest
import torch

import flashcute
from conftest import (check_lse, check_precision, empty_rows, make_qkv, randn,
                      reference_grads, reference_outputs)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, layout)
CASES = [
    (2, 1, 1, 2, 2, 64, False, "bshd"),
    (1, 1, 257, 4, 1, 32, True, "bshd"),       # decoding: one query, every key visible
    (2, 17, 17, 2, 2, 96, True, "bshd"),
    (1, 17, 113, 8, 1, 128, False, "bhsd"),    # MQA (8:1), transposed BHSD views
    (1, 113, 17, 4, 1, 72, True, "bshd"),      # seqlen_q > seqlen_k: 96 rows see no key
    (1, 113, 257, 4, 4, 256, True, "padded"),  # slice of a wider head-dim buffer
    (2, 257, 113, 8, 2, 40, False, "bshd"),    # GQA 4:1, padded head dim 40
    (1, 257, 257, 4, 1, 64, True, "bhsd"),
    (1, 128, 64, 2, 2, 128, True, "padded"),   # tile multiples, 64 empty rows
    (1, 64, 65, 2, 1, 8, False, "bshd"),
    (1, 65, 1, 2, 2, 32, True, "bshd"),        # only the last query row sees the key
    (1, 33, 257, 8, 8, 192, False, "bhsd"),
    (2, 100, 90, 4, 2, 64, True, "misaligned"),  # rows off 16-byte boundaries
]


def _case_id(c):
    b, sq, sk, h, hkv, d, causal, layout = c
    return f"b{b}-sq{sq}-sk{sk}-h{h}:{hkv}-d{d}-{'causal' if causal else 'full'}-{layout}"


def _ours_fwd_bwd(q, k, v, dout, dlse=None, **kw):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = flashcute.attention(q, k, v, return_lse=True, **kw)
    outs, grads = [out], [dout]
    if dlse is not None:
        outs.append(lse)
        grads.append(dlse)
    dq, dk, dv = torch.autograd.grad(outs, (q, k, v), grads)
    return out.detach(), lse.detach(), dq, dk, dv


def _check_all(q, k, v, dout, dlse=None, *, causal=False, scale=None):
    ours = _ours_fwd_bwd(q, k, v, dout, dlse, causal=causal, scale=scale)
    ref = reference_grads(q, k, v, dout, dlse, causal=causal, scale=scale)
    r32, pt = ref["ref"], ref["pt"]
    for name, i in (("out", 0), ("dq", 2), ("dk", 3), ("dv", 4)):
        assert ours[i].dtype == q.dtype, f"{name} has dtype {ours[i].dtype}, expected {q.dtype}"
        assert ours[i].shape == r32[i].shape
        check_precision(name, ours[i], r32[i], pt[i])
    check_lse(ours[1], r32[1])
    return ours


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_backward(case, dtype):
    b, sq, sk, h, hkv, d, causal, layout = case
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, layout=layout)
    before = [t.clone() for t in (q, k, v)]
    dout = torch.randn(b, sq, h, d).to(dtype)
    out, lse, dq, dk, dv = _check_all(q, k, v, dout, causal=causal)
    for t, t0 in zip((q, k, v), before):
        assert torch.equal(t, t0), "the inputs were modified"

    n_empty = empty_rows(sq, sk, causal)
    if n_empty:
        # Query rows with no key: out 0, lse -inf, no gradient.
        assert torch.equal(out[:, :n_empty], torch.zeros_like(out[:, :n_empty]))
        assert torch.isneginf(lse[:, :, :n_empty]).all()
        assert torch.equal(dq[:, :n_empty], torch.zeros_like(dq[:, :n_empty]))
        assert torch.isfinite(lse[:, :, n_empty:]).all()
    else:
        assert torch.isfinite(lse).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("scale", [0.05, 1.0, 2.5])
def test_custom_scale(scale, dtype):
    q, k, v = make_qkv(1, 37, 50, 4, 2, 64, dtype=dtype)
    dout = torch.randn(1, 37, 4, 64).to(dtype)
    _check_all(q, k, v, dout, causal=True, scale=scale)


def test_default_scale_is_inverse_sqrt_headdim():
    q, k, v = make_qkv(1, 20, 30, 2, 2, 96)
    a = flashcute.attention(q, k, v)
    b = flashcute.attention(q, k, v, scale=96 ** -0.5)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_return_lse():
    q, k, v = make_qkv(2, 9, 11, 2, 1, 32)
    out = flashcute.attention(q, k, v)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    res = flashcute.attention(q, k, v, return_lse=True)
    assert isinstance(res, tuple) and len(res) == 2
    out2, lse = res
    assert torch.equal(out, out2)
    assert lse.dtype == torch.float32 and lse.shape == (2, 2, 9)
    _, lse32, _ = reference_outputs(q, k, v)
    check_lse(lse, lse32)


def test_mixed_layouts_and_strided_dout():
    """q, k, v in three different layouts; the upstream gradient a transposed view."""
    dtype = torch.bfloat16
    q = randn((2, 50, 4, 64), dtype=dtype, layout="bhsd")
    k = randn((2, 70, 2, 64), dtype=dtype, layout="padded")
    v = randn((2, 70, 2, 64), dtype=dtype, layout="bshd")
    dout = randn((2, 50, 4, 64), dtype=dtype, layout="bhsd")
    assert not dout.is_contiguous()
    _check_all(q, k, v, dout, causal=True)


def test_gqa_equals_repeated_heads():
    q, k, v = make_qkv(1, 40, 60, 8, 2, 32)
    out = flashcute.attention(q, k, v, causal=True)
    out_rep = flashcute.attention(q, k.repeat_interleave(4, dim=2), v.repeat_interleave(4, dim=2),
                                  causal=True)
    torch.testing.assert_close(out, out_rep, rtol=1e-6, atol=1e-6)


def test_causal_square_is_lower_triangular():
    """causal with seqlen_q == seqlen_k: row i depends on keys 0..i only."""
    q, k, v = make_qkv(1, 30, 30, 2, 2, 32)
    out = flashcute.attention(q, k, v, causal=True)
    k2, v2 = k.clone(), v.clone()
    k2[:, 20:] = torch.randn_like(k2[:, 20:])
    v2[:, 20:] = torch.randn_like(v2[:, 20:])
    out2 = flashcute.attention(q, k2, v2, causal=True)
    assert torch.equal(out[:, :20], out2[:, :20])
    assert not torch.equal(out[:, 20:], out2[:, 20:])


# ---- empty inputs ------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape", [(0, 5, 7, 2, 2, 64), (2, 0, 7, 2, 2, 64), (2, 5, 0, 2, 1, 64), (2, 0, 0, 4, 2, 32)],
    ids=["batch0", "seqlen_q0", "seqlen_k0", "both0"])
def test_empty(shape, causal):
    b, sq, sk, h, hkv, d = shape
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, requires_grad=True)
    out, lse = flashcute.attention(q, k, v, causal=causal, return_lse=True)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32
    if sk == 0:
        # No key at all: every row is empty (out 0, lse -inf), as in the reference.
        assert torch.equal(out, torch.zeros_like(out))
        assert torch.isneginf(lse).all()
    out_ref, lse32, _ = reference_outputs(q, k, v, causal=causal)
    torch.testing.assert_close(out.detach(), out_ref.float())
    torch.testing.assert_close(lse, lse32)

    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for g in (dq, dk, dv):
        assert torch.equal(g, torch.zeros_like(g))


def test_empty_rows_only_lse_grad_is_finite():
    """causal with seqlen_q > seqlen_k and a loss on out: every gradient finite, empty rows 0."""
    q, k, v = make_qkv(1, 20, 8, 2, 2, 32, requires_grad=True)
    out = flashcute.attention(q, k, v, causal=True)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :12], torch.zeros_like(q.grad[:, :12]))


# ---- gradient through lse -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_lse_gradient(causal, dtype):
    q, k, v = make_qkv(2, 45, 80, 4, 2, 64, dtype=dtype)
    dout = torch.randn(2, 45, 4, 64).to(dtype)
    dlse = torch.randn(2, 4, 45)
    _check_all(q, k, v, dout, dlse, causal=causal)


def test_lse_only_loss():
    """A loss on lse alone (out unused): autograd hands the op no dout."""
    q, k, v = make_qkv(1, 33, 47, 4, 1, 32)
    qs, ks, vs = (t.clone().requires_grad_(True) for t in (q, k, v))
    _, lse = flashcute.attention(qs, ks, vs, causal=True, return_lse=True)
    (lse * torch.linspace(-1, 1, 33)).sum().backward()

    qr, kr, vr = (t.clone().requires_grad_(True) for t in (q, k, v))
    _, lse_r = flashcute.reference.attention(qr, kr, vr, causal=True, return_lse=True)
    (lse_r * torch.linspace(-1, 1, 33)).sum().backward()
    for name, a, b in (("dq", qs, qr), ("dk", ks, kr)):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    assert vr.grad is None  # lse does not depend on v ...
    assert vs.grad is None or torch.equal(vs.grad, torch.zeros_like(vs.grad))  # ... nor ours


def test_lse_gradient_with_empty_rows():
    """dlse on rows whose lse is -inf contributes nothing (no NaN); the rest matches."""
    q, k, v = make_qkv(1, 30, 10, 2, 2, 32)
    dout, dlse = torch.randn(1, 30, 2, 32), torch.randn(1, 2, 30)
    _, lse, dq, dk, dv = _check_all(q, k, v, dout, dlse, causal=True)
    assert torch.isneginf(lse[:, :, :20]).all()
    assert torch.equal(dq[:, :20], torch.zeros_like(dq[:, :20]))


# ---- determinism --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_deterministic_backward(dtype):
    q, k, v = make_qkv(2, 130, 97, 8, 2, 64, dtype=dtype, layout="bhsd")
    dout = torch.randn(2, 130, 8, 64).to(dtype)
    runs = [_ours_fwd_bwd(q, k, v, dout, causal=True, deterministic=True) for _ in range(2)]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), runs[0], runs[1]):
        assert torch.equal(a, b), f"{name} differs between two deterministic runs"


def test_deterministic_flag_does_not_change_forward():
    q, k, v = make_qkv(1, 50, 60, 2, 1, 64)
    a = flashcute.attention(q, k, v, causal=True, deterministic=True)
    b = flashcute.attention(q, k, v, causal=True, deterministic=False)
    assert torch.equal(a, b)


def test_autograd_backward_api():
    """Plain .backward() on a scalar loss, as in training code."""
    q, k, v = make_qkv(1, 24, 24, 4, 2, 64, requires_grad=True)
    out = flashcute.attention(q, k, v, causal=True)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    ref = reference_grads(q, k, v, g, causal=True)
    for t, r, p, name in zip((q, k, v), ref["ref"][2:], ref["pt"][2:], ("dq", "dk", "dv")):
        check_precision(name, t.grad, r, p)
