"""The v2 score features through the op: sliding windows, softcap, ALiBi, their combinations
(with causal, block-sparse masks and GQA) and packed variable-length batches.

Everything is checked against ``flashcute.reference`` (out, lse, dq, dk, dv, with the gradient
flowing through lse as well) under the SPEC criterion: max|ours - ref32| <= 2 x max|pt - ref32|
+ 1e-5 (1e-4 for the gradients of float16/bfloat16 inputs), 3x with softcap; lse within 1e-3
and -inf exactly where the reference has -inf; rows that see no key get out 0 and zero dq,
keys that no row sees get zero dk and dv. On the CPU backend always (small shapes, float32
and a few float16/bfloat16 cases) and on CUDA (marker ``gpu``; float16/bfloat16, larger
shapes) under each kernel family of ``flashcute.kernels`` that the build and the GPU have.

- a feature table (dense, causal, every window shape (0,0) (L,0) (0,R) (L,R) (-1,R) (L,-1),
  windows wider than the sequence, softcap, ALiBi with (h,) and (b,h) slopes, and the pairs
  causal+window, window+softcap, causal+alibi, window+alibi+softcap, block_mask+window)
  crossed with odd lengths, seqlen_q < / > seqlen_k (bottom-right alignment, rows with no
  key), padded head dims (40, 72) and GQA ratios 1, 2 and 4;
- the window edges where a side becomes unbounded (L = seqlen_k - 1, R = seqlen_q - 1);
- varlen: packed batches from padded random lengths (empty sequences on either side, one
  sequence, max_seqlen larger than every length, rows past cu_seqlens[-1] in q and in k/v),
  against reference.attention_varlen and against flashcute.attention on each sequence;
  lse layout (nheads, total_q); bitwise reproducible deterministic gradients;
- torch.library.opcheck of attention / attention_backward with the new arguments and of
  attention_varlen / attention_varlen_backward; torch.compile(fullgraph=True) of modules that
  call them; v1-style positional calls.
"""
from __future__ import annotations

import re

import pytest
import torch
import torch.nn as nn

import flashcute
from flashcute import BlockSparseMask, reference
from conftest import TARGETS, make_qkv, on, or_skip, precision_numbers, prepare_softcap, ref_dtype, target_cases

# (device, kernel family): the CPU backend, and CUDA under each family (skipped where the build
# or the GPU lacks it).
CPU_BLOCK = (16, 32)    # block-sparse masks on CPU: small blocks, several per sequence
CUDA_BLOCK = (128, 128)  # the CUDA kernels serve multiples of 128




# ---- the shared forward + backward check ------------------------------------------------------
def _check(name, ours, ref, pt, *, mult=2.0, atol=1e-5):
    """SPEC criterion: max|ours - ref| <= mult * max|pt - ref| + atol; NaN-free."""
    assert ours.shape == ref.shape == pt.shape, \
        f"{name}: shapes differ: ours {tuple(ours.shape)}, ref {tuple(ref.shape)}, pt {tuple(pt.shape)}"
    assert torch.isfinite(ref).all(), f"{name}: the reference is not finite"
    n_bad = (~torch.isfinite(ours)).sum().item()
    assert n_bad == 0, f"{name}: {n_bad} non-finite values in ours (the reference has none)"
    err, bound2 = precision_numbers(ours, ref, pt)
    base = (bound2 - 1e-5) / 2
    bound = mult * base + atol
    assert err <= bound, (f"{name}: max|ours - ref| = {err:.3e} > {mult:g} * max|pt - ref| + {atol:g} = "
                          f"{bound:.3e} (max|pt - ref| = {base:.3e}, max|ref| = {ref.abs().max().item():.3e})")


def _check_lse(ours, ref, name="lse"):
    assert ours.dtype == torch.float32, f"{name}: dtype {ours.dtype}"
    assert ours.shape == ref.shape, f"{name}: shape {tuple(ours.shape)}, expected {tuple(ref.shape)}"
    ref = ref.float()
    ref_empty, ours_empty = torch.isneginf(ref), torch.isneginf(ours)
    assert torch.equal(ref_empty, ours_empty), (
        f"{name}: -inf at {ours_empty.sum().item()} entries, the reference at {ref_empty.sum().item()} "
        f"(first difference at {tuple(x.item() for x in (ref_empty != ours_empty).nonzero()[0])})")
    fin = ~ref_empty
    assert torch.isfinite(ours[fin]).all(), f"{name}: non-finite values where the reference is finite"
    err = (ours[fin] - ref[fin]).abs().max().item() if fin.any() else 0.0
    assert err <= 1e-3, f"{name}: max|ours - ref| = {err:.3e} > 1e-3"


def _ref_fwd_bwd(q, k, v, dout, dlse, dtype, upcast, varlen, kw):
    q, k, v = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
    if varlen is None:
        out, lse = reference.attention(q, k, v, return_lse=True, upcast=upcast, **kw)
    else:
        out, lse = reference.attention_varlen(q, k, v, *varlen, return_lse=True, upcast=upcast, **kw)
    outs, grads = [out], [dout.to(out.dtype)]
    if dlse is not None:
        outs.append(lse.masked_fill(torch.isneginf(lse), 0.0))  # -inf rows: no gradient (inf * 0)
        grads.append(dlse.to(lse.dtype))
    gs = torch.autograd.grad(outs, (q, k, v), grads, allow_unused=True)
    gs = [g if g is not None else torch.zeros_like(t) for g, t in zip(gs, (q, k, v))]
    return (out.detach(), lse.detach().float(), *gs)


def reference_fwd_bwd(q, k, v, dout, dlse=None, varlen=None, **kw):
    """{"ref": (out, lse, dq, dk, dv), "pt": (...)} of the reference with every feature kwarg:
    ref on float32 copies (float64 for float32 inputs, as conftest's reference_grads), pt in
    the inputs' dtype."""
    rd = ref_dtype(q.dtype)
    return {"ref": _ref_fwd_bwd(q, k, v, dout, dlse, rd, rd == torch.float32 and q.dtype != torch.float32,
                                varlen, kw),
            "pt": _ref_fwd_bwd(q, k, v, dout, dlse, q.dtype, False, varlen, kw)}


def ours_fwd_bwd(q, k, v, dout, dlse=None, varlen=None, **kw):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    if varlen is None:
        out, lse = or_skip(lambda: flashcute.attention(q, k, v, return_lse=True, **kw))
    else:
        out, lse = or_skip(lambda: flashcute.attention_varlen(q, k, v, *varlen, return_lse=True, **kw))
    outs, grads = [out], [dout]
    if dlse is not None:
        outs.append(lse)
        grads.append(dlse)
    dq, dk, dv = torch.autograd.grad(outs, (q, k, v), grads)
    return out.detach(), lse.detach(), dq, dk, dv


