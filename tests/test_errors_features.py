"""Bad values of the v2 arguments raise a clear error that names the argument and the value.

SPEC v2, "Bad input": a window side < -1, softcap < 0 or not finite, ALiBi slopes of the wrong
shape / dtype / device or requiring grad, cu_seqlens of the wrong dtype / rank / device /
length -> RuntimeError / ValueError (TypeError for an argument of the wrong Python type or
tensor dtype) naming the argument, the value and what is allowed. cu_seqlens values are
checked in eager mode where that is cheap: on CPU tensors (non-monotone, cu[0] != 0, a
sequence longer than max_seqlen, cu[-1] past the tensor's rows).

Each bad call goes through the Python API (flashcute.attention / attention_varlen) and, where
the argument exists there, the raw op (torch.ops.flashcute.*) and its backward op. Known gaps
are xfail(strict=True) tests with the reason.
"""
from __future__ import annotations

import re

import pytest
import torch

import flashcute
from conftest import gpu, make_qkv, skip_if_no_kernel

ERRORS = (RuntimeError, ValueError)
OP = torch.ops.flashcute.attention
OP_BWD = torch.ops.flashcute.attention_backward
OP_VARLEN = torch.ops.flashcute.attention_varlen
OP_VARLEN_BWD = torch.ops.flashcute.attention_varlen_backward


def _raises(fn, *patterns, errors=ERRORS):
    """fn() raises one of `errors` whose message matches every regex in patterns."""
    with pytest.raises(errors) as info:
        fn()
    msg = str(info.value)
    skip_if_no_kernel(msg)  # a restricted build checks the kernel before the features
    for p in patterns:
        assert re.search(p, msg), f"message does not match {p!r}:\n{msg}"
    return msg


def _type_error(fn, *patterns):
    return _raises(fn, *patterns, errors=TypeError)


