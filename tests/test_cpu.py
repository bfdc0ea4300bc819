"""The CPU backend of torch.ops.flashcute.attention against flashcute.reference.

Forward (out, lse) and backward (dq, dk, dv) under the SPEC's criterion, for float32,
float16 and bfloat16, over a representative grid of odd sizes, GQA ratios, causal on/off
(bottom-right aligned) and memory layouts; the default scale, GQA as repeated heads, the
gradient through lse alone and on rows with no key, deterministic=True in the forward.

The properties that the CUDA kernels share (custom scales, mixed layouts, empty inputs, the
gradient through lse, the bitwise reproducible backward) are tested on both devices in
test_cuda.py; both files check through conftest's check_attention.
"""
from __future__ import annotations

import pytest
import torch

import flashcute
from conftest import (check_attention, check_lse, check_precision, empty_rows, make_qkv,
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


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_backward(case, dtype):
    b, sq, sk, h, hkv, d, causal, layout = case
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, layout=layout)
    before = [t.clone() for t in (q, k, v)]
    dout = torch.randn(b, sq, h, d).to(dtype)
    out, lse, dq, dk, dv = check_attention(q, k, v, dout, causal=causal)
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


def test_empty_rows_only_lse_grad_is_finite():
    """causal with seqlen_q > seqlen_k and a loss on out: every gradient finite, empty rows 0."""
    q, k, v = make_qkv(1, 20, 8, 2, 2, 32, requires_grad=True)
    out = flashcute.attention(q, k, v, causal=True)
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[:, :12], torch.zeros_like(q.grad[:, :12]))


# ---- gradient through lse -----------------------------------------------------------------
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
    _, lse, dq, dk, dv = check_attention(q, k, v, dout, dlse, causal=True)
    assert torch.isneginf(lse[:, :, :20]).all()
    assert torch.equal(dq[:, :20], torch.zeros_like(dq[:, :20]))


# ---- determinism --------------------------------------------------------------------------
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