def check_fwd_bwd(q, k, v, *, varlen=None, with_dlse=True, **kw):
    """ours vs the reference: out, lse, dq, dk, dv; empty rows and unseen keys exactly zero.

    q, k, v: (b, s, h, d), or packed (total, h, d) with varlen = (cu_q, cu_k, max_q, max_k).
    Returns ours and the float32/64 reference, each (out, lse, dq, dk, dv)."""
    dout = torch.randn_like(q)
    lse_shape = (q.shape[1], q.shape[0]) if varlen is not None else (q.shape[0], q.shape[2], q.shape[1])
    dlse = torch.randn(lse_shape, device=q.device) if with_dlse else None
    ours = ours_fwd_bwd(q, k, v, dout, dlse, varlen, **kw)
    refs = reference_fwd_bwd(q, k, v, dout, dlse, varlen, **kw)
    ref, pt = refs["ref"], refs["pt"]
    low = q.dtype != torch.float32
    mult = 3.0 if kw.get("softcap", 0.0) > 0 else 2.0
    for i, name in ((0, "out"), (2, "dq"), (3, "dk"), (4, "dv")):
        assert ours[i].dtype == q.dtype, f"{name}: dtype {ours[i].dtype}, expected {q.dtype}"
        _check(name, ours[i], ref[i], pt[i], mult=mult, atol=1e-4 if (low and i > 0) else 1e-5)
    _check_lse(ours[1], ref[1])

    # Rows with no visible key: out 0 and dq 0 exactly (lse -inf is checked above).
    empty = torch.isneginf(ref[1])  # (b, h, sq) or (h, total_q)
    empty = empty.transpose(0, 1) if varlen is not None else empty.permute(0, 2, 1)  # like q[..., 0]
    if empty.any():
        assert (ours[0][empty] == 0).all(), "out is not 0 on rows that see no key"
        assert (ours[2][empty] == 0).all(), "dq is not 0 on rows that see no key"
    # Keys that no row sees: zero dk and dv exactly (the reference's are exactly 0 there).
    unseen = (ref[4] == 0).all(-1) & (ref[3] == 0).all(-1)
    if unseen.any():
        assert (ours[3][unseen] == 0).all(), "dk is not 0 on keys that no row sees"
        assert (ours[4][unseen] == 0).all(), "dv is not 0 on keys that no row sees"
    return ours, ref


# ---- the feature table ------------------------------------------------------------------------
# name -> kwargs; "alibi": "h" | "bh" | "n" (varlen, per sequence); "block_mask": density.
FEATURES = {
    "dense": {},
    "causal": dict(causal=True),
    "win(0,0)": dict(window_size=(0, 0)),
    "win(L,0)": dict(window_size=(7, 0)),
    "win(0,R)": dict(window_size=(0, 5)),
    "win(L,R)": dict(window_size=(7, 5)),
    "win(-1,R)": dict(window_size=(-1, 3)),
    "win(L,-1)": dict(window_size=(9, -1)),
    "win(L,R)-wide": dict(window_size=(150, 70)),
    "win-huge": dict(window_size=(100000, 100000)),  # wider than every sequence: dense
    "softcap": dict(softcap=3.0),
    "alibi(h)": dict(alibi="h"),
    "alibi(b,h)": dict(alibi="bh"),
    "causal+win": dict(causal=True, window_size=(6, 5)),  # causal forces R = 0
    "win+softcap": dict(window_size=(5, 3), softcap=3.0),
    "causal+alibi": dict(causal=True, alibi="h"),
    "win+alibi+softcap": dict(window_size=(8, 2), alibi="bh", softcap=3.0),
    "block_mask+win": dict(window_size=(20, 10), block_mask=0.5),
    "causal+block_mask+alibi+softcap": dict(causal=True, block_mask=0.6, alibi="h", softcap=3.0),
}

# (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, dtype)
CPU_SHAPES = {
    "sq=sk-odd-d40": (2, 37, 37, 2, 2, 40, torch.float32),
    "sq<sk-gqa4-d72": (1, 29, 83, 4, 1, 72, torch.float32),
    "sq>sk-gqa2-bf16": (2, 83, 29, 4, 2, 32, torch.bfloat16),   # rows with no key (causal, windows)
    "tiles-sq<sk-fp16": (1, 70, 130, 2, 1, 64, torch.float16),  # CPU tiles are 64 x 64
    "decode": (1, 1, 45, 4, 4, 64, torch.float32),
}
CUDA_SHAPES = {
    "sq=sk-gqa4-d128-bf16": (2, 300, 300, 4, 1, 128, torch.bfloat16),
    "sq<sk-d72-fp16": (1, 200, 1000, 4, 4, 72, torch.float16),
    "sq>sk-gqa2-d64-bf16": (1, 700, 257, 8, 2, 64, torch.bfloat16),
    "d40-fp16": (2, 129, 255, 2, 2, 40, torch.float16),
    "decode-d256-fp16": (2, 1, 513, 4, 1, 256, torch.float16),
}


def alibi_slopes(kind, batch, nheads, device):
    """float32 slopes in [0, 0.3) (as flash-attn's tests): (h,) or (b, h)."""
    if kind is None:
        return None
    shape = (nheads,) if kind == "h" else (batch, nheads)
    return (torch.rand(shape, device=device) * 0.3).float()