def _qkv(device="cpu"):
    """b=2, sq=8, sk=12, h=4, h_kv=2, d=32."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    return make_qkv(2, 8, 12, 4, 2, 32, dtype=dtype, device=device)


def _varlen(device="cpu"):
    """Three sequences: q lengths 5, 7, 8 (total 20), k lengths 10, 0, 20 (total 30); h 4, h_kv 2."""
    dtype = torch.float32 if device == "cpu" else torch.float16
    q = torch.randn(20, 4, 32, device=device).to(dtype)
    k = torch.randn(30, 2, 32, device=device).to(dtype)
    v = torch.randn(30, 2, 32, device=device).to(dtype)
    cu_q = torch.tensor([0, 5, 12, 20], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 10, 10, 30], dtype=torch.int32, device=device)
    return q, k, v, cu_q, cu_k, 8, 20


def _op_kwargs(window=(-1, -1), softcap=0.0, alibi_slopes=None):
    return dict(window_left=window[0], window_right=window[1], softcap=softcap, alibi_slopes=alibi_slopes)


def _all_dense(q, k, v, *patterns, errors=ERRORS, window=(-1, -1), softcap=0.0, alibi_slopes=None):
    """flashcute.attention, the op and its backward op all raise."""
    _raises(lambda: flashcute.attention(q, k, v, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes),
            *patterns, errors=errors)
    kw = _op_kwargs(window, softcap, alibi_slopes)
    _raises(lambda: OP(q, k, v, **kw), *patterns, errors=errors)
    out, lse = OP(q, k, v)
    _raises(lambda: OP_BWD(torch.ones_like(out), q, k, v, out, lse, None, False, 0.1, False, **kw), *patterns,
            errors=errors)


def _all_varlen(q, k, v, cu_q, cu_k, max_q, max_k, *patterns, errors=ERRORS, window=(-1, -1), softcap=0.0,
                alibi_slopes=None, backward=True):
    """flashcute.attention_varlen, the op and (backward=True) its backward op all raise."""
    _raises(lambda: flashcute.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, window_size=window,
                                               softcap=softcap, alibi_slopes=alibi_slopes), *patterns, errors=errors)
    kw = _op_kwargs(window, softcap, alibi_slopes)
    _raises(lambda: OP_VARLEN(q, k, v, cu_q, cu_k, max_q, max_k, **kw), *patterns, errors=errors)
    if backward:
        # The argument checks come before those of out / lse: zeros of the right shapes do.
        out, lse = torch.zeros_like(q), torch.zeros(q.shape[1], q.shape[0], device=q.device)
        _raises(lambda: OP_VARLEN_BWD(torch.ones_like(out), q, k, v, out, lse, None, cu_q, cu_k, max_q, max_k, False,
                                      0.1, False, **kw), *patterns, errors=errors)


# ---- window_size -----------------------------------------------------------------------------
@pytest.mark.parametrize("window", [(-2, 0), (0, -2), (-5, -5), (3, -100), (-2, -1)])
def test_window_side_below_minus_one(window):
    q, k, v = _qkv()
    pats = ("window_size", re.escape(f"({window[0]}, {window[1]})"), "-1", ">= 0")
    _all_dense(q, k, v, *pats, window=window)
    _all_varlen(*_varlen(), *pats, window=window)


def test_window_side_below_minus_one_with_causal():
    """causal forces R = 0, but a bad R is still an error (not silently ignored)."""
    q, k, v = _qkv()
    _raises(lambda: flashcute.attention(q, k, v, causal=True, window_size=(3, -2)), "window_size", r"-2")
    _raises(lambda: OP(q, k, v, True, window_right=-2), "window_size", r"-2")


@pytest.mark.parametrize("window", [(1,), (1, 2, 3), (1.0, 2), (1, 2.5), "12", None, 3, (True, 0), (0, False),
                                    (None, 0), torch.tensor([1, 2]), {1: 2, 3: 4}],
                         ids=["1-tuple", "3-tuple", "float-left", "float-right", "str", "None", "int", "bool-left",
                              "bool-right", "None-left", "tensor", "dict"])
def test_window_size_not_a_pair_of_ints(window):
    q, k, v = _qkv()
    pats = ("window_size", "pair of ints", re.escape(repr(window)[:20]))
    _type_error(lambda: flashcute.attention(q, k, v, window_size=window), *pats)
    _type_error(lambda: flashcute.attention_varlen(*_varlen(), window_size=window), *pats)


def test_window_size_list_and_numpy_ints_accepted():
    np = pytest.importorskip("numpy")
    q, k, v = _qkv()
    ref = flashcute.attention(q, k, v, window_size=(3, 1))
    assert torch.equal(flashcute.attention(q, k, v, window_size=[3, 1]), ref)
    assert torch.equal(flashcute.attention(q, k, v, window_size=(np.int64(3), np.int32(1))), ref)


@pytest.mark.parametrize("left", [-2 ** 70, 2 ** 70])
def test_window_side_out_of_int64_range(left):
    """Past int64 the dispatcher rejects the value; its message names the op's argument
    (window_left) and the value (it reads "Expected a value of type 'int' ... found type 'int'")."""
    q, k, v = _qkv()
    _raises(lambda: flashcute.attention(q, k, v, window_size=(left, 0)), "window_left|window_size", str(left),
            errors=(TypeError, ValueError, RuntimeError))


# ---- softcap ---------------------------------------------------------------------------------
@pytest.mark.parametrize("softcap,value", [(-1.0, "-1"), (-1e-30, "-1e-30"), (-float("inf"), "-inf"),
                                           (float("inf"), "inf"), (float("nan"), "nan")],
                         ids=["-1", "tiny-negative", "-inf", "inf", "nan"])
def test_softcap_bad_value(softcap, value):
    q, k, v = _qkv()
    pats = ("softcap", re.escape(value), ">= 0|finite")
    _all_dense(q, k, v, *pats, softcap=softcap)
    _all_varlen(*_varlen(), *pats, softcap=softcap)


@pytest.mark.parametrize("softcap", ["3", None, torch.tensor(3.0), [3.0], True, 1 + 2j],
                         ids=["str", "None", "tensor", "list", "bool", "complex"])
def test_softcap_not_a_number(softcap):
    q, k, v = _qkv()
    pats = ("softcap", "number", type(softcap).__name__)
    _type_error(lambda: flashcute.attention(q, k, v, softcap=softcap), *pats)
    _type_error(lambda: flashcute.attention_varlen(*_varlen(), softcap=softcap), *pats)


@pytest.mark.xfail(strict=True, reason="softcap=10**400 (a Python int too large for a double) raises a bare "
                                       "OverflowError 'int too large to convert to float' that does not name "
                                       "softcap")
def test_softcap_huge_int_named():
    q, k, v = _qkv()
    _raises(lambda: flashcute.attention(q, k, v, softcap=10 ** 400), "softcap",
            errors=(TypeError, ValueError, RuntimeError, OverflowError))


def test_softcap_zero_disables():
    q, k, v = _qkv()
    ref = flashcute.attention(q, k, v)
    assert torch.equal(flashcute.attention(q, k, v, softcap=0.0), ref)
    assert torch.equal(flashcute.attention(q, k, v, softcap=0), ref)
    assert torch.equal(flashcute.attention(q, k, v, softcap=-0.0), ref)


# ---- alibi_slopes ----------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(5,), (3,), (2, 5), (3, 4), (1, 4), (2, 4, 1), (4, 1), (), (0,), (8,)],
                         ids=lambda s: "x".join(map(str, s)) or "scalar")
def test_alibi_wrong_shape(shape):
    q, k, v = _qkv()  # b = 2, h = 4
    slopes = torch.rand(shape)
    pats = ("alibi_slopes", re.escape(str(list(shape))), r"\(4,\)", r"\(2, 4\)")
    _all_dense(q, k, v, *pats, alibi_slopes=slopes)


@pytest.mark.parametrize("shape", [(4, 4), (2, 4), (5,), (3, 2), (3, 4, 1)])
def test_alibi_wrong_shape_varlen(shape):
    """Varlen: (nheads,) or (num_sequences, nheads) = (3, 4)."""
    slopes = torch.rand(shape)
    pats = ("alibi_slopes", re.escape(str(list(shape))), r"\(4,\)", r"\(3, 4\)")
    _all_varlen(*_varlen(), *pats, alibi_slopes=slopes)


@pytest.mark.parametrize("dtype,name", [(torch.float64, "float64"), (torch.float16, "float16"),
                                        (torch.bfloat16, "bfloat16"), (torch.int32, "int32"), (torch.bool, "bool")])
def test_alibi_wrong_dtype(dtype, name):
    q, k, v = _qkv()
    slopes = torch.rand(4).to(dtype)
    pats = ("alibi_slopes", name, "float32")
    _all_dense(q, k, v, *pats, errors=TypeError, alibi_slopes=slopes)
    _all_varlen(*_varlen(), *pats, errors=TypeError, alibi_slopes=slopes)


def test_alibi_requires_grad():
    q, k, v = _qkv()
    slopes = torch.rand(4, requires_grad=True)
    pats = ("alibi_slopes", "requires grad|requires_grad", "detach")
    _raises(lambda: flashcute.attention(q, k, v, alibi_slopes=slopes), *pats)
    _raises(lambda: OP(q, k, v, alibi_slopes=slopes), *pats)
    _raises(lambda: flashcute.attention_varlen(*_varlen(), alibi_slopes=slopes), *pats)
    # detached slopes work
    flashcute.attention(q, k, v, alibi_slopes=slopes.detach())


@pytest.mark.xfail(strict=True, reason="alibi_slopes given as a Python list reaches the dispatcher, which raises "
                                       "RuntimeError (\"Expected a value of type 'Optional[Tensor]' for argument "
                                       "'alibi_slopes' but instead found type 'list'\"), not the SPEC's TypeError")
def test_alibi_not_a_tensor():
    q, k, v = _qkv()
    _type_error(lambda: flashcute.attention(q, k, v, alibi_slopes=[0.1] * 4), "alibi_slopes", "list")


@pytest.mark.xfail(strict=True, reason="alibi_slopes on the meta device with CPU q dispatches to the fake kernel, "
                                       "which checks no device and returns uninitialised out / lse on CPU (silently "
                                       "wrong); the fake kernel should check alibi_slopes.device == q.device")
def test_alibi_meta_device_with_cpu_q():
    q, k, v = _qkv()
    _raises(lambda: flashcute.attention(q, k, v, alibi_slopes=torch.rand(4, device="meta")), "alibi_slopes",
            "meta", "cpu")


@gpu
@pytest.mark.parametrize("where", ["slopes-cpu", "slopes-cuda"])
def test_alibi_wrong_device(where):
    on_cuda = where == "slopes-cpu"  # q, k, v on the other device
    q, k, v = _qkv("cuda" if on_cuda else "cpu")
    slopes = torch.rand(4, device="cpu" if on_cuda else "cuda")
    pats = ("alibi_slopes", "cpu", "cuda")
    _all_dense(q, k, v, *pats, alibi_slopes=slopes)
    _all_varlen(*_varlen("cuda" if on_cuda else "cpu"), *pats, alibi_slopes=slopes)


# ---- cu_seqlens ------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("dtype,name", [(torch.int64, "int64"), (torch.float32, "float32"), (torch.int16, "int16"),
                                        (torch.uint8, "uint8")])
def test_cu_seqlens_wrong_dtype(which, dtype, name):
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    if which == "cu_seqlens_q":
        cu_q = cu_q.to(dtype)
    else:
        cu_k = cu_k.to(dtype)
    _all_varlen(q, k, v, cu_q, cu_k, mq, mk, which, name, "int32", errors=TypeError)


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("shape", [(1, 4), (4, 1), (), (0,)], ids=["1x4", "4x1", "scalar", "empty"])
def test_cu_seqlens_wrong_rank(which, shape):
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    bad = torch.zeros(shape, dtype=torch.int32)
    if shape == (1, 4):
        bad = (cu_q if which == "cu_seqlens_q" else cu_k)[None]
    elif shape == (4, 1):
        bad = (cu_q if which == "cu_seqlens_q" else cu_k)[:, None]
    cu_q, cu_k = (bad, cu_k) if which == "cu_seqlens_q" else (cu_q, bad)
    _all_varlen(q, k, v, cu_q, cu_k, mq, mk, which, re.escape(str(list(shape))), "1-D")


def test_cu_seqlens_different_lengths():
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    _all_varlen(q, k, v, cu_q[:3], cu_k, mq, mk, "cu_seqlens_q", "cu_seqlens_k", r"\b3\b", r"\b4\b")
    _all_varlen(q, k, v, cu_q, torch.cat([cu_k, cu_k[-1:]]), mq, mk, "cu_seqlens_q", "cu_seqlens_k", r"\b4\b",
                r"\b5\b")


@pytest.mark.xfail(strict=True, reason="cu_seqlens given as a Python list reaches the dispatcher, which raises "
                                       "RuntimeError (\"Expected a value of type 'Tensor' for argument "
                                       "'cu_seqlens_q' but instead found type 'list'\"), not the SPEC's TypeError")
def test_cu_seqlens_not_a_tensor():
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    _type_error(lambda: flashcute.attention_varlen(q, k, v, cu_q.tolist(), cu_k, mq, mk), "cu_seqlens_q", "list")


@pytest.mark.xfail(strict=True, reason="cu_seqlens_q on the meta device with CPU q dispatches to the fake kernel, "
                                       "which checks no device and returns uninitialised out / lse (silently wrong)")
def test_cu_seqlens_meta_device_with_cpu_q():
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    _raises(lambda: flashcute.attention_varlen(q, k, v, cu_q.to("meta"), cu_k, mq, mk), "cu_seqlens_q", "meta")


@gpu
@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("qkv_device", ["cuda", "cpu"])
def test_cu_seqlens_wrong_device(which, qkv_device):
    q, k, v, cu_q, cu_k, mq, mk = _varlen(qkv_device)
    other = "cpu" if qkv_device == "cuda" else "cuda"
    if which == "cu_seqlens_q":
        cu_q = cu_q.to(other)
    else:
        cu_k = cu_k.to(other)
    _all_varlen(q, k, v, cu_q, cu_k, mq, mk, which, "cpu", "cuda")


# The values (checked on CPU tensors).
@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_not_monotone(which):
    q, k, v, cu_q, cu_k, _, _ = _varlen()
    bad = torch.tensor([0, 12, 5, 20] if which == "cu_seqlens_q" else [0, 20, 10, 30], dtype=torch.int32)
    cu_q, cu_k = (bad, cu_k) if which == "cu_seqlens_q" else (cu_q, bad)
    _all_varlen(q, k, v, cu_q, cu_k, 30, 30, which, "decreas|nondecreasing|monoton", r"\b12\b|\b20\b", r"\b5\b|\b10\b")


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
def test_cu_seqlens_negative_entry(which):
    q, k, v, cu_q, cu_k, _, _ = _varlen()
    bad = torch.tensor([0, -5, 12, 20] if which == "cu_seqlens_q" else [0, -1, 10, 30], dtype=torch.int32)
    cu_q, cu_k = (bad, cu_k) if which == "cu_seqlens_q" else (cu_q, bad)
    _all_varlen(q, k, v, cu_q, cu_k, 30, 30, which, "-5|-1")


@pytest.mark.parametrize("which", ["cu_seqlens_q", "cu_seqlens_k"])
@pytest.mark.parametrize("first", [1, 2, -1])
def test_cu_seqlens_first_not_zero(which, first):
    q, k, v, cu_q, cu_k, _, _ = _varlen()
    bad = (cu_q if which == "cu_seqlens_q" else cu_k).clone()
    bad[0] = first
    cu_q, cu_k = (bad, cu_k) if which == "cu_seqlens_q" else (cu_q, bad)
    _all_varlen(q, k, v, cu_q, cu_k, 30, 30, re.escape(which + "[0]"), rf"(?<![\d-]){first}\b", r"\b0\b")


@pytest.mark.parametrize("which", ["q", "k"])
def test_sequence_longer_than_max_seqlen(which):
    q, k, v, cu_q, cu_k, mq, mk = _varlen()  # longest: q 8 (sequence 2), k 20 (sequence 2)
    if which == "q":
        mq = 7
    else:
        mk = 19
    longest, limit = (8, 7) if which == "q" else (20, 19)
    _all_varlen(q, k, v, cu_q, cu_k, mq, mk, f"cu_seqlens_{which}", "max_seqlen", rf"\b{longest}\b", rf"\b{limit}\b")


@pytest.mark.parametrize("which", ["q", "k"])
def test_cu_seqlens_past_the_rows(which):
    q, k, v, cu_q, cu_k, mq, mk = _varlen()  # totals: q 20, k 30
    if which == "q":
        cu_q = torch.tensor([0, 5, 12, 21], dtype=torch.int32)
        mq = 9
    else:
        cu_k = torch.tensor([0, 10, 10, 31], dtype=torch.int32)
        mk = 21
    total, end = (20, 21) if which == "q" else (30, 31)
    _all_varlen(q, k, v, cu_q, cu_k, mq, mk, re.escape(f"cu_seqlens_{which}[-1]"), rf"\b{end}\b", rf"\b{total}\b")


def test_cu_seqlens_good_edge_values_accepted():
    """Not errors: max_seqlen larger than every length, rows past cu[-1], empty sequences,
    a non-contiguous cu_seqlens, no sequence at all."""
    q, k, v, cu_q, cu_k, _, _ = _varlen()
    flashcute.attention_varlen(q, k, v, cu_q, cu_k, 100, 100)
    flashcute.attention_varlen(q, k, v, torch.tensor([0, 5, 5, 15], dtype=torch.int32),
                               torch.tensor([0, 0, 10, 25], dtype=torch.int32), 10, 15)
    strided = torch.tensor([0, 9, 5, 9, 12, 9, 20, 9], dtype=torch.int32)[::2]
    assert not strided.is_contiguous()
    a = flashcute.attention_varlen(q, k, v, strided, cu_k, 8, 20)
    assert torch.equal(a, flashcute.attention_varlen(q, k, v, cu_q, cu_k, 8, 20))
    none = torch.zeros(1, dtype=torch.int32)
    assert (flashcute.attention_varlen(q, k, v, none, none, 0, 0) == 0).all()


# ---- max_seqlen ------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("value", [8.0, "8", None, True, torch.tensor(8), [8]],
                         ids=["float", "str", "None", "bool", "tensor", "list"])
def test_max_seqlen_not_an_int(which, value):
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    mq, mk = (value, 20) if which == "max_seqlen_q" else (8, value)
    _type_error(lambda: flashcute.attention_varlen(q, k, v, cu_q, cu_k, mq, mk), which, "int",
                type(value).__name__)


@pytest.mark.parametrize("which", ["max_seqlen_q", "max_seqlen_k"])
@pytest.mark.parametrize("value", [-1, -100, 2 ** 31])
def test_max_seqlen_out_of_range(which, value):
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    mq, mk = (value, 20) if which == "max_seqlen_q" else (8, value)
    _all_varlen(q, k, v, cu_q, cu_k, mq, mk, which, rf"(?<!\d){re.escape(str(value))}\b", backward=value > 0)


def test_max_seqlen_past_int64():
    """Past int64 the dispatcher rejects the value, naming max_seqlen_q and the value."""
    q, k, v, cu_q, cu_k, _, mk = _varlen()
    _raises(lambda: flashcute.attention_varlen(q, k, v, cu_q, cu_k, 2 ** 70, mk), "max_seqlen_q", str(2 ** 70),
            errors=(TypeError, ValueError, RuntimeError))


# ---- q, k, v of varlen --------------------------------------------------------------------------
@pytest.mark.parametrize("which,shape", [("q", (1, 20, 4, 32)), ("q", (20, 128)), ("k", (30, 64)),
                                         ("k", (1, 30, 2, 32)), ("v", (1, 30, 2, 32)), ("v", (30,))])
def test_varlen_wrong_rank(which, shape):
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    t = torch.randn(shape)
    q, k, v = (t if n == which else x for n, x in zip("qkv", (q, k, v)))
    _all_varlen(q, k, v, cu_q, cu_k, mq, mk, rf"\b{which}\b", "3-D", re.escape(str(list(shape))), backward=False)


def test_varlen_shape_rules_of_attention():
    """The dense shape rules hold for the packed tensors too."""
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    _all_varlen(torch.randn(20, 3, 32), k, v, cu_q, cu_k, mq, mk, "nheads", r"\b3\b", r"\b2\b", backward=False)
    _all_varlen(q, k, torch.randn(31, 2, 32), cu_q, cu_k, mq, mk, r"\bk\b", r"\bv\b", backward=False)
    _all_varlen(q, k, v[..., :16], cu_q, cu_k, mq, mk, "head ?dim", backward=False)
    _all_varlen(q.double(), k.double(), v.double(), cu_q, cu_k, mq, mk, r"\bq\b", "dtype", "Double|float64",
                errors=TypeError, backward=False)
    _all_varlen(torch.randn(20, 4, 12), torch.randn(30, 2, 12), torch.randn(30, 2, 12), cu_q, cu_k, mq, mk,
                "headdim", r"\b12\b", backward=False)


def test_varlen_dropout_out_of_range():
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    with pytest.raises(ValueError, match=r"dropout_p is 1\.5; it must be in \[0, 1\)"):
        flashcute.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, dropout_p=1.5)


def test_errors_leave_no_state():
    """After bad calls, good calls work and give the same result as before."""
    q, k, v, cu_q, cu_k, mq, mk = _varlen()
    before = flashcute.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, window_size=(3, 1), softcap=2.0)
    for bad in (dict(window_size=(-3, 0)), dict(softcap=float("nan")), dict(alibi_slopes=torch.rand(7))):
        with pytest.raises(ERRORS):
            flashcute.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, **bad)
    with pytest.raises(ERRORS):
        flashcute.attention_varlen(q, k, v, cu_q.flip(0), cu_k, mq, mk)
    after = flashcute.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, window_size=(3, 1), softcap=2.0)
    assert torch.equal(before, after)
