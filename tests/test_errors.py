"""Bad input raises a clear RuntimeError / ValueError that names the argument and the value.

SPEC, "Bad input": wrong dtype, device mismatch, wrong rank or shape, nheads not a multiple
of nheads_kv, headdim unsupported, stride(-1) != 1 -> a RuntimeError or ValueError naming
the argument, the value and what is allowed; a tensor of the wrong dtype (q, k, v) is a
TypeError, as is a block_mask of the wrong type;
malformed block masks are tested in test_block_sparse.py and test_masks.py.
"""
from __future__ import annotations

import re

import pytest
import torch

import flashcute
from conftest import gpu, make_qkv

ERRORS = (RuntimeError, ValueError)


def _raises(fn, *patterns, errors=ERRORS):
    """fn() raises one of `errors` (RuntimeError/ValueError by default) whose message matches every
    regex in patterns."""
    with pytest.raises(errors) as info:
        fn()
    msg = str(info.value)
    for p in patterns:
        assert re.search(p, msg), f"message does not match {p!r}:\n{msg}"
    return msg


def _both(q, k, v, *patterns, errors=ERRORS, **kw):
    """Checks flashcute.attention and the raw op torch.ops.flashcute.attention."""
    _raises(lambda: flashcute.attention(q, k, v, **kw), *patterns, errors=errors)
    _raises(lambda: torch.ops.flashcute.attention(q, k, v, kw.get("causal", False),
                                                  kw.get("scale"), False), *patterns, errors=errors)


# ---- dtype --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,name", [(torch.float64, "Double"), (torch.int32, "Int"),
                                        (torch.int64, "Long"), (torch.float8_e4m3fn, "Float8")])
def test_wrong_dtype(dtype, name):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    q, k, v = (t.to(dtype) if dtype.is_floating_point else (t * 10).to(dtype) for t in (q, k, v))
    _both(q, k, v, r"\bq\b", "dtype", name, "float32", "float16", "bfloat16", errors=TypeError)


@pytest.mark.parametrize("which", ["k", "v"])
def test_dtype_mismatch(which):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    if which == "k":
        k = k.half()
    else:
        v = v.bfloat16()
    _both(q, k, v, rf"\b{which}\b", "dtype", "Half" if which == "k" else "BFloat16", "Float", errors=TypeError)


# ---- device --------------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_device_mismatch(which):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32, dtype=torch.float16)
    q, k, v = (t.cuda() if n != which else t for n, t in zip("qkv", (q, k, v)))
    other = "k" if which == "q" else which
    _both(q, k, v, rf"\b{other}\b", "cpu", "cuda")


@gpu
def test_cuda_float32_rejected():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32, device="cuda")
    _both(q, k, v, r"\bq\b", "Float", "float16", "bfloat16", errors=TypeError)


# ---- rank and shapes -----------------------------------------------------------------------
@pytest.mark.parametrize("which,shape", [("q", (8, 2, 32)), ("k", (1, 8, 2, 32, 1)),
                                         ("v", (1, 8, 64)), ("q", (1, 1, 8, 2, 32))])
def test_wrong_rank(which, shape):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    t = torch.randn(shape)
    q, k, v = (t if n == which else x for n, x in zip("qkv", (q, k, v)))
    dims = re.escape(str(list(shape)))
    _both(q, k, v, rf"\b{which}\b", "4-D", dims)


def test_batch_mismatch():
    q, _, _ = make_qkv(2, 8, 8, 2, 2, 32)
    _, k, v = make_qkv(3, 8, 8, 2, 2, 32)
    _both(q, k, v, "batch", r"\[2, 8, 2, 32\]", r"\[3, 8, 2, 32\]")


def test_headdim_mismatch_q_k():
    q, _, _ = make_qkv(1, 8, 8, 2, 2, 64)
    _, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    _both(q, k, v, "head ?dim", "64", "32")


def test_headdim_mismatch_k_v():
    q, k, _ = make_qkv(1, 8, 8, 2, 2, 64)
    v = torch.randn(1, 8, 2, 32)
    _both(q, k, v, "head ?dim", r"\bv\b", "32")


@pytest.mark.parametrize("vshape", [(1, 9, 2, 32), (1, 8, 1, 32)], ids=["seqlen", "heads"])
def test_k_v_mismatch(vshape):
    q, k, _ = make_qkv(1, 8, 8, 2, 2, 32)
    v = torch.randn(vshape)
    _both(q, k, v, r"\bk\b", r"\bv\b", re.escape(str(list(vshape))))


@pytest.mark.parametrize("h,hkv", [(6, 4), (3, 2), (4, 0), (1, 2)])
def test_nheads_not_multiple(h, hkv):
    q, k, v = make_qkv(1, 8, 8, h, hkv, 32)
    _both(q, k, v, "nheads", rf"\b{h}\b", rf"\b{hkv}\b", "multiple")


@pytest.mark.parametrize("d", [12, 264, 4, 100, 512])
def test_headdim_unsupported(d):
    q, k, v = make_qkv(1, 8, 8, 2, 2, d)
    _both(q, k, v, "headdim", rf"\b{d}\b", "multiple of 8", "256")


# ---- strides -------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_stride_last_not_one(which):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    strided = torch.randn(1, 8, 2, 64)[..., ::2]  # stride(-1) == 2
    assert strided.stride(-1) == 2
    q, k, v = (strided if n == which else x for n, x in zip("qkv", (q, k, v)))
    _both(q, k, v, rf"\b{which}\b", r"stride\(-1\)", r"\b2\b")


def test_transposed_headdim_rejected():
    """A (b, s, d, h) tensor seen as (b, s, h, d): stride(-1) != 1."""
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    q = torch.randn(1, 8, 32, 2).transpose(2, 3)
    _both(q, k, v, r"\bq\b", r"stride\(-1\)")


# ---- other arguments ------------------------------------------------------------------------
@pytest.mark.parametrize("scale", [float("nan"), float("inf")])
def test_scale_not_finite(scale):
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    _both(q, k, v, "scale", "nan|inf", scale=scale)


def test_block_mask_wrong_type():
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    with pytest.raises(TypeError, match="block_mask must be a flashcute.BlockSparseMask, got object"):
        flashcute.attention(q, k, v, block_mask=object())


def test_errors_leave_no_state():
    """After a bad call the op still works."""
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    with pytest.raises(TypeError):
        flashcute.attention(q.double(), k.double(), v.double())
    out = flashcute.attention(q, k, v)
    assert torch.isfinite(out).all()