def random_block_mask(b, h, sq, sk, block, density, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    nq, nkv = -(-sq // block[0]), -(-sk // block[1])
    bitmap = torch.rand((b, h, nq, nkv), generator=gen) < density
    return BlockSparseMask.from_dense(bitmap.to(device), block, block_level=True)


def feature_kwargs(feature, b, h, sq, sk, device):
    """The flashcute.attention kwargs of a FEATURES entry."""
    kw = dict(feature)
    kw["alibi_slopes"] = alibi_slopes(kw.pop("alibi", None), b, h, device)
    density = kw.pop("block_mask", None)
    if density is not None:
        block = CPU_BLOCK if device == "cpu" else CUDA_BLOCK
        kw["block_mask"] = random_block_mask(b, h, sq, sk, block, density, device)
    return kw


def _cases():
    """(target, shape) pairs: CPU shapes on CPU, CUDA shapes on each CUDA family."""
    return target_cases(CPU_SHAPES, CUDA_SHAPES)


@pytest.mark.parametrize("feature", list(FEATURES), ids=list(FEATURES))
@pytest.mark.parametrize("target,shape", _cases())
def test_feature_table(target, shape, feature):
    check_feature_case(target, shape, feature)


def check_feature_case(target, shape, feature, **extra):
    """check_fwd_bwd of one FEATURES entry (plus `extra` kwargs) on a shape of CPU_/CUDA_SHAPES."""
    b, sq, sk, h, hkv, d, dtype = shape
    device = target[0]
    kw = feature_kwargs(FEATURES[feature], b, h, sq, sk, device)
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, device=device)
    q = prepare_softcap(q, kw)
    with on(target):
        check_fwd_bwd(q, k, v, **kw, **extra)


# ---- persistent CTAs (the sm90 forward, include/flashcute/sm90/fwd_launch.h) ----------------------
# Short key ranges and more tiles than SMs: each CTA walks several tiles (dense calls every
# grid-th tile, causal and windowed ones pairs of query blocks, longest with shortest), the next
# tile's Q and K loading while O is stored. Odd numbers of query blocks (pairs across heads), rows
# without keys, GQA and the score modifications on that path; the other families run them too.
PERSISTENT_SHAPES = {
    "causal-5-blocks-gqa4-d64": ((8, 640, 640, 8, 2, 64, torch.bfloat16), "causal"),
    "causal-sq>sk-d128": ((8, 900, 640, 8, 8, 128, torch.bfloat16), "causal"),
    "win+alibi+softcap-d96-fp16": ((4, 1024, 1024, 16, 4, 96, torch.float16), "win+alibi+softcap"),
    "dense-mqa-d128": ((16, 512, 512, 8, 1, 128, torch.bfloat16), "dense"),
    "dense-d32-fp16": ((40, 256, 300, 8, 8, 32, torch.float16), "dense"),
}


@pytest.mark.parametrize("target,case", target_cases({}, PERSISTENT_SHAPES))
def test_persistent_tiles(target, case):
    shape, feature = case
    check_feature_case(target, shape, feature)


# ---- the sm90 forward's tiles (include/flashcute/sm90/fwd_launch.h) ------------------------------
# d <= 64: dense calls and causal or windowed ones with key ranges over 4096 run 192-row tiles
# (three consumer warpgroups); short causal or windowed ones 128. Keys per step: plain d128 dense
# calls over 4096 keys 176 (shorter, causal or with dropout or softcap 128); plain d192 / d256
# calls 112 / 80, with dropout, softcap or ALiBi 96 / 64. name ->
# (shape, kwargs, rows, keys): odd lengths (partial last tiles), seqlen_q < seqlen_k
# (bottom-right), GQA, dropout on the tall tile. Kernels with the features' code (dropout, softcap,
# ALiBi) run the calls that have one; plain calls run twins without it (MainloopFwd's last template
# argument, fwd_launch.h).
TALL_TILE_CASES = {
    "dense-d64": ((2, 700, 900, 4, 2, 64, torch.bfloat16), {}, 192, 128),
    "dense-d32-fp16-dropout": ((2, 500, 333, 4, 4, 32, torch.float16), dict(dropout_p=0.2), 192, 128),
    "causal-short-d64": ((2, 600, 600, 4, 1, 64, torch.bfloat16), dict(causal=True), 128, 128),
    "causal-long-d64": ((1, 1000, 4500, 2, 1, 64, torch.bfloat16), dict(causal=True), 192, 128),
    "causal-long-d32": ((1, 4400, 4400, 2, 2, 32, torch.float16), dict(causal=True), 192, 128),
    "window-wide-d64": ((1, 4700, 4700, 2, 2, 64, torch.bfloat16), dict(window_size=(3000, 1500)), 192, 128),
    "window-narrow-d64": ((1, 4700, 4700, 2, 2, 64, torch.bfloat16), dict(window_size=(256, 256)), 128, 128),
    "dense-long-d128": ((1, 700, 4500, 4, 2, 128, torch.bfloat16), {}, 128, 176),
    "dense-long-d128-fp16-mqa": ((2, 130, 5000, 4, 1, 128, torch.float16), {}, 128, 176),
    "dense-long-d128-dropout": ((1, 300, 4500, 2, 2, 128, torch.bfloat16), dict(dropout_p=0.2), 128, 128),
    "dense-long-d128-softcap": ((1, 300, 4500, 2, 2, 128, torch.bfloat16), dict(softcap=5.0), 128, 128),
    "dense-short-d128": ((2, 500, 4096, 2, 2, 128, torch.bfloat16), {}, 128, 128),
    "dense-d256": ((1, 600, 900, 2, 1, 256, torch.bfloat16), {}, 128, 80),
    "causal-d256-fp16": ((2, 300, 700, 2, 2, 256, torch.float16), dict(causal=True), 128, 80),
    "dense-d256-softcap": ((1, 300, 500, 2, 2, 256, torch.bfloat16), dict(softcap=5.0), 128, 64),
    "window-d192": ((1, 500, 800, 4, 2, 192, torch.bfloat16), dict(window_size=(100, 50)), 128, 112),
    "dense-d192-dropout": ((1, 300, 500, 2, 1, 192, torch.bfloat16), dict(dropout_p=0.2), 128, 96),
}


def with_rng_state(kw, state):
    """kw with a fixed CUDA rng_state when it has dropout: the reference applies
    flashcute.dropout_mask of that state."""
    if kw.get("dropout_p", 0.0) > 0:
        return dict(kw, rng_state=torch.tensor(state, dtype=torch.int64, device="cuda"))
    return kw


@pytest.mark.parametrize("target,case", target_cases({}, TALL_TILE_CASES))
def test_query_tile_rows(target, case):
    """out, lse and the gradients against the reference; under the sm90 family, the forward
    kernel that ran has the expected tile: query rows and keys per step (profiler kernel names)."""
    (b, sq, sk, h, hkv, d, dtype), kw, rows, keys = case
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, device="cuda")
    kw = with_rng_state(kw, [7, 11])
    with on(target):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            check_fwd_bwd(q, k, v, with_dlse=False, **kw)
            torch.cuda.synchronize()
    if target[1] == "sm90":
        names = [e.name for e in prof.events() if "sm90::flashcute_fwd_kernel" in e.name]
        assert names and all(f"FwdTraits<{d}, {rows}, {keys}," in n for n in names), names
        plain = not (kw.get("dropout_p", 0.0) > 0 or kw.get("softcap", 0.0) > 0 or kw.get("alibi_slopes") is not None)
        features = keys % 32 == 0 and not plain
        assert all(re.search(r"AttentionMask<[^<>]*>, %s>" % ("true" if features else "false"), n) for n in names), names


# Calls with dropout, softcap or ALiBi run the windowed mask policies even without a window or
# causal mask (common/dispatch.h; issue 18: their dense variants were a third of each backward
# unit's kernels); plain calls keep the dense ones. name -> (FEATURES-style kwargs, the mask
# policy of the backward kernels, and of the sm80 forward's, as the profiler names them).
WINDOWED_FEATURE_CASES = {
    "plain": ({}, "AttentionMask<false, false"),
    "dropout": (dict(dropout_p=0.2), "AttentionMask<true, false"),
    "softcap": (dict(softcap=3.0), "AttentionMask<true, false"),
    "alibi": (dict(alibi="h"), "AttentionMask<true, false"),
    "block_mask+dropout": (dict(block_mask=0.5, dropout_p=0.2), "AttentionMask<true, true"),
}


@pytest.mark.parametrize("target,case", target_cases({}, WINDOWED_FEATURE_CASES))
def test_feature_calls_run_windowed_kernels(target, case):
    """out, lse and the gradients against the reference, and the mask policy of the kernels that
    ran (the sm90 forward has the features as run-time branches: not checked)."""
    feature, mask = case
    b, sq, sk, h, hkv, d = 2, 300, 400, 4, 2, 64
    kw = feature_kwargs(feature, b, h, sq, sk, "cuda")
    kw = with_rng_state(kw, [5, 3])
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=torch.bfloat16, device="cuda")
    q = prepare_softcap(q, kw)
    from flashcute.info import build_info
    if mask.startswith("AttentionMask<false") and (build_info() or {}).get("dense_kernels") is False:
        pytest.skip("this build runs plain calls on the windowed kernels (FLASHCUTE_DENSE_KERNELS=OFF)")
    with on(target):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            check_fwd_bwd(q, k, v, with_dlse=False, **kw)
            torch.cuda.synchronize()
    family = target[1]
    kernels = [f"{family}::flashcute_bwd_kernel"] + (["sm80::flashcute_fwd_kernel"] if family == "sm80" else [])
    for kernel in kernels:
        names = [e.name for e in prof.events() if kernel in e.name]
        assert names and all(mask in n for n in names), (kernel, names)


# Kernel-name pieces of the mask policies (common/mask.h: AttentionMask<kWindow, kSparse, kPack,
# kLeftEdge>; common/dispatch.h: CausalMask, PaddedCausalMask).
CAUSAL_KERNEL = "AttentionMask<true, false, false, false>"
PADDED_CAUSAL_KERNEL = "PaddedCausalMask"
WINDOW_KERNEL = "AttentionMask<true, false, false, true>"
CAUSAL_POLICY_CASES = {  # kwargs, packed batch, forward's mask, sm80 backward's mask
    "causal": (dict(causal=True), False, CAUSAL_KERNEL, PADDED_CAUSAL_KERNEL),
    "window(-1,0)": (dict(window_size=(-1, 0)), False, CAUSAL_KERNEL, PADDED_CAUSAL_KERNEL),
    "causal-packed": (dict(causal=True), True, CAUSAL_KERNEL, WINDOW_KERNEL),
    "window(-1,3)": (dict(window_size=(-1, 3)), False, WINDOW_KERNEL, WINDOW_KERNEL),
    "window(8,0)": (dict(window_size=(8, 0)), False, WINDOW_KERNEL, WINDOW_KERNEL),
}


@pytest.mark.parametrize("target,case", target_cases({}, CAUSAL_POLICY_CASES))
def test_causal_calls_run_causal_kernels(target, case):
    """Plain causal calls (the window (-1, 0)) run forward kernels with the causal mask at compile
    time (common/dispatch.h: CausalMask), other windows the windowed ones; the sm80 backward runs
    its causal kernel (PaddedCausalMask: the sequence bounds params') for padded batches and the
    windowed one for packed batches, the sm90 backward always the windowed one; out, lse and the
    gradients against the reference."""
    kw, packed, fwd_mask, bwd_mask = case
    from flashcute.info import build_info
    if (build_info() or {}).get("causal_kernels") is False:  # FLASHCUTE_CAUSAL_KERNELS=OFF
        fwd_mask = bwd_mask = WINDOW_KERNEL
    family = target[1]
    if family == "sm90":
        bwd_mask = WINDOW_KERNEL
    if packed:
        q, k, v, *varlen = make_varlen([300, 170], [400, 260], 4, 2, 64, dtype=torch.bfloat16, device="cuda")
    else:
        q, k, v = make_qkv(2, 300, 400, 4, 2, 64, dtype=torch.bfloat16, device="cuda")
        varlen = None
    with on(target):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            check_fwd_bwd(q, k, v, varlen=varlen, with_dlse=False, **kw)
            torch.cuda.synchronize()
    expected = {f"{family}::flashcute_fwd_kernel": fwd_mask, f"{family}::flashcute_bwd_kernel": bwd_mask}
    for kernel, want in expected.items():
        names = [e.name for e in prof.events() if kernel in e.name]
        assert names and all(want in n for n in names), (kernel, want, names)


# ---- windows: edges, equivalences, empty rows ---------------------------------------------------
def _win_cases():
    out = []
    for t in TARGETS:
        device = t.values[0][0]
        shapes = [(1, 40, 70, 2, 1, 32), (1, 70, 40, 2, 2, 32)] if device == "cpu" else \
            [(1, 300, 700, 4, 2, 64), (1, 700, 300, 4, 4, 64)]
        for s in shapes:
            out.append(pytest.param(t.values[0], s, id=f"{t.id}-sq{s[1]}-sk{s[2]}", marks=t.marks))
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("target,shape", _win_cases())
def test_window_edges(target, shape, causal):
    """Windows around the points where a side becomes unbounded (L >= seqlen_k - 1,
    R >= seqlen_q - 1): the result must follow the formula on each side of the edge."""
    b, sq, sk, h, hkv, d = shape
    device = target[0]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=dtype, device=device)
    with on(target):
        for left in (sk - 2, sk - 1, sk, -1, 0):
            for right in (sq - 2, sq - 1, sq, -1, 0):
                check_fwd_bwd(q, k, v, causal=causal, window_size=(left, right), with_dlse=False)


@pytest.mark.parametrize("target", TARGETS)
def test_rows_without_keys(target):
    """seqlen_q > seqlen_k with a window that leaves the first rows no key: those rows get
    out 0, lse -inf and zero dq; keys outside every window get zero dk, dv."""
    device = target[0]
    dtype = torch.float32 if device == "cpu" else torch.float16
    sq, sk = (50, 20) if device == "cpu" else (500, 200)
    q, k, v = make_qkv(2, sq, sk, 4, 2, 64, dtype=dtype, device=device)
    # p_i = i - (sq - sk); window (0, 3): row i sees [p_i, p_i + 3] -> rows i < sq - sk - 3 see nothing.
    n_empty = sq - sk - 3
    slopes = alibi_slopes("bh", 2, 4, device)
    with on(target):
        ours, ref = check_fwd_bwd(q, k, v, window_size=(0, 3), alibi_slopes=slopes, softcap=2.0)
    out, lse, dq, dk, dv = ours
    assert torch.isneginf(lse[:, :, :n_empty]).all() and torch.isfinite(lse[:, :, n_empty:]).all()
    assert (out[:, :n_empty] == 0).all() and (dq[:, :n_empty] == 0).all()
    q, k, v = make_qkv(1, sq, sk, 2, 2, 64, dtype=dtype, device=device)
    with on(target):
        ours, _ = check_fwd_bwd(q, k, v, window_size=(0, 0))  # the diagonal: rows < sq - sk empty
    assert torch.isneginf(ours[1][:, :, :sq - sk]).all() and torch.isfinite(ours[1][:, :, sq - sk:]).all()
    # No key at all (seqlen_k = 0) with a window: every row empty, every gradient zero.
    with on(target):
        ours, _ = check_fwd_bwd(q, k[:, :0], v[:, :0], window_size=(3, 0), softcap=2.0)
    assert torch.isneginf(ours[1]).all() and (ours[0] == 0).all() and (ours[2] == 0).all()


@pytest.mark.parametrize("target", TARGETS)
def test_window_equivalences(target):
    """(-1, 0) is causal; causal=True ignores R; a window wider than the sequence is dense
    (compared within rounding, not bitwise: different code paths may be taken)."""
    device = target[0]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    s = (45, 60) if device == "cpu" else (300, 400)
    q, k, v = make_qkv(1, s[0], s[1], 4, 2, 64, dtype=dtype, device=device)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    with on(target):
        f = lambda **kw: flashcute.attention(q, k, v, return_lse=True, **kw)  # noqa: E731
        pairs = [
            (f(causal=True), f(window_size=(-1, 0))),
            (f(causal=True, window_size=(5, 9)), f(window_size=(5, 0))),
            (f(causal=True, window_size=(5, 9)), f(causal=True, window_size=(5, 0))),
            (f(), f(window_size=(s[1] + 10, s[0] + 10))),
            (f(), f(window_size=(s[1] - 1, s[0] - 1))),
            (f(causal=True), f(causal=True, window_size=(s[1], -1))),
            (f(softcap=0.0), f()),
        ]
    for i, ((oa, la), (ob, lb)) in enumerate(pairs):
        torch.testing.assert_close(oa.float(), ob.float(), **tol, msg=lambda m, i=i: f"pair {i} out: {m}")
        torch.testing.assert_close(la, lb, rtol=1e-5, atol=1e-4, msg=lambda m, i=i: f"pair {i} lse: {m}")


@pytest.mark.parametrize("softcap", [30.0, 50.0])
@pytest.mark.parametrize("target", TARGETS)
def test_softcap_large(target, softcap):
    """Gemma-2 / Grok caps (30, 50) with q scaled by the cap (flash-attn's test), so that the
    logits reach +-c, in float16 / bfloat16, with a window, ALiBi and GQA."""
    device = target[0]
    sq, sk = (45, 77) if device == "cpu" else (333, 777)
    for dtype, extra in ((torch.bfloat16, dict(window_size=(20, 4))), (torch.float16, dict(alibi="bh"))):
        q, k, v = make_qkv(2, sq, sk, 4, 2, 64, dtype=dtype, device=device)
        kw = feature_kwargs(dict(softcap=softcap, **extra), 2, 4, sq, sk, device)
        with on(target):
            check_fwd_bwd(prepare_softcap(q, kw), k, v, **kw)


@pytest.mark.parametrize("kw", [
    pytest.param(dict(softcap=1e39), marks=pytest.mark.xfail(
        strict=True, reason="softcap=1e39 is finite as a double but overflows float32: the CPU backend returns "
                            "out 0 and lse -inf on every row instead of (about) the uncapped result")),
    pytest.param(dict(softcap=1e-50), marks=pytest.mark.xfail(
        strict=True, reason="softcap=1e-50 > 0 underflows to 0.0f: the CPU backend then runs without a cap "
                            "(the reference's scores are +-1e-50, i.e. uniform attention)")),
    pytest.param(dict(scale=1e39), marks=pytest.mark.xfail(
        strict=True, reason="scale=1e39 is finite as a double but overflows float32: out is NaN")),
    dict(softcap=1e-40),  # a float32 denormal: still a cap
    dict(softcap=1e30),
], ids=["softcap=1e39", "softcap=1e-50", "scale=1e39", "softcap=1e-40", "softcap=1e30"])
def test_extreme_finite_values(kw):
    """Finite values at float32's edges: a clear error naming the argument, or the reference's
    result (the float64 math); never a silently wrong one."""
    q, k, v = make_qkv(1, 8, 8, 2, 2, 32)
    try:
        out, lse = flashcute.attention(q, k, v, return_lse=True, **kw)
    except ValueError as e:
        assert list(kw)[0] in str(e), str(e)
        return
    ref, ref_lse = reference.attention(q.double(), k.double(), v.double(), return_lse=True, upcast=False, **kw)
    assert torch.isfinite(out).all(), "non-finite out"
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse.double(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("target", TARGETS)
def test_alibi_broadcast_slopes(target):
    """(h,) slopes equal the same slopes expanded to (b, h); per-batch slopes differ by batch."""
    device = target[0]
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v = make_qkv(3, 33, 47, 4, 2, 32, dtype=dtype, device=device)
    sl = alibi_slopes("h", 3, 4, device)
    with on(target):
        a = or_skip(lambda: flashcute.attention(q, k, v, alibi_slopes=sl, causal=True, return_lse=True))
        b = flashcute.attention(q, k, v, alibi_slopes=sl.expand(3, 4).contiguous(), causal=True, return_lse=True)
        # non-contiguous (b, h) slopes (stride(-1) != 1 after the transpose)
        c = flashcute.attention(q, k, v, alibi_slopes=sl.expand(3, 4).t().contiguous().t(), causal=True,
                                return_lse=True)
    for x, y in (*zip(a, b), *zip(a, c)):
        if device == "cpu":
            assert torch.equal(x, y)
        else:  # the same kernel, maybe not the same instruction order
            torch.testing.assert_close(x.float(), y.float(), rtol=0, atol=2e-3)


@pytest.mark.parametrize("target", TARGETS)
def test_deterministic_features(target):
    """deterministic=True: bitwise the same gradients run to run, with every feature on."""
    device = target[0]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    sq, sk = (70, 90) if device == "cpu" else (700, 900)
    q, k, v = make_qkv(2, sq, sk, 4, 1, 64, dtype=dtype, device=device)
    kw = dict(causal=True, window_size=(30, 0), softcap=4.0, alibi_slopes=alibi_slopes("bh", 2, 4, device),
              deterministic=True)
    dout = torch.randn_like(q)
    dlse = torch.randn(2, 4, sq, device=device)
    with on(target):
        a = ours_fwd_bwd(q, k, v, dout, dlse, **kw)
        b = ours_fwd_bwd(q, k, v, dout, dlse, **kw)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), f"{name} differs between two deterministic runs"


# ---- varlen ----------------------------------------------------------------------------------
def make_varlen(lens_q, lens_k, h, hkv, d, *, dtype, device, extra_q=0, extra_k=0, max_extra=0):
    """A packed batch built from padded random tensors: sequence s has lens_q[s] query rows and
    lens_k[s] keys. extra_q / extra_k rows follow cu_seqlens[-1] (belong to no sequence).
    Returns q, k, v (total, h, d), cu_q, cu_k, max_q, max_k and the padded tensors."""
    n = len(lens_q)
    sq, sk = max(lens_q + [1]), max(lens_k + [1])
    qp, kp, vp = make_qkv(n, sq, sk, h, hkv, d, dtype=dtype, device=device)
    mq = torch.arange(sq)[None, :] < torch.tensor(lens_q)[:, None]   # the padding masks
    mk = torch.arange(sk)[None, :] < torch.tensor(lens_k)[:, None]
    mq, mk = mq.to(device), mk.to(device)
    q = torch.cat([qp[mq], torch.randn(extra_q, h, d, device=device).to(dtype)])
    k = torch.cat([kp[mk], torch.randn(extra_k, hkv, d, device=device).to(dtype)])
    v = torch.cat([vp[mk], torch.randn(extra_k, hkv, d, device=device).to(dtype)])
    cu = lambda lens: torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()),  # noqa: E731
                                   dtype=torch.int32, device=device)
    return q, k, v, cu(lens_q), cu(lens_k), max(lens_q + [0]) + max_extra, max(lens_k + [0]) + max_extra


def random_lengths(n, max_len, seed, zero_every=0):
    """Random lengths in [1, max_len] (flash-attn's padding masks); every zero_every-th 0."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, max_len + 1, (n,), generator=g).tolist()
    if zero_every:
        lens = [0 if (i % zero_every == zero_every - 1) else x for i, x in enumerate(lens)]
    return lens


# name -> (lens_q, lens_k, nheads, nheads_kv, headdim, extra_q, extra_k, max_extra)
CPU_VARLEN = {
    "self-attn": ([5, 17, 3, 40], [5, 17, 3, 40], 2, 2, 32, 0, 0, 0),
    "empty-seqs+tail-rows": ([5, 0, 17, 3, 0, 9], [9, 4, 0, 12, 0, 6], 4, 2, 40, 3, 5, 0),
    "single-seq-gqa4": ([70], [130], 4, 1, 64, 0, 0, 3),
    "sq>sk-per-seq": ([30, 8, 65], [10, 8, 2], 2, 1, 72, 2, 0, 5),
    "random": (random_lengths(7, 50, 1, zero_every=3), random_lengths(7, 60, 2, zero_every=4), 4, 4, 32, 1, 2, 2),
}
CUDA_VARLEN = {
    "self-attn": ([130, 1, 700, 255, 64], [130, 1, 700, 255, 64], 4, 1, 128, 0, 0, 0),
    "empty-seqs+tail-rows": ([300, 0, 517, 33, 0, 129], [129, 257, 0, 1000, 0, 77], 8, 2, 64, 13, 70, 0),
    "single-seq": ([1000], [1500], 4, 4, 96, 0, 0, 17),
    # key ranges over 4096: the d128 dense call runs the 176-key tile (sm90 fwd_launch.h)
    "long-keys-d128": ([300, 0, 45], [5000, 700, 4300], 4, 2, 128, 0, 3, 0),
    "random-d72": (random_lengths(9, 400, 3, zero_every=4), random_lengths(9, 600, 4, zero_every=5), 4, 2, 72,
                   5, 9, 3),
}
VARLEN_FEATURES = {
    "dense": {},
    "causal": dict(causal=True),
    "win(4,2)": dict(window_size=(4, 2)),
    "win(-1,3)": dict(window_size=(-1, 3)),
    "win(L,-1)": dict(window_size=(6, -1)),
    "softcap": dict(softcap=3.0),
    "alibi(n,h)": dict(alibi="n"),
    "alibi(h)": dict(alibi="h"),
    "causal+win+alibi+softcap": dict(causal=True, window_size=(10, 3), alibi="n", softcap=3.0),
}


def _varlen_cases():
    return target_cases(CPU_VARLEN, CUDA_VARLEN)


def _varlen_kwargs(feature, n, h, device):
    kw = dict(feature)
    kind = kw.pop("alibi", None)
    kw["alibi_slopes"] = alibi_slopes({"n": "bh", "h": "h", None: None}[kind], n, h, device)
    return kw


@pytest.mark.parametrize("feature", list(VARLEN_FEATURES), ids=list(VARLEN_FEATURES))
@pytest.mark.parametrize("target,case", _varlen_cases())
def test_varlen(target, case, feature):
    lens_q, lens_k, h, hkv, d, extra_q, extra_k, max_extra = case
    device = target[0]
    dtype = torch.float32 if device == "cpu" else (torch.bfloat16 if h % 8 else torch.float16)
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, h, hkv, d, dtype=dtype, device=device,
                                                    extra_q=extra_q, extra_k=extra_k, max_extra=max_extra)
    kw = _varlen_kwargs(VARLEN_FEATURES[feature], len(lens_q), h, device)
    q = prepare_softcap(q, kw)
    with on(target):
        ours, _ = check_fwd_bwd(q, k, v, varlen=(cu_q, cu_k, max_q, max_k), **kw)
    out, lse, dq, dk, dv = ours
    assert lse.shape == (h, q.shape[0])
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    # Rows past cu_seqlens[-1]: out 0, lse -inf, zero gradients.
    assert (out[tq:] == 0).all() and torch.isneginf(lse[:, tq:]).all() and (dq[tq:] == 0).all()
    assert (dk[tk:] == 0).all() and (dv[tk:] == 0).all()
    # Sequences with queries but no keys: empty rows.
    for s in range(len(lens_q)):
        if lens_k[s] == 0 and lens_q[s] > 0:
            assert torch.isneginf(lse[:, int(cu_q[s]):int(cu_q[s + 1])]).all()


def _per_sequence_cases():
    out = []
    for t in TARGETS:
        device = t.values[0][0]
        cases = CPU_VARLEN if device == "cpu" else CUDA_VARLEN
        for name in ("empty-seqs+tail-rows", "random" if device == "cpu" else "random-d72"):
            out.append(pytest.param(t.values[0], cases[name], id=f"{t.id}-{name}", marks=t.marks))
    return out


@pytest.mark.parametrize("feature", ["causal", "causal+win+alibi+softcap", "win(-1,3)"])
@pytest.mark.parametrize("target,case", _per_sequence_cases())
def test_varlen_matches_per_sequence(target, case, feature):
    """attention_varlen on a packed batch == flashcute.attention on each sequence alone (1, s, h, d),
    with (n, h) slopes split per sequence; lse (nheads, total_q) holds each sequence's lse."""
    lens_q, lens_k, h, hkv, d, extra_q, extra_k, max_extra = case
    device = target[0]
    dtype = torch.float32 if device == "cpu" else torch.float16
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, h, hkv, d, dtype=dtype, device=device,
                                                    extra_q=extra_q, extra_k=extra_k, max_extra=max_extra)
    n = len(lens_q)
    kw = _varlen_kwargs(VARLEN_FEATURES[feature], n, h, device)
    q = prepare_softcap(q, kw)
    dout = torch.randn_like(q)
    dlse = torch.randn(h, q.shape[0], device=device)
    with on(target):
        out, lse, dq, dk, dv = ours_fwd_bwd(q, k, v, dout, dlse, (cu_q, cu_k, max_q, max_k), **kw)
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=2e-3)
        for s in range(n):
            a, e = int(cu_q[s]), int(cu_q[s + 1])
            ak, ek = int(cu_k[s]), int(cu_k[s + 1])
            kws = dict(kw)
            if kws["alibi_slopes"] is not None:
                kws["alibi_slopes"] = kws["alibi_slopes"][s]
            one = ours_fwd_bwd(q[a:e][None], k[ak:ek][None], v[ak:ek][None], dout[a:e][None],
                               dlse[:, a:e][None], **kws)
            for name, x, y in (("out", out[a:e], one[0][0]), ("dq", dq[a:e], one[2][0]),
                               ("dk", dk[ak:ek], one[3][0]), ("dv", dv[ak:ek], one[4][0])):
                torch.testing.assert_close(x.float(), y.float(), **tol,
                                           msg=lambda m, s=s, name=name: f"sequence {s} {name}: {m}")
            assert torch.equal(torch.isneginf(lse[:, a:e]), torch.isneginf(one[1][0])), f"sequence {s} lse -inf"
            fin = torch.isfinite(one[1][0])
            torch.testing.assert_close(lse[:, a:e][fin], one[1][0][fin], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("target", TARGETS)
def test_varlen_deterministic(target):
    device = target[0]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    case = CPU_VARLEN["empty-seqs+tail-rows"] if device == "cpu" else CUDA_VARLEN["empty-seqs+tail-rows"]
    lens_q, lens_k, h, hkv, d, extra_q, extra_k, _ = case
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, h, hkv, d, dtype=dtype, device=device,
                                                    extra_q=extra_q, extra_k=extra_k)
    kw = dict(causal=True, window_size=(7, 0), softcap=3.0,
              alibi_slopes=alibi_slopes("bh", len(lens_q), h, device), deterministic=True)
    dout, dlse = torch.randn_like(q), torch.randn(h, q.shape[0], device=device)
    varlen = (cu_q, cu_k, max_q, max_k)
    with on(target):
        a = ours_fwd_bwd(q, k, v, dout, dlse, varlen, **kw)
        b = ours_fwd_bwd(q, k, v, dout, dlse, varlen, **kw)
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b):
        assert torch.equal(x, y), f"{name} differs between two deterministic runs"


@pytest.mark.parametrize("deterministic", [False, True], ids=["counter", "deterministic"])
@pytest.mark.parametrize("target", [t for t in TARGETS if t.values[0][0] == "cuda"])
def test_varlen_backward_many_key_tiles(target, deterministic):
    """More key tiles than an H100 has SMs (960), with empty and short sequences among them: the
    sm90 backward's persistent CTAs each walk several key tiles (taken from a counter, or a
    deterministic split's), skipping the tiles past a sequence's end, under the criterion."""
    lens_q = [0, 900, 3, 0, 517, 1, 260, 1024, 0, 77] * 3
    lens_k = [129, 1000, 0, 5, 517, 300, 260, 1024, 0, 640] * 3
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, 8, 4, 64, dtype=torch.bfloat16, device="cuda",
                                                    extra_q=5, extra_k=9)
    with on(target):
        check_fwd_bwd(q, k, v, varlen=(cu_q, cu_k, max_q, max_k), causal=True, deterministic=deterministic)


@pytest.mark.parametrize("target", TARGETS)
def test_varlen_edge_batches(target):
    """No sequence at all (cu = [0]); only empty sequences; total 0 rows; every row past the end."""
    device = target[0]
    dtype = torch.float32 if device == "cpu" else torch.float16
    with on(target):
        # cu_seqlens = [0]: every row is outside every sequence.
        q, k, v = (torch.randn(s, 2, 32, device=device).to(dtype) for s in (5, 7, 7))
        cu = torch.zeros(1, dtype=torch.int32, device=device)
        out, lse = or_skip(lambda: flashcute.attention_varlen(q, k, v, cu, cu, 0, 0, return_lse=True))
        assert (out == 0).all() and torch.isneginf(lse).all() and lse.shape == (2, 5)
        # Only empty sequences, max_seqlen 0, q and k rows all past the end.
        z = torch.zeros(4, dtype=torch.int32, device=device)
        ours, _ = check_fwd_bwd(q, k, v, varlen=(z, z, 0, 0))
        assert (ours[0] == 0).all() and all((g == 0).all() for g in ours[2:])
        # Empty tensors.
        q0, k0, v0 = (torch.randn(0, 2, 32, device=device).to(dtype) for _ in range(3))
        cu2 = torch.zeros(3, dtype=torch.int32, device=device)
        out, lse = flashcute.attention_varlen(q0, k0, v0, cu2, cu2, 4, 4, return_lse=True)
        assert out.shape == (0, 2, 32) and lse.shape == (2, 0)
        # Queries but no keys anywhere.
        lq = [3, 4]
        cq = torch.tensor([0, 3, 7], dtype=torch.int32, device=device)
        ck = torch.zeros(3, dtype=torch.int32, device=device)
        qq = torch.randn(7, 2, 32, device=device).to(dtype)
        ours, _ = check_fwd_bwd(qq, k0, v0, varlen=(cq, ck, max(lq), 0))
        assert torch.isneginf(ours[1]).all()


@pytest.mark.parametrize("target", TARGETS)
def test_varlen_packed_qkv_views(target):
    """q, k, v as slices of one packed (total, 3, h, d) tensor (stride(-1) == 1, rows not
    packed), as flash-attn's qkvpacked callers pass them."""
    device = target[0]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    lens = [13, 0, 40, 7] if device == "cpu" else [130, 0, 400, 77]
    total = sum(lens)
    qkv = torch.randn(total, 3, 4, 64, device=device).to(dtype)
    q, k, v = qkv.unbind(1)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    with on(target):
        check_fwd_bwd(q, k, v, varlen=(cu, cu, max(lens), max(lens)), causal=True, window_size=(9, 0),
                      alibi_slopes=alibi_slopes("h", 4, 4, device))


# ---- opcheck -----------------------------------------------------------------------------------
OP = torch.ops.flashcute.attention
OP_BWD = torch.ops.flashcute.attention_backward
OP_VARLEN = torch.ops.flashcute.attention_varlen
OP_VARLEN_BWD = torch.ops.flashcute.attention_varlen_backward
def _dtype_of(device):
    return torch.float32 if device == "cpu" else torch.float16


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", [
    dict(causal=False, window=(5, 3), softcap=2.0, alibi="h"),
    dict(causal=True, window=(-1, -1), softcap=0.0, alibi="bh"),
    dict(causal=False, window=(0, -1), softcap=30.0, alibi=None),
], ids=["win+softcap+alibi(h)", "causal+alibi(b,h)", "win(0,-1)+softcap"])
def test_opcheck_attention_features(target, case):
    device = target[0]
    b, sq, sk, h, hkv, d = 2, 21, 33, 4, 2, 40
    q, k, v = make_qkv(b, sq, sk, h, hkv, d, dtype=_dtype_of(device), device=device, requires_grad=True)
    slopes = alibi_slopes(case["alibi"], b, h, device)
    args = (q, k, v, case["causal"], None, False, None, None, None, None, [128, 128], *case["window"],
            case["softcap"], slopes)
    with on(target):
        or_skip(lambda: _opcheck_attention(q, k, v, args, case, slopes, d))


def _opcheck_attention(q, k, v, args, case, slopes, d):
    torch.library.opcheck(OP, args)
    torch.library.opcheck(OP, (q, k, v), dict(causal=case["causal"], window_left=case["window"][0],
                                              window_right=case["window"][1], softcap=case["softcap"],
                                              alibi_slopes=slopes, deterministic=True))
    with torch.no_grad():
        out, lse = OP(*args)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    for dl in (None, dlse):
        torch.library.opcheck(OP_BWD, (dout, q.detach(), k.detach(), v.detach(), out, lse, dl, case["causal"],
                                       d ** -0.5, False, None, None, None, None, [128, 128], *case["window"],
                                       case["softcap"], slopes))


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("features", [dict(), dict(causal=True, window=(4, 0), softcap=3.0, alibi=True)],
                         ids=["plain", "causal+win+softcap+alibi"])
def test_opcheck_varlen(target, features):
    device = target[0]
    lens_q, lens_k, h, hkv, d = [5, 0, 17, 3], [9, 4, 0, 12], 4, 2, 32
    q, k, v, cu_q, cu_k, max_q, max_k = make_varlen(lens_q, lens_k, h, hkv, d, dtype=_dtype_of(device),
                                                    device=device, extra_q=2, extra_k=3, max_extra=1)
    slopes = alibi_slopes("bh", 4, h, device) if features.get("alibi") else None
    causal = features.get("causal", False)
    window = features.get("window", (-1, -1))
    softcap = features.get("softcap", 0.0)
    for t in (q, k, v):
        t.requires_grad_(True)
    args = (q, k, v, cu_q, cu_k, max_q, max_k, causal, None, False, *window, softcap, slopes)
    with on(target):
        or_skip(lambda: _opcheck_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, slopes, d, args))


def _opcheck_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, window, softcap, slopes, d, args):
    torch.library.opcheck(OP_VARLEN, args)
    torch.library.opcheck(OP_VARLEN, (q, k, v, cu_q, cu_k, max_q, max_k),
                          dict(causal=causal, window_left=window[0], window_right=window[1], softcap=softcap,
                               alibi_slopes=slopes, deterministic=True))
    with torch.no_grad():
        out, lse = OP_VARLEN(*args)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    for dl in (None, dlse):
        torch.library.opcheck(OP_VARLEN_BWD, (dout, q.detach(), k.detach(), v.detach(), out, lse, dl, cu_q, cu_k,
                                              max_q, max_k, causal, d ** -0.5, False, *window, softcap, slopes))


# ---- torch.compile -------------------------------------------------------------------------------
class FeatureBlock(nn.Module):
    """qkv projection -> flashcute.attention (GQA, window, softcap, ALiBi) -> out projection;
    or, with cu_seqlens, the same on a packed batch through attention_varlen."""

    def __init__(self, dim=64, nheads=4, nheads_kv=2, headdim=32, batch=2):
        super().__init__()
        self.h, self.hkv, self.d = nheads, nheads_kv, headdim
        self.qkv = nn.Linear(dim, (nheads + 2 * nheads_kv) * headdim)
        self.proj = nn.Linear(nheads * headdim, dim)
        self.register_buffer("slopes", torch.rand(batch, nheads) * 0.3)

    def _split(self, x):
        q, k, v = self.qkv(x).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        shape = x.shape[:-1]
        return q.view(*shape, self.h, self.d), k.view(*shape, self.hkv, self.d), v.view(*shape, self.hkv, self.d)

    def forward(self, x, cu_seqlens=None, max_seqlen=None):
        q, k, v = self._split(x)
        if cu_seqlens is None:
            o, lse = flashcute.attention(q, k, v, causal=True, window_size=(9, 0), softcap=5.0,
                                         alibi_slopes=self.slopes, return_lse=True)
        else:
            o, lse = flashcute.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                                window_size=(6, 2), softcap=5.0, alibi_slopes=self.slopes,
                                                return_lse=True)
        lse = lse.masked_fill(torch.isneginf(lse), 0.0)
        return self.proj(o.flatten(-2)), lse


def _train_step(model, x, *args):
    y, lse = model(x, *args)
    loss = (y * y).mean() + 1e-2 * lse.mean()
    grads = torch.autograd.grad(loss, [x] + list(model.parameters()))
    return loss.detach(), y.detach(), grads


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("varlen", [False, True], ids=["padded", "varlen"])
def test_compile_fullgraph_features(target, varlen):
    device = target[0]
    torch._dynamo.reset()
    model = FeatureBlock().to(device)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = model.to(dtype)
    model.slopes = model.slopes.float()
    if varlen:
        lens = [13, 0, 21] if device == "cpu" else [130, 0, 210]
        x = torch.randn(sum(lens) + 3, 64, device=device, dtype=dtype, requires_grad=True)
        cu = torch.tensor([0, lens[0], lens[0], lens[0] + lens[2]], dtype=torch.int32, device=device)
        model.slopes = torch.rand(3, 4, device=device) * 0.3
        args = (cu, max(lens))
    else:
        s = 37 if device == "cpu" else 300
        x = torch.randn(2, s, 64, device=device, dtype=dtype, requires_grad=True)
        args = ()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with on(target):
        loss_e, y_e, g_e = _train_step(model, x, *args)
        loss_c, y_c, g_c = _train_step(compiled, x, *args)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y_c, y_e, **tol)
    torch.testing.assert_close(loss_c, loss_e, **tol)
    for i, (a, e) in enumerate(zip(g_c, g_e)):
        torch.testing.assert_close(a, e, **tol, msg=lambda m, i=i: f"grad {i}: {m}")


# ---- v1-style calls -------------------------------------------------------------------------------
@pytest.mark.parametrize("target", TARGETS)
def test_v1_positional_calls(target):
    """Calls written for v1 (positional up to block_size, no window/softcap/ALiBi) keep working
    and give what the v2 keyword calls give."""
    device = target[0]
    dtype = _dtype_of(device)
    bs = (32, 32) if device == "cpu" else (128, 128)
    sq, sk = 2 * bs[0], 3 * bs[1]
    q, k, v = make_qkv(1, sq, sk, 4, 2, 32, dtype=dtype, device=device)
    mask = random_block_mask(1, 4, sq, sk, bs, 0.5, device, seed=3)
    with on(target):
        or_skip(lambda: _v1_calls(q, k, v, mask, list(bs)))


def _v1_calls(q, k, v, mask, bs):
    kv_num, kv_idx, q_num, q_idx = mask.kv_num_blocks, mask.kv_indices, mask.q_num_blocks, mask.q_indices
    out1, lse1 = OP(q, k, v, True, 0.2, False, kv_num, kv_idx, q_num, q_idx, bs)
    out2, lse2 = flashcute.attention(q, k, v, causal=True, scale=0.2, block_mask=mask, return_lse=True)
    assert torch.equal(out1, out2) and torch.equal(lse1, lse2)
    out3, lse3 = OP(q, k, v, True, 0.2, False, kv_num, kv_idx, q_num, q_idx, bs, -1, -1, 0.0, None)
    assert torch.equal(out1, out3) and torch.equal(lse1, lse3)
    o, _ = OP(q, k, v)
    assert torch.equal(o, flashcute.attention(q, k, v))
    o, _ = OP(q, k, v, False, None)
    assert torch.equal(o, flashcute.attention(q, k, v))
    dout = torch.randn_like(out1)
    g1 = OP_BWD(dout, q, k, v, out1, lse1, None, True, 0.2, True, kv_num, kv_idx, q_num, q_idx, bs)
    g2 = OP_BWD(dout, q, k, v, out1, lse1, None, True, 0.2, True)
    g3 = OP_BWD(dout, q, k, v, out1, lse1, None, True, 0.2, True, kv_num, kv_idx, q_num, q_idx, bs,
                -1, -1, 0.0, None)
    for a, b in zip(g1, g3):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, b) for a, b in zip(g1, g2))  # the mask matters
    # and through autograd (deterministic: bitwise comparable)
    qg, kg, vg = (t.clone().requires_grad_(True) for t in (q, k, v))
    out, _ = OP(qg, kg, vg, True, 0.2, True, kv_num, kv_idx, q_num, q_idx, bs)
    grads = torch.autograd.grad(out, (qg, kg, vg), dout)
    for a, b in zip(grads, g1):
        assert torch.equal(a, b)
