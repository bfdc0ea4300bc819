"""flashcute.attention_with_kvcache: decoding against a KV cache, with in-place appends, split-KV
(flash-decoding) and paged caches (SPEC v2; features.md §6, §7, §8, §12).

Every call is checked against ``flashcute.reference.attention_with_kvcache`` (which works on
copies of the caches) under the SPEC criterion: max|ours - ref| <= 2 x max|pt - ref| + 1e-5
(3x with softcap), ref the math on float32 copies (float64 for float32 inputs, as in
conftest), pt the math in the inputs' dtype; lse within 1e-3 and -inf exactly where the
reference has it; out exactly 0 on rows that see no key. After the call the caches must equal
the reference's copies bitwise: the appended rows are exact copies of k, v and every other
element is unchanged (the caches are filled with random values, never zeros, so that an
untouched check means something); q, k, v are never modified.

- the grid: contiguous and paged caches (page sizes 16 ... 256, block tables that are random
  permutations of a pool with spare pages), cache_seqlens as an int, a per-batch tensor with
  0 and "full to the brim" entries, or None (the whole capacity); appends of 0 (k = v = None),
  1, < seqlen_q, = seqlen_q and > seqlen_q tokens; seqlen_q 1, 3, 16, 64, 128; GQA ratios 1,
  2, 4, 8 and 32 (MQA); crossed with causal, windows, softcap, ALiBi ((h,) and (b, h) slopes)
  and a non-default scale;
- num_splits 0, 1, 2, 3, 17, 128 all within the criterion (more splits than key tiles
  included); num_splits=0 bitwise equal to itself on a repeat and to the default;
- paged == contiguous (bitwise on CPU, within the criterion on CUDA), cache contents included;
  block_table entries past the pages in use may hold anything; strided caches (HND, padded
  head dim) are written in place, through the view;
- a decode loop (one token per step, the caller advancing cache_seqlens); an empty cache;
  batch 0 and seqlen_q 0; an append without queries;
- errors (SPEC "Bad input"): overflow, page size not a multiple of 16, block_table of the
  wrong dtype / shape, page ids out of range in use, a paged cache without cache_seqlens, k
  without v, cache dtype / shape / device mismatches, bad cache_seqlens, bad feature
  arguments, and the failed call writes nothing; the raw op (no eager value checks) never
  writes outside the caches it was given; a backward through the op raises;
- torch.library.opcheck of the op (it declares its in-place cache writes) and
  torch.compile(fullgraph=True) of a decode step (cache mutated, out equal to eager);
- CUDA only: caches of 8K and 32K tokens with num_splits 0 and 1; a decode step captured in a CUDA
  graph and replayed with new inputs and cache_seqlens advanced in place (contiguous and paged,
  num_splits 0, 1, 3); and a small paged test meant for compute-sanitizer
  (``compute-sanitizer --tool memcheck python -m pytest tests/test_kvcache.py -k sanitizer``;
  ``scripts/sanitize_shapes.py``, which gpu_check.sh runs, has KV-cache calls of its own).

CPU shapes are small (head dims 32 / 64, caches of a few hundred tokens): the whole file runs
in well under a minute on two cores.
"""
from __future__ import annotations

import re

import pytest
import torch

import flashcute
from flashcute import reference
from conftest import (TARGETS, capture_graph, check_lse, check_precision, gpu, on, or_skip, prepare_softcap, ref_dtype,
                      target_cases)

OP = torch.ops.flashcute.attention_with_kvcache

# (device, kernel family): the CPU backend, and CUDA under each family (skipped where the build
# or the GPU lacks it).
NUM_SPLITS = [0, 1, 2, 3, 8, 17, 128]
PAGE_SIZES = [16, 32, 64, 128, 256]






def _need_kernel(device, headdim, dtype):
    """Skips on a CUDA build restricted (FLASHCUTE_HEADDIMS / FLASHCUTE_DTYPES) without this kernel."""
    if device == "cuda" and not torch.ops.flashcute.has_cuda_kernel(headdim, dtype):
        pytest.skip(f"restricted build: no CUDA kernel for head dim {headdim} in {dtype}")


def _dtype(device, dtype=torch.float32):
    """dtype on CPU; on CUDA (float16 / bfloat16 only) float32 becomes float16."""
    if device == "cpu" or dtype != torch.float32:
        return dtype
    return torch.float16


# ---- inputs ------------------------------------------------------------------------------------
class Cache:
    """k_cache, v_cache (contiguous (b, capacity, h_kv, d) or paged (num_pages, page_size, h_kv, d)),
    block_table (None or int32 (b, max_pages)), capacity (per sequence) and the buffers the caches
    are views of (layouts "hnd" and "padded")."""

    def __init__(self, k_cache, v_cache, block_table, capacity, buffers):
        self.k_cache, self.v_cache, self.block_table, self.capacity, self.buffers = (
            k_cache, v_cache, block_table, capacity, buffers)

    def clone(self):
        """A copy with the same memory layout (for a second, independent call)."""
        def cp(t):
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).copy_(t)
        return Cache(cp(self.k_cache), cp(self.v_cache), self.block_table, self.capacity, None)


def _cache_tensor(shape, dtype, device, layout):
    n, s, h, d = shape
    if layout == "nhd":
        t = torch.randn(n, s, h, d, device=device).to(dtype)
        return t, t
    if layout == "hnd":  # vLLM's head-major page layout
        buf = torch.randn(n, h, s, d, device=device).to(dtype)
        return buf.transpose(1, 2), buf
    if layout == "padded":  # a slice of a larger head dim: rows not packed
        buf = torch.randn(n, s, h, d + 16, device=device).to(dtype)
        return buf[..., 8:8 + d], buf
    raise ValueError(layout)


def make_cache(batch, capacity, nheads_kv, headdim, *, dtype, device, page_size=None, layout="nhd",
               spare_pages=3):
    """Random caches (torch.randn: never zeros). Paged: a pool of batch * max_pages + spare_pages
    pages and a block_table that is a random permutation of it (pages out of order, pages that no
    sequence uses); the capacity is then max_pages * page_size."""
    if page_size is None:
        n, s, table = batch, capacity, None
    else:
        max_pages = -(-capacity // page_size)
        capacity = max_pages * page_size
        n, s = batch * max_pages + spare_pages, page_size
        table = torch.randperm(n)[:batch * max_pages].view(batch, max_pages).to(torch.int32).to(device)
    k_cache, kbuf = _cache_tensor((n, s, nheads_kv, headdim), dtype, device, layout)
    v_cache, vbuf = _cache_tensor((n, s, nheads_kv, headdim), dtype, device, layout)
    return Cache(k_cache, v_cache, table, capacity, (kbuf, vbuf))


def make_lengths(kind, batch, capacity, s_new, device):
    """cache_seqlens: "full" None (the whole capacity), "int" an int, "zero" 0, "var" an int32
    tensor of random lengths with the first 0 and the last filling the capacity exactly."""
    room = capacity - s_new
    if kind == "full":
        return None
    if kind == "int":
        return room * 2 // 3
    if kind == "zero":
        return 0
    lens = torch.randint(0, room + 1, (batch,))
    if batch >= 2:
        lens[0], lens[-1] = 0, room
    return lens.to(torch.int32).to(device)


def make_new(batch, s_new, nheads_kv, headdim, dtype, device):
    """k, v to append (None, None when s_new is 0)."""
    if s_new == 0:
        return None, None
    return tuple(torch.randn(batch, s_new, nheads_kv, headdim, device=device).to(dtype) for _ in range(2))


def gather(cache_tensor, block_table, capacity):
    """The logical (b, capacity, h_kv, d) contents of a paged cache (a copy)."""
    b, max_pages = block_table.shape
    pages = cache_tensor[block_table.long().flatten()]  # (b * max_pages, page, h, d)
    return pages.reshape(b, max_pages * cache_tensor.shape[1], *cache_tensor.shape[2:])[:, :capacity].clone()


def alibi_slopes(kind, batch, nheads, device):
    """float32 slopes in [0, 0.3): (h,) or (b, h)."""
    if kind is None:
        return None
    shape = (nheads,) if kind == "h" else (batch, nheads)
    return (torch.rand(shape, device=device) * 0.3).float()


# ---- the check ---------------------------------------------------------------------------------
def check_cache(name, ours, ref, before):
    """The cache after the call equals the reference's copy bitwise: appended rows exact copies of
    k / v, every other element unchanged."""
    if torch.equal(ours, ref):
        return
    differ = ours != ref
    appended = before != ref
    n_app = (differ & appended).sum().item()
    n_other = (differ & ~appended).sum().item()
    first = tuple(differ.nonzero()[0].tolist())
    raise AssertionError(f"{name}: {n_app + n_other} elements differ from the reference cache: {n_app} in the "
                         f"appended rows, {n_other} elsewhere (elements that must not change); first at {first}")


def run_kvcache(q, k_cache, v_cache, k=None, v=None, **kw):
    """Ours: (out, lse) of flashcute.attention_with_kvcache(..., return_lse=True)."""
    res = or_skip(lambda: flashcute.attention_with_kvcache(q, k_cache, v_cache, k, v, return_lse=True, **kw))
    if q.is_cuda:
        torch.cuda.synchronize(q.device)
    return res


def reference_kvcache(q, k_cache, v_cache, k=None, v=None, **kw):
    """(ref_out, ref_lse, pt_out, k_cache_ref, v_cache_ref): the reference on float32 copies
    (float64 for float32 inputs) and in the inputs' dtype, and the caches after the append."""
    rd = ref_dtype(q.dtype)
    up = lambda t: None if t is None else t.detach().to(rd)  # noqa: E731
    with torch.no_grad():
        ref_out, ref_lse = reference.attention_with_kvcache(
            up(q), up(k_cache), up(v_cache), up(k), up(v), return_lse=True,
            upcast=rd == torch.float32 and q.dtype != torch.float32, **kw)
        pt_out, _, k_ref, v_ref = reference.attention_with_kvcache(
            q.detach(), k_cache, v_cache, None if k is None else k.detach(), None if v is None else v.detach(),
            upcast=False, return_cache=True, **kw)
    return ref_out, ref_lse.float(), pt_out, k_ref, v_ref


def check_kvcache(q, k_cache, v_cache, k=None, v=None, **kw):
    """Ours against the reference: out (criterion; 3x with softcap), lse, out 0 on rows with no key,
    both caches bitwise, q / k / v unchanged. Returns (out, lse)."""
    ref_out, ref_lse, pt_out, k_ref, v_ref = reference_kvcache(q, k_cache, v_cache, k, v, **kw)
    inputs = [(n, t, t.clone()) for n, t in (("q", q), ("k", k), ("v", v)) if t is not None]
    k_before, v_before = k_cache.clone(), v_cache.clone()
    out, lse = run_kvcache(q, k_cache, v_cache, k, v, **kw)
    b, sq, h, _ = q.shape
    assert out.shape == q.shape and out.dtype == q.dtype and out.device == q.device, \
        f"out: {tuple(out.shape)} {out.dtype} {out.device}, expected {tuple(q.shape)} {q.dtype} {q.device}"
    assert lse.shape == (b, h, sq) and lse.dtype == torch.float32 and lse.device == q.device, \
        f"lse: {tuple(lse.shape)} {lse.dtype}, expected {(b, h, sq)} float32"
    check_precision("out", out, ref_out, pt_out, 3.0 if kw.get("softcap", 0.0) > 0 else 2.0)
    check_lse(lse, ref_lse)
    rows = torch.isneginf(ref_lse).transpose(1, 2)  # (b, sq, h)
    assert (out[rows] == 0).all(), "out is not 0 on rows that see no key"
    check_cache("k_cache", k_cache, k_ref, k_before)
    check_cache("v_cache", v_cache, v_ref, v_before)
    for name, t, t0 in inputs:
        assert torch.equal(t, t0), f"{name} was modified by the call"
    return out, lse


# ---- the grid ----------------------------------------------------------------------------------
# name -> (batch, seqlen_q, seqlen_new, nheads, nheads_kv, headdim, capacity, page_size, lengths, dtype)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CPU_CASES = {
    "decode-mha": (3, 1, 1, 4, 4, 32, 80, None, "var", F32),
    "decode-mqa32": (2, 1, 1, 32, 1, 32, 70, None, "int", F32),
    "decode-gqa8-p16": (3, 1, 1, 8, 1, 64, 96, 16, "var", F32),
    "sq3-new3-gqa2-p32": (3, 3, 3, 4, 2, 32, 128, 32, "var", BF16),
    "sq16-new5-gqa4": (3, 16, 5, 8, 2, 32, 100, None, "var", F16),
    "sq64-noappend-gqa2-p64": (3, 64, 0, 4, 2, 32, 192, 64, "var", F32),
    "sq128-new128-p128": (2, 128, 128, 2, 1, 32, 300, 128, "var", F32),
    "sq3-new1-p256": (3, 3, 1, 4, 4, 32, 300, 256, "var", F32),
    "full-capacity": (2, 5, 0, 4, 2, 32, 50, None, "full", F32),
    "new>sq": (3, 1, 6, 4, 2, 32, 60, None, "var", F32),
}
CUDA_CASES = {
    "decode-mha-d128": (4, 1, 1, 16, 16, 128, 1024, None, "var", F16),
    "decode-mqa32-d64-p16": (3, 1, 1, 32, 1, 64, 1000, 16, "var", BF16),
    "decode-gqa8-d128-p256": (2, 1, 1, 32, 4, 128, 2048, 256, "int", BF16),
    "sq3-new3-gqa4-d128-p64": (3, 3, 3, 16, 4, 128, 777, 64, "var", F16),
    "sq16-new7-gqa2-d256": (3, 16, 7, 8, 4, 256, 600, None, "var", BF16),
    "sq64-noappend-gqa8-d64-p32": (3, 64, 0, 16, 2, 64, 1500, 32, "var", F16),
    "sq128-new128-d128-p128": (2, 128, 128, 8, 8, 128, 1024, 128, "var", BF16),
    "sq3-new1-d96": (3, 3, 1, 8, 2, 96, 500, None, "var", F16),
    "full-capacity-d64": (2, 5, 0, 8, 2, 64, 700, None, "full", BF16),
    "new>sq-d128": (3, 1, 9, 8, 2, 128, 300, None, "var", F16),
    "sq150-new5-gqa2-d128-long": (3, 150, 5, 8, 4, 128, 6000, None, "var", BF16),  # sm90: 176-key tiles
    # 6 query heads per KV head: the second 64-row tile starts inside a position (row 64 = position
    # 10, head 4), so ALiBi's per-row slope and position are checked off a group's boundary
    "sq21-new2-gqa6-d128": (2, 21, 2, 12, 2, 128, 500, None, "var", BF16),
}
# name -> kwargs; "window" is per device; "alibi": "h" | "bh".
KV_FEATURES = {
    "plain": {},
    "causal": dict(causal=True),
    "win(L,0)": dict(window={"cpu": (11, 0), "cuda": (150, 0)}),
    "win(L,R)+scale": dict(window={"cpu": (13, 2), "cuda": (200, 5)}, scale=0.1),
    "causal+win(L,-1)": dict(causal=True, window={"cpu": (9, -1), "cuda": (300, -1)}),
    "softcap": dict(softcap=5.0),
    "alibi(h)": dict(alibi="h"),
    "causal+alibi(b,h)": dict(causal=True, alibi="bh"),
    "win+softcap+alibi(b,h)": dict(window={"cpu": (20, 3), "cuda": (300, 7)}, softcap=5.0, alibi="bh"),
}


def feature_kwargs(feature, batch, nheads, device):
    kw = dict(feature)
    window = kw.pop("window", None)
    if window is not None:
        kw["window_size"] = window["cpu" if device == "cpu" else "cuda"]
    kw["alibi_slopes"] = alibi_slopes(kw.pop("alibi", None), batch, nheads, device)
    return kw


def setup_case(case, device, feature=None, layout="nhd"):
    """q, cache, k, v and the call's kwargs of a grid case."""
    b, sq, s_new, h, hkv, d, capacity, page, lens, dtype = case
    dtype = _dtype(device, dtype)
    cache = make_cache(b, capacity, hkv, d, dtype=dtype, device=device, page_size=page, layout=layout)
    q = torch.randn(b, sq, h, d, device=device).to(dtype)
    k, v = make_new(b, s_new, hkv, d, dtype, device)
    kw = feature_kwargs(feature or {}, b, h, device)
    kw["cache_seqlens"] = make_lengths(lens, b, cache.capacity, s_new, device)
    kw["block_table"] = cache.block_table
    return prepare_softcap(q, kw), cache, k, v, kw


# On sm90 GPUs kernels("sm90") sends contiguous caches to the sm90 forward (src/cuda/dispatch.cu),
# so the grid also runs under the default family, where decoding stays on the KV-cache kernel
# (also in builds without the sm80 family for sm_90, whose cuda-sm80 tests skip).
KV_TARGETS = TARGETS + [pytest.param(("cuda", "auto"), id="cuda-auto", marks=gpu.marks)]


@pytest.mark.parametrize("feature", list(KV_FEATURES), ids=list(KV_FEATURES))
@pytest.mark.parametrize("target,case", target_cases(CPU_CASES, CUDA_CASES, KV_TARGETS))
def test_kvcache(target, case, feature):
    q, cache, k, v, kw = setup_case(case, target[0], KV_FEATURES[feature])
    with on(target):
        check_kvcache(q, cache.k_cache, cache.v_cache, k, v, **kw)


# ---- num_splits --------------------------------------------------------------------------------
CPU_SPLIT_CASES = {
    "decode-gqa4": ((2, 1, 1, 8, 2, 64, 400, None, "var", F32), dict()),
    "sq5-new5-mqa-p32": ((2, 5, 5, 4, 1, 32, 300, 32, "var", F32), dict(causal=True, alibi="bh")),
    "sq16-noappend-bf16": ((3, 16, 0, 4, 4, 32, 200, None, "var", BF16),
                           dict(window={"cpu": (30, 4), "cuda": (300, 4)}, softcap=5.0)),
}
CUDA_SPLIT_CASES = {
    "decode-gqa4": ((2, 1, 1, 32, 8, 128, 5000, None, "var", BF16), dict()),
    "sq5-new5-mqa-p32": ((3, 5, 5, 16, 1, 64, 3000, 32, "var", F16), dict(causal=True, alibi="bh")),
    "sq16-noappend-p256": ((3, 16, 0, 8, 8, 128, 2000, 256, "var", BF16),
                           dict(window={"cpu": (30, 4), "cuda": (300, 4)}, softcap=5.0)),
}


@pytest.mark.parametrize("target,case", target_cases(CPU_SPLIT_CASES, CUDA_SPLIT_CASES))
def test_num_splits(target, case):
    """Every num_splits (more splits than key tiles included) within the criterion; num_splits=0
    bitwise equal to itself on a repeat and to the default; the caches the same for all."""
    shape, feature = case
    q, cache, k, v, kw = setup_case(shape, target[0], feature)
    results = {}
    with on(target):
        for ns in NUM_SPLITS:
            c = cache.clone()
            out, lse = check_kvcache(q, c.k_cache, c.v_cache, k, v, num_splits=ns, **kw)
            results[ns] = (out, lse, c)
        c0, c1 = cache.clone(), cache.clone()
        again = run_kvcache(q, c0.k_cache, c0.v_cache, k, v, num_splits=0, **kw)
        default = run_kvcache(q, c1.k_cache, c1.v_cache, k, v, **kw)
    out0, lse0, _ = results[0]
    for name, (o, l) in (("num_splits=0 repeated", again), ("the default", default)):
        assert torch.equal(o, out0), f"out: {name} is not bitwise equal to num_splits=0"
        assert torch.equal(l, lse0), f"lse: {name} is not bitwise equal to num_splits=0"
    for ns, (_, _, c) in results.items():
        assert torch.equal(c.k_cache, results[1][2].k_cache) and torch.equal(c.v_cache, results[1][2].v_cache), \
            f"the caches after num_splits={ns} differ from those after num_splits=1"


# ---- paged == contiguous -----------------------------------------------------------------------
@pytest.mark.parametrize("append", [False, True], ids=["noappend", "append"])
@pytest.mark.parametrize("page_size", PAGE_SIZES)
@pytest.mark.parametrize("target", TARGETS)
def test_paged_equals_contiguous(target, page_size, append):
    """A paged cache (random page permutation, spare pages) and the contiguous cache with the same
    contents give the same out and lse (bitwise on CPU, both within the criterion on CUDA) and the
    same cache contents after the append; pages no sequence uses are untouched."""
    device = target[0]
    b, sq, h, hkv = 3, 4, 8, 2
    d, capacity = (32, 300) if device == "cpu" else (128, 1500)
    dtype = _dtype(device)
    s_new = 2 if append else 0
    paged = make_cache(b, capacity, hkv, d, dtype=dtype, device=device, page_size=page_size)
    table = paged.block_table
    contig = Cache(gather(paged.k_cache, table, paged.capacity), gather(paged.v_cache, table, paged.capacity),
                   None, paged.capacity, None)
    q = torch.randn(b, sq, h, d, device=device).to(dtype)
    k, v = make_new(b, s_new, hkv, d, dtype, device)
    lens = make_lengths("var", b, paged.capacity, s_new, device)
    kw = dict(cache_seqlens=lens, causal=True, alibi_slopes=alibi_slopes("h", b, h, device))
    unused = torch.ones(paged.k_cache.shape[0], dtype=torch.bool)
    unused[table.flatten().long().cpu()] = False
    spare_k, spare_v = paged.k_cache[unused.to(device)].clone(), paged.v_cache[unused.to(device)].clone()
    with on(target):
        out_p, lse_p = check_kvcache(q, paged.k_cache, paged.v_cache, k, v, block_table=table, **kw)
        out_c, lse_c = check_kvcache(q, contig.k_cache, contig.v_cache, k, v, **kw)
    if device == "cpu":
        assert torch.equal(out_p, out_c), f"out: paged != contiguous, max diff {(out_p - out_c).abs().max():.3e}"
        assert torch.equal(lse_p, lse_c), "lse: paged != contiguous"
    assert torch.equal(gather(paged.k_cache, table, paged.capacity), contig.k_cache), "k_cache: paged != contiguous"
    assert torch.equal(gather(paged.v_cache, table, paged.capacity), contig.v_cache), "v_cache: paged != contiguous"
    assert torch.equal(paged.k_cache[unused.to(device)], spare_k) and \
        torch.equal(paged.v_cache[unused.to(device)], spare_v), "pages that no sequence uses were modified"


@pytest.mark.parametrize("target", TARGETS)
def test_unused_block_table_entries(target):
    """Entries of block_table past the pages a sequence uses are never read: -1 or ids past the pool
    there change nothing (vLLM pads block tables this way); a table that is a column slice of a
    wider one (row stride larger than its width) works the same."""
    device = target[0]
    dtype = _dtype(device)
    b, sq, s_new, h, hkv, d, page = 3, 2, 2, 4, 2, 64, 16
    cache = make_cache(b, 8 * page, hkv, d, dtype=dtype, device=device, page_size=page)
    lens = torch.tensor([0, 20, 45], dtype=torch.int32, device=device)  # pages in use: 1, 2, 3
    q = torch.randn(b, sq, h, d, device=device).to(dtype)
    k, v = make_new(b, s_new, hkv, d, dtype, device)
    padded = cache.block_table.clone()
    padded[0, 1:] = -1
    padded[1, 2:] = cache.k_cache.shape[0] + 1000
    padded[2, 3:] = 2 ** 31 - 1
    # and as a view of a wider table (row stride != number of columns), as a serving engine slices it
    wide = torch.full((b, 2 * padded.shape[1]), -1, dtype=torch.int32, device=device)
    wide[:, :padded.shape[1]] = padded
    c, c2 = cache.clone(), cache.clone()
    with on(target):
        out_a, lse_a = check_kvcache(q, cache.k_cache, cache.v_cache, k, v, cache_seqlens=lens,
                                     block_table=cache.block_table, causal=True)
        out_b, lse_b = check_kvcache(q, c.k_cache, c.v_cache, k, v, cache_seqlens=lens, block_table=padded,
                                     causal=True)
        out_c, lse_c = check_kvcache(q, c2.k_cache, c2.v_cache, k, v, cache_seqlens=lens,
                                     block_table=wide[:, :padded.shape[1]], causal=True)
    for out, lse in ((out_b, lse_b), (out_c, lse_c)):
        assert torch.equal(out_a, out) and torch.equal(lse_a, lse)
    for cc in (c, c2):
        assert torch.equal(cache.k_cache, cc.k_cache) and torch.equal(cache.v_cache, cc.v_cache)


# ---- layouts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("layout", ["hnd", "padded"])
@pytest.mark.parametrize("target", TARGETS)
def test_strided_caches(target, layout, paged):
    """Caches that are views (head-major pages, a slice of a larger head dim) and a (b, h, s, d) q:
    the append lands in the view, the rest of the buffer is untouched."""
    device = target[0]
    dtype = _dtype(device)
    b, sq, s_new, h, hkv = 3, 3, 3, 8, 2
    d, capacity = (32, 100) if device == "cpu" else (128, 700)
    cache = make_cache(b, capacity, hkv, d, dtype=dtype, device=device, page_size=32 if paged else None,
                       layout=layout)
    bufs = [t.clone() for t in cache.buffers]
    q = torch.randn(b, h, sq, d, device=device).to(dtype).transpose(1, 2)
    k, v = make_new(b, s_new, hkv, d, dtype, device)
    lens = make_lengths("var", b, cache.capacity, s_new, device)
    with on(target):
        check_kvcache(q, cache.k_cache, cache.v_cache, k, v, cache_seqlens=lens, block_table=cache.block_table,
                      window_size=(20, 0))
    if layout == "padded":
        for name, buf, old in zip(("k_cache", "v_cache"), cache.buffers, bufs):
            assert torch.equal(buf[..., :8], old[..., :8]) and torch.equal(buf[..., 8 + d:], old[..., 8 + d:]), \
                f"{name}: the buffer outside the view was written"


# ---- cache_seqlens forms, decode loop ------------------------------------------------------------
@pytest.mark.parametrize("target", TARGETS)
def test_cache_seqlens_forms(target):
    """None (the whole capacity), the capacity as an int and as a tensor: each within the criterion
    (bitwise the same on CPU); an int n == a tensor of n bitwise."""
    device = target[0]
    dtype = _dtype(device)
    b, sq, h, hkv, d, capacity = 2, 3, 4, 2, 64, 90
    cache = make_cache(b, capacity, hkv, d, dtype=dtype, device=device)
    q = torch.randn(b, sq, h, d, device=device).to(dtype)
    full = torch.full((b,), capacity, dtype=torch.int32, device=device)
    with on(target):
        ref = check_kvcache(q, cache.k_cache, cache.v_cache, causal=True)
        for lens in (capacity, full):
            got = check_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=lens, causal=True)
            if device == "cpu":
                assert all(torch.equal(x, y) for x, y in zip(ref, got)), f"cache_seqlens={lens!r} != None"
        k, v = make_new(b, 4, hkv, d, dtype, device)
        c1, c2 = cache.clone(), cache.clone()
        a = check_kvcache(q, c1.k_cache, c1.v_cache, k, v, cache_seqlens=37)
        bb = run_kvcache(q, c2.k_cache, c2.v_cache, k, v,
                         cache_seqlens=torch.full((b,), 37, dtype=torch.int32, device=device))
    assert all(torch.equal(x, y) for x, y in zip(a, bb)), "cache_seqlens as an int != as a tensor"
    assert torch.equal(c1.k_cache, c2.k_cache) and torch.equal(c1.v_cache, c2.v_cache)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("target", TARGETS)
def test_decode_loop(target, paged):
    """Token-by-token decoding: each step appends one token and the caller advances cache_seqlens;
    every step matches the reference on the cache as it is then (GQA, causal, ALiBi (b, h))."""
    device = target[0]
    dtype = _dtype(device)
    b, h, hkv = 3, 8, 2
    d, capacity = (32, 64) if device == "cpu" else (128, 600)
    cache = make_cache(b, capacity, hkv, d, dtype=dtype, device=device, page_size=16 if paged else None)
    steps = 5
    lens = make_lengths("var", b, cache.capacity, steps, device)
    slopes = alibi_slopes("bh", b, h, device)
    with on(target):
        for _ in range(steps):
            q = torch.randn(b, 1, h, d, device=device).to(dtype)
            k, v = make_new(b, 1, hkv, d, dtype, device)
            check_kvcache(q, cache.k_cache, cache.v_cache, k, v, cache_seqlens=lens, block_table=cache.block_table,
                          causal=True, alibi_slopes=slopes)
            lens = lens + 1
    assert int(lens.max()) == cache.capacity  # the last step filled a sequence to the brim


@gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("num_splits", [0, 1, 3])
@pytest.mark.parametrize("target", TARGETS[1:])
def test_decode_loop_cuda_graph(target, paged, num_splits):
    """A decode step captured once in a CUDA graph (as serving loops run it) and replayed with new
    inputs copied into its buffers and cache_seqlens advanced in place: every replay reads the
    lengths of that replay (none baked in at capture), appends where they point and matches the
    reference on the cache as it was before that replay; the caches match the reference bitwise."""
    b, h, hkv, d, steps = 3, 8, 2, 128, 4
    dtype = torch.bfloat16
    _need_kernel("cuda", d, dtype)
    cache = make_cache(b, 640, hkv, d, dtype=dtype, device="cuda", page_size=16 if paged else None)
    lens = make_lengths("var", b, cache.capacity, steps + 1, "cuda")
    q = torch.randn(b, 1, h, d, device="cuda", dtype=dtype)
    k, v = make_new(b, 1, hkv, d, dtype, "cuda")

    def step():
        return flashcute.attention_with_kvcache(q, cache.k_cache, cache.v_cache, k, v, cache_seqlens=lens,
                                                block_table=cache.block_table, causal=True, num_splits=num_splits,
                                                return_lse=True)

    with on(target):
        graph, (out, lse) = capture_graph(step, between=lambda: lens.add_(1))  # the warm-up appended at lens
        for i in range(steps):
            for t in (q, k, v):
                t.copy_(torch.randn(t.shape, device="cuda", dtype=dtype))
            ref_out, ref_lse, pt_out, k_ref, v_ref = reference_kvcache(
                q, cache.k_cache, cache.v_cache, k, v, cache_seqlens=lens, block_table=cache.block_table,
                causal=True)
            k_before, v_before = cache.k_cache.clone(), cache.v_cache.clone()
            graph.replay()
            torch.cuda.synchronize()
            check_precision(f"out (replay {i})", out, ref_out, pt_out, 2.0)
            check_lse(lse, ref_lse)
            check_cache(f"k_cache (replay {i})", cache.k_cache, k_ref, k_before)
            check_cache(f"v_cache (replay {i})", cache.v_cache, v_ref, v_before)
            lens += 1
    assert int(lens.max()) == cache.capacity  # the last replay filled a sequence to the brim


# ---- empty ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("target", TARGETS)
def test_empty_cache(target, paged):
    """cache_seqlens = 0 and no append: out 0, lse -inf, caches untouched; with per-sequence
    lengths, the empty sequences alone get out 0 and lse -inf."""
    device = target[0]
    dtype = _dtype(device)
    b, sq, h, hkv, d = 3, 4, 4, 2, 64
    cache = make_cache(b, 64, hkv, d, dtype=dtype, device=device, page_size=16 if paged else None)
    q = torch.randn(b, sq, h, d, device=device).to(dtype)
    with on(target):
        for kw in (dict(), dict(causal=True), dict(window_size=(3, 0), softcap=2.0),
                   dict(alibi_slopes=alibi_slopes("h", b, h, device)), dict(num_splits=3)):
            for lens in (0, torch.zeros(b, dtype=torch.int32, device=device)):
                out, lse = check_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=lens,
                                         block_table=cache.block_table, **kw)
                assert (out == 0).all() and torch.isneginf(lse).all(), f"empty cache, {kw}: out not 0 / lse not -inf"
        lens = torch.tensor([0, 17, 0], dtype=torch.int32, device=device)
        out, lse = check_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=lens, block_table=cache.block_table)
    assert (out[0] == 0).all() and (out[2] == 0).all() and torch.isneginf(lse[[0, 2]]).all()
    assert torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("target", TARGETS)
def test_empty_shapes(target, paged):
    """batch 0 and seqlen_q 0 give empty outputs (out like q, lse (b, h, sq))."""
    device = target[0]
    dtype = _dtype(device)
    h, hkv, d = 4, 2, 32
    with on(target):
        # batch 0
        cache = make_cache(0, 32, hkv, d, dtype=dtype, device=device, page_size=16 if paged else None)
        q = torch.randn(0, 3, h, d, device=device).to(dtype)
        k, v = make_new(0, 2, hkv, d, dtype, device)
        for lens in (0, torch.zeros(0, dtype=torch.int32, device=device)):
            for kv in ((None, None), (k, v)):
                out, lse = run_kvcache(q, cache.k_cache, cache.v_cache, *kv, cache_seqlens=lens,
                                       block_table=cache.block_table)
                assert out.shape == (0, 3, h, d) and out.dtype == dtype and lse.shape == (0, h, 3)
        # seqlen_q 0
        cache = make_cache(2, 32, hkv, d, dtype=dtype, device=device, page_size=16 if paged else None)
        before = cache.k_cache.clone(), cache.v_cache.clone()
        q = torch.randn(2, 0, h, d, device=device).to(dtype)
        out, lse = run_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=5, block_table=cache.block_table)
    assert out.shape == (2, 0, h, d) and lse.shape == (2, h, 0) and lse.dtype == torch.float32
    assert torch.equal(cache.k_cache, before[0]) and torch.equal(cache.v_cache, before[1])


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("target", TARGETS)
def test_append_without_queries(target, paged):
    """seqlen_q 0 with k, v given: nothing to attend, but the append still happens (SPEC: k, v are
    written into the cache)."""
    device = target[0]
    dtype = _dtype(device)
    b, h, hkv, d = 2, 4, 2, 32
    cache = make_cache(b, 48, hkv, d, dtype=dtype, device=device, page_size=16 if paged else None)
    q = torch.randn(b, 0, h, d, device=device).to(dtype)
    k, v = make_new(b, 3, hkv, d, dtype, device)
    lens = torch.tensor([0, 30], dtype=torch.int32, device=device)
    with on(target):
        check_kvcache(q, cache.k_cache, cache.v_cache, k, v, cache_seqlens=lens, block_table=cache.block_table)


# ---- errors -------------------------------------------------------------------------------------
ERRORS = (RuntimeError, ValueError)
ANY = (RuntimeError, ValueError, TypeError)


def _base(device, paged=False):
    """A valid call: q (2, 3, 4, 32), caches h_kv 2 (contiguous capacity 40, or 8 pages of 16 and a
    (2, 3) block table: capacity 48), k, v of 2 tokens, cache_seqlens [5, 20]."""
    dtype = _dtype(device)
    _need_kernel(device, 32, dtype)
    cache = make_cache(2, 40 if not paged else 48, 2, 32, dtype=dtype, device=device,
                       page_size=16 if paged else None, spare_pages=2)
    q = torch.randn(2, 3, 4, 32, device=device).to(dtype)
    k, v = make_new(2, 2, 2, 32, dtype, device)
    return dict(q=q, k_cache=cache.k_cache, v_cache=cache.v_cache, k=k, v=v,
                cache_seqlens=torch.tensor([5, 20], dtype=torch.int32, device=device),
                block_table=cache.block_table)


def _call(args):
    a = dict(args)
    return flashcute.attention_with_kvcache(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"), a.pop("k"), a.pop("v"),
                                            **a)


def _set_table(a, i, j, value):
    t = a["block_table"].clone()
    t[i, j] = value
    a["block_table"] = t


# name -> (paged, change(args, device), errors, patterns)
BAD_CALLS = {
    "overflow": (False, lambda a, dev: a.update(cache_seqlens=torch.tensor([5, 39], dtype=torch.int32,
                                                                           device=dev)),
                 ValueError, [r"overflow", r"40", r"k_cache\.shape\[1\]"]),
    "overflow-int": (False, lambda a, dev: a.update(cache_seqlens=40), ValueError,
                     [r"overflow", r"k_cache\.shape\[1\]"]),
    "overflow-no-append": (False, lambda a, dev: a.update(k=None, v=None, cache_seqlens=41), ValueError,
                           [r"overflow"]),
    "overflow-paged": (True, lambda a, dev: a.update(cache_seqlens=torch.tensor([47, 0], dtype=torch.int32,
                                                                                device=dev)),
                       ValueError, [r"overflow", r"48"]),
    "overflow-short-block-table": (True, lambda a, dev: a.update(block_table=a["block_table"][:, :1].contiguous()),
                                   ValueError, [r"overflow", r"block_table\.shape\[1\] pages"]),
    "page-size-8": (True, lambda a, dev: a.update(k_cache=a["k_cache"].reshape(-1, 8, 2, 32),
                                                  v_cache=a["v_cache"].reshape(-1, 8, 2, 32)),
                    ERRORS, [r"page", r"16"]),
    "page-size-24": (True, lambda a, dev: a.update(k_cache=torch.randn(8, 24, 2, 32, device=dev).to(a["q"].dtype),
                                                   v_cache=torch.randn(8, 24, 2, 32, device=dev).to(a["q"].dtype)),
                     ERRORS, [r"page", r"16"]),
    "block-table-int64": (True, lambda a, dev: a.update(block_table=a["block_table"].long()), TypeError,
                          [r"block_table", r"int32"]),
    "block-table-1d": (True, lambda a, dev: a.update(block_table=a["block_table"].flatten()), ANY,
                       [r"block_table"]),
    "block-table-rows": (True, lambda a, dev: a.update(block_table=a["block_table"][:1]), ANY, [r"block_table"]),
    "page-id-past-pool": (True, lambda a, dev: _set_table(a, 1, 1, 8), ValueError, [r"block_table", r"8"]),
    "page-id-negative": (True, lambda a, dev: _set_table(a, 0, 0, -1), ValueError, [r"block_table", r"-1"]),
    "paged-without-cache_seqlens": (True, lambda a, dev: a.update(cache_seqlens=None, k=None, v=None), ValueError,
                                    [r"cache_seqlens"]),
    "k-without-v": (False, lambda a, dev: a.update(v=None), ValueError, [r"\bk\b", r"\bv\b"]),
    "v-without-k": (False, lambda a, dev: a.update(k=None), ValueError, [r"\bk\b", r"\bv\b"]),
    "v_cache-dtype": (False, lambda a, dev: a.update(v_cache=a["v_cache"].to(torch.bfloat16)), TypeError,
                      [r"v_cache", r"dtype|BFloat16|bfloat16"]),
    "caches-dtype-not-q's": (False, lambda a, dev: a.update(k_cache=a["k_cache"].to(torch.bfloat16),
                                                            v_cache=a["v_cache"].to(torch.bfloat16)),
                             TypeError, [r"k_cache|v_cache"]),
    "k-dtype": (False, lambda a, dev: a.update(k=a["k"].to(torch.bfloat16)), TypeError, [r"\bk\b", r"dtype"]),
    "v_cache-shape": (False, lambda a, dev: a.update(v_cache=a["v_cache"][:, :30]), ANY, [r"v_cache"]),
    "k_cache-rank": (False, lambda a, dev: a.update(k_cache=a["k_cache"].flatten(2)), ANY, [r"k_cache"]),
    "k_cache-stride": (False, lambda a, dev: a.update(k_cache=torch.randn(2, 40, 2, 64, device=dev).to(
                           a["k_cache"].dtype)[..., ::2]),
                       ANY, [r"k_cache", r"stride"]),
    "cache-heads-not-divisor": (False, lambda a, dev: a.update(
        k_cache=torch.randn(2, 40, 3, 32, device=dev).to(a["q"].dtype),
        v_cache=torch.randn(2, 40, 3, 32, device=dev).to(a["q"].dtype),
        k=torch.randn(2, 2, 3, 32, device=dev).to(a["q"].dtype),
        v=torch.randn(2, 2, 3, 32, device=dev).to(a["q"].dtype)), ANY, [r"head"]),
    "cache-headdim": (False, lambda a, dev: a.update(k_cache=torch.randn(2, 40, 2, 64, device=dev).to(a["q"].dtype)),
                      ANY, [r"k_cache|head"]),
    "k-heads": (False, lambda a, dev: a.update(k=a["k"][:, :, :1], v=a["v"][:, :, :1]), ANY, [r"\bk\b"]),
    "k-batch": (False, lambda a, dev: a.update(k=a["k"][:1], v=a["v"][:1]), ANY, [r"\bk\b"]),
    "k-v-lengths": (False, lambda a, dev: a.update(v=a["v"][:, :1]), ANY, [r"\bv\b"]),
    "cache-batch": (False, lambda a, dev: a.update(k_cache=a["k_cache"][:1], v_cache=a["v_cache"][:1]), ANY,
                    [r"k_cache|batch"]),
    "cache_seqlens-int64": (False, lambda a, dev: a.update(cache_seqlens=a["cache_seqlens"].long()), TypeError,
                            [r"cache_seqlens", r"int32"]),
    "cache_seqlens-shape": (False, lambda a, dev: a.update(cache_seqlens=torch.tensor([5, 2, 3], dtype=torch.int32,
                                                                                     device=dev)),
                            ANY, [r"cache_seqlens"]),
    "cache_seqlens-negative-int": (False, lambda a, dev: a.update(cache_seqlens=-1), ValueError,
                                   [r"cache_seqlens", r"-1"]),
    "cache_seqlens-negative": (False, lambda a, dev: a.update(cache_seqlens=torch.tensor([-3, 2], dtype=torch.int32,
                                                                                        device=dev)),
                               ValueError, [r"cache_seqlens", r"-3"]),
    "cache_seqlens-float": (False, lambda a, dev: a.update(cache_seqlens=3.0), TypeError, [r"cache_seqlens"]),
    "window": (False, lambda a, dev: a.update(window_size=(-2, 0)), ValueError, [r"window", r"-2"]),
    "softcap": (False, lambda a, dev: a.update(softcap=-1.0), ValueError, [r"softcap"]),
    "alibi-shape": (False, lambda a, dev: a.update(alibi_slopes=torch.rand(3, device=dev)), ANY, [r"alibi_slopes"]),
    "alibi-dtype": (False, lambda a, dev: a.update(alibi_slopes=torch.rand(4, device=dev).half()), ANY,
                    [r"alibi_slopes"]),
    "num_splits-type": (False, lambda a, dev: a.update(num_splits=1.5), TypeError, [r"num_splits"]),
}
# CUDA only: arguments on the wrong device, float32 (the CUDA kernels serve float16 / bfloat16).
CUDA_BAD_CALLS = {
    "k_cache-on-cpu": (False, lambda a, dev: a.update(k_cache=a["k_cache"].cpu(), v_cache=a["v_cache"].cpu()), ANY,
                       [r"k_cache|v_cache", r"cpu|device"]),
    "k-on-cpu": (False, lambda a, dev: a.update(k=a["k"].cpu(), v=a["v"].cpu()), ANY, [r"\bk\b", r"cpu|device"]),
    "block_table-on-cpu": (True, lambda a, dev: a.update(block_table=a["block_table"].cpu()), ANY,
                           [r"block_table", r"cpu|device"]),
    "cache_seqlens-on-cpu": (False, lambda a, dev: a.update(cache_seqlens=a["cache_seqlens"].cpu()), ANY,
                             [r"cache_seqlens", r"cpu|device"]),
    "float32": (False, lambda a, dev: a.update(**{n: a[n].float() for n in ("q", "k_cache", "v_cache", "k", "v")}),
                TypeError, [r"float16|Float"]),
}


@pytest.mark.parametrize("target,case", target_cases(BAD_CALLS, dict(BAD_CALLS, **CUDA_BAD_CALLS)))
def test_bad_input(target, case, monkeypatch):
    """A clear error naming the argument (SPEC "Bad input"); the failed call writes nothing. On
    CUDA the wrapper checks device-side values (lengths, page ids in tensors) only when asked:
    FLASHCUTE_CHECK_DEVICE_VALUES=1 (a sync per call; test_raw_op_stays_inside_the_cache covers
    the unchecked path)."""
    paged, change, errors, patterns = case
    device = target[0]
    monkeypatch.setenv("FLASHCUTE_CHECK_DEVICE_VALUES", "1")
    args = _base(device, paged)
    change(args, device)
    before = [t.clone() for t in (args["k_cache"], args["v_cache"])]
    with on(target), pytest.raises(errors) as info:
        _call(args)
        if device == "cuda":
            torch.cuda.synchronize()
    msg = str(info.value)
    for p in patterns:
        assert re.search(p, msg), f"message does not match {p!r}:\n{msg}"
    assert torch.equal(args["k_cache"], before[0]) and torch.equal(args["v_cache"], before[1]), \
        "a call that raised wrote into the cache"


@gpu
def test_alibi_past_packed_rows():
    """ALiBi on CUDA with more query rows than GQA packing takes with ALiBi (2^22 + 1 positions of
    2 query heads over 1 KV head: 2^23 + 2 packed rows, past src/cuda/dispatch.cu kKvCacheAlibiRows):
    the unpacked kernel, whose rows are positions, against the reference, with an append into a
    paged cache. Slopes small enough that a far row's lse (about -slope x its distance, 2^22 for
    the first) keeps float32 precision within check_lse's 1e-3; it still depends on every row's
    position."""
    n = 2 ** 22 + 1
    _need_kernel("cuda", 8, torch.bfloat16)
    cache = make_cache(1, 32, 1, 8, dtype=torch.bfloat16, device="cuda", page_size=16)
    q = torch.randn(1, n, 2, 8, device="cuda").to(torch.bfloat16)
    k, v = make_new(1, 2, 1, 8, torch.bfloat16, "cuda")
    slopes = torch.tensor([2e-5, 1e-5], device="cuda")
    check_kvcache(q, cache.k_cache, cache.v_cache, k, v, cache_seqlens=20, block_table=cache.block_table,
                  alibi_slopes=slopes)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("target", TARGETS)
def test_raw_op_stays_inside_the_cache(target, paged):
    """The raw op checks no device values (that is the wrapper's eager check): an overflowing
    append or a bad page id may give any result (or an error), but nothing outside the cache
    tensors is written. The caches are views of larger buffers, whose rest must stay as it was."""
    device = target[0]
    dtype = _dtype(device)
    hkv, d = 2, 32
    q = torch.randn(2, 3, 4, d, device=device).to(dtype)
    k, v = make_new(2, 3, hkv, d, dtype, device)
    if paged:
        kbuf, vbuf = (torch.randn(6, 16, hkv, d, device=device).to(dtype) for _ in range(2))
        k_cache, v_cache = kbuf[1:4], vbuf[1:4]  # pages 0..2 of the view; buffer pages 0, 4, 5 outside
        bad_tables = [torch.tensor([[0, 1], [2, 1]], dtype=torch.int32, device=device),     # with an overflow
                      torch.tensor([[0, 3], [2, -1]], dtype=torch.int32, device=device)]    # ids outside the pool
        cases = [(torch.tensor([30, 31], dtype=torch.int32, device=device), bad_tables[0]),
                 (torch.tensor([20, 20], dtype=torch.int32, device=device), bad_tables[1])]
        inside = (slice(1, 4),)
    else:
        kbuf, vbuf = (torch.randn(3, 40, hkv, d, device=device).to(dtype) for _ in range(2))
        k_cache, v_cache = kbuf[:2, :32], vbuf[:2, :32]  # rows 32..39 and batch 2 outside
        cases = [(torch.tensor([30, 31], dtype=torch.int32, device=device), None),
                 (torch.tensor([2 ** 30, 5], dtype=torch.int32, device=device), None)]
        inside = (slice(0, 2), slice(0, 32))
    with on(target):
        for lens, table in cases:
            old = kbuf.clone(), vbuf.clone()
            try:
                OP(q, k_cache, v_cache, k, v, lens, table, False, None, -1, -1, 0.0, None, 0)
                if device == "cuda":
                    torch.cuda.synchronize()
            except (RuntimeError, ValueError):
                pass
            for name, buf, o in (("k", kbuf, old[0]), ("v", vbuf, old[1])):
                outside = torch.ones(buf.shape[:2], dtype=torch.bool, device=device)
                outside[inside] = False
                assert torch.equal(buf[outside], o[outside]), \
                    f"{name}: the raw op wrote outside the cache (cache_seqlens {lens.tolist()}, block_table {table})"


@pytest.mark.parametrize("which", ["q", "k", "v", "k_cache"])
@pytest.mark.parametrize("target", TARGETS)
def test_backward_raises(target, which):
    """Inference only: with an input requiring grad the forward works (same result) and a backward
    through out or lse raises a RuntimeError that names the op (or the forward refuses)."""
    device = target[0]
    args = _base(device)
    no_grad = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in args.items()}
    with on(target):
        ref_out, ref_lse = _call(dict(no_grad, return_lse=True))
        args[which] = args[which].clone().requires_grad_(True) if which != "k_cache" else \
            args[which].requires_grad_(True)
        try:
            out, lse = _call(dict(args, return_lse=True))
        except RuntimeError as e:  # refusing in the forward is a clear error too
            assert re.search(r"attention_with_kvcache|in-place|leaf", str(e)), str(e)
            return
        assert torch.equal(out.detach(), ref_out) and torch.equal(lse.detach(), ref_lse)
        for res in (out, lse):
            with pytest.raises(RuntimeError, match=r"attention_with_kvcache"):
                res.float().sum().backward(retain_graph=True)
        with torch.no_grad():  # and under no_grad nothing is recorded
            args[which] = args[which].detach()
            _call(args)


# ---- opcheck -------------------------------------------------------------------------------------
OPCHECK_CASES = {
    # name -> (page_size, append, causal, window, softcap, alibi, num_splits, cache_seqlens)
    "append+causal+alibi(h)": (None, True, True, (-1, -1), 0.0, "h", 0, "var"),
    "paged16+append+win+softcap": (16, True, False, (6, 2), 3.0, None, 2, "var"),
    "noappend-full-capacity": (None, False, False, (-1, -1), 0.0, None, 1, "full"),
    "paged32+noappend+alibi(b,h)+splits3": (32, False, True, (5, -1), 0.0, "bh", 3, "var"),
}


@pytest.mark.parametrize("case", list(OPCHECK_CASES.values()), ids=list(OPCHECK_CASES))
@pytest.mark.parametrize("target", TARGETS)
def test_opcheck(target, case):
    """torch.library.opcheck (schema with the declared cache mutation, fake kernel, functionalised
    AOT dispatch) with positional and keyword arguments."""
    page, append, causal, window, softcap, alibi, num_splits, lens_kind = case
    device = target[0]
    dtype = _dtype(device)
    b, sq, h, hkv, d = 2, 3, 4, 2, 32
    _need_kernel(device, d, dtype)
    cache = make_cache(b, 64, hkv, d, dtype=dtype, device=device, page_size=page)
    q = torch.randn(b, sq, h, d, device=device).to(dtype)
    s_new = 2 if append else 0
    k, v = make_new(b, s_new, hkv, d, dtype, device)
    lens = make_lengths(lens_kind, b, cache.capacity, s_new, device)
    slopes = alibi_slopes(alibi, b, h, device)
    args = (q, cache.k_cache, cache.v_cache, k, v, lens, cache.block_table, causal, None, *window, softcap, slopes,
            num_splits)
    with on(target):
        torch.library.opcheck(OP.default, args)
        torch.library.opcheck(OP.default, (q, cache.k_cache, cache.v_cache),
                              dict(k=k, v=v, cache_seqlens=lens, block_table=cache.block_table, causal=causal,
                                   window_left=window[0], window_right=window[1], softcap=softcap,
                                   alibi_slopes=slopes, num_splits=num_splits))


# ---- torch.compile -----------------------------------------------------------------------------------
def _decode_step(q, k_cache, v_cache, k, v, lens, table, slopes):
    out, lse = flashcute.attention_with_kvcache(q * 0.5, k_cache, v_cache, k, v, cache_seqlens=lens,
                                                block_table=table, causal=True, window_size=(40, 0),
                                                alibi_slopes=slopes, return_lse=True)
    return out.float() * 2.0, lse


def _compile_targets():
    # inductor on CPU compiles C++ (about 30 s on two cores): CUDA only.
    out = [pytest.param(("cpu", None), "aot_eager", id="cpu-aot_eager")]
    for t in TARGETS[1:]:
        for backend in ("aot_eager", "inductor"):
            out.append(pytest.param(t.values[0], backend, id=f"{t.id}-{backend}", marks=t.marks))
    return out


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("target,backend", _compile_targets())
def test_compile_fullgraph(target, backend, paged):
    """A decode loop through torch.compile(fullgraph=True): the caches passed in are mutated exactly
    as in eager mode and out / lse match eager (bitwise with aot_eager)."""
    device = target[0]
    dtype = _dtype(device)
    torch._dynamo.reset()
    b, h, hkv = 2, 4, 2
    d, capacity = (32, 64) if device == "cpu" else (128, 512)
    _need_kernel(device, d, dtype)
    eager = make_cache(b, capacity, hkv, d, dtype=dtype, device=device, page_size=16 if paged else None)
    comp = eager.clone()
    lens = make_lengths("var", b, eager.capacity, 3, device)
    slopes = alibi_slopes("h", b, h, device)
    step = torch.compile(_decode_step, backend=backend, fullgraph=True)
    with on(target):
        for _ in range(3):
            q = torch.randn(b, 1, h, d, device=device).to(dtype)
            k, v = make_new(b, 1, hkv, d, dtype, device)
            ref = reference_kvcache(q * 0.5, eager.k_cache, eager.v_cache, k, v, cache_seqlens=lens,
                                    block_table=eager.block_table, causal=True, window_size=(40, 0),
                                    alibi_slopes=slopes)
            out_e, lse_e = _decode_step(q, eager.k_cache, eager.v_cache, k, v, lens, eager.block_table, slopes)
            out_c, lse_c = step(q, comp.k_cache, comp.v_cache, k, v, lens, comp.block_table, slopes)
            if backend == "aot_eager":
                assert torch.equal(out_c, out_e) and torch.equal(lse_c, lse_e), "compiled != eager"
            else:
                torch.testing.assert_close(out_c, out_e, rtol=1e-3, atol=1e-3)
                torch.testing.assert_close(lse_c, lse_e, rtol=1e-5, atol=1e-4)
            assert torch.equal(comp.k_cache, ref[3]) and torch.equal(comp.v_cache, ref[4]), \
                "the compiled call did not mutate the caches passed in as the append requires"
            assert torch.equal(eager.k_cache, ref[3]) and torch.equal(eager.v_cache, ref[4])
            lens = lens + 1


# ---- CUDA: long caches, compute-sanitizer --------------------------------------------------------------
@gpu
@pytest.mark.parametrize("num_splits", [0, 1, 256])
@pytest.mark.parametrize("page_size", [None, 256], ids=["contiguous", "paged256"])
@pytest.mark.parametrize("capacity", [8192, 32768])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("target", KV_TARGETS[1:])
def test_long_cache(target, sq, capacity, page_size, num_splits):
    """Caches of 8K and 32K tokens (one sequence full, one short), GQA 4, decode and 4-token
    speculative steps, with the heuristic's split, without, and with the most splits the op
    allows (256, capped at one per key tile: the combine's largest case, most splits empty for the
    short sequence)."""
    b, h, hkv, d = 2, 32, 8, 128
    cache = make_cache(b, capacity, hkv, d, dtype=torch.bfloat16, device="cuda", page_size=page_size)
    q = torch.randn(b, sq, h, d, device="cuda").to(torch.bfloat16)
    k, v = make_new(b, sq, hkv, d, torch.bfloat16, "cuda")
    lens = torch.tensor([cache.capacity - sq, 1000], dtype=torch.int32, device="cuda")
    with on(target):
        check_kvcache(q, cache.k_cache, cache.v_cache, k, v, cache_seqlens=lens, block_table=cache.block_table,
                      causal=True, num_splits=num_splits)


@gpu
@pytest.mark.parametrize("family", ["auto", "sm80", "sm90"])
def test_chunked_prefill_kernels(family):
    """A chunk of 256 queries (appended to the cache) against caches of 2000 and 900 tokens,
    causal, GQA 4: within the criterion in every family, and the kernel that runs is the one the
    dispatcher names for it (dispatch.cu): the sm90 forward under "sm90", and under "auto" on
    sm90 GPUs (its query rows fill the SMs: 2 x 256 x 16 = 8192 >= 60 per SM); the KV-cache
    kernel under "sm80"."""
    b, sq, h, hkv, d, capacity = 2, 256, 16, 4, 128, 2304
    cache = make_cache(b, capacity, hkv, d, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(b, sq, h, d, device="cuda").to(torch.bfloat16)
    k, v = make_new(b, sq, hkv, d, torch.bfloat16, "cuda")
    lens = torch.tensor([2000, 900], dtype=torch.int32, device="cuda")
    with on(("cuda", family)), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        check_kvcache(q, cache.k_cache, cache.v_cache, k, v, cache_seqlens=lens, causal=True)
    names = [e.name for e in prof.events() if "flashcute_fwd_kernel" in e.name]
    on_sm90 = torch.cuda.get_device_capability() == (9, 0) and "sm90" in flashcute.kernels.available()
    expected = "sm90" if family == "sm90" or (family == "auto" and on_sm90) else "sm80"
    assert names and all(f"{expected}::" in n for n in names), names


@gpu
@pytest.mark.parametrize("family", ["auto", "sm80"])
def test_decode_tile(family):
    """Decoding's tile (sm80/fwd_launch.h: 16 query rows, the warps side by side along the keys,
    merged in the epilogue) serves calls of at most 16 packed rows without softcap or ALiBi, the
    64-row tile the others; within the criterion at key counts where some warps, or whole splits,
    see no key (0, 1, 31, 33, 127, 129 and 3000 keys), with one split, three, and the default."""
    b, h, hkv, d = 7, 32, 8, 128
    _need_kernel("cuda", d, torch.bfloat16)
    cache = make_cache(b, 3072, hkv, d, dtype=torch.bfloat16, device="cuda", page_size=16)
    lens = torch.tensor([0, 1, 31, 33, 127, 129, 3000], dtype=torch.int32, device="cuda")
    kv = dict(cache_seqlens=lens, block_table=cache.block_table)

    def rows_of_kernels(sq, **kw):  # the query rows of the KV-cache kernels a call ran
        q = torch.randn(b, sq, h, d, device="cuda").to(torch.bfloat16)
        with on(("cuda", family)), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            check_kvcache(q, cache.k_cache, cache.v_cache, **kv, **kw)
        names = [e.name for e in prof.events() if "flashcute_fwd_kernel" in e.name or "flashcute_decode_kernel" in e.name]
        # (the sm90 decoding kernel, which serves these decoding calls under "auto" on sm90 GPUs,
        # runs the same 16-row tile: sm90/traits.h DecodeTraits)
        return {16 if "flashcute_decode_kernel" in n else int(m.group(1))
                for n in names for m in [re.search(r"KernelTraits<\d+, (\d+),", n)] if m or "decode_kernel" in n}

    for ns in (0, 1, 3):
        assert rows_of_kernels(1, num_splits=ns) == {16}, f"decode (4 packed rows), num_splits={ns}"
        assert rows_of_kernels(1, num_splits=ns, window_size=(100, 0)) == {16}, f"windowed decode, num_splits={ns}"
    assert rows_of_kernels(5) == {64}, "5 positions x 4 heads = 20 packed rows"
    assert rows_of_kernels(1, softcap=30.0) == {64}, "softcap decode"


def _poison_unused(cache, lens, value):
    """Fills the cache positions past lens[b] of every sequence with `value` (NaN, inf: what an
    unwritten or reused cache may hold)."""
    for b, n in enumerate(lens.tolist()):
        t = torch.arange(n, cache.capacity, device=cache.k_cache.device)
        for c in (cache.k_cache, cache.v_cache):
            if cache.block_table is None:
                c[b, t] = value
            else:
                page = cache.k_cache.shape[1]
                c[cache.block_table[b, t // page].long(), t % page] = value


@gpu
@pytest.mark.parametrize("page_size", [None, 16, 48, 128], ids=["contig", "p16", "p48", "p128"])
@pytest.mark.parametrize("feature", [{}, dict(causal=True), dict(window_size=(700, 0))], ids=["plain", "causal", "win"])
def test_sm90_decoding_kernel(page_size, feature):
    """The sm90 decoding kernel (sm90/decode_launch.h) on sm90 GPUs, 32 query heads over 8 KV heads
    (4 packed rows; 4 x 8 head groups): within the criterion for every split count it takes (1-8,
    a cluster each), with used lengths that end inside a tile, on a tile boundary, at 1 and at 0
    keys; the cache past the used positions holds NaN (V's rows there are zeroed by the consumers,
    K's masked), which must not reach out or lse (nor, where the sm80 kernel runs, through it). The
    kernel that ran: the decoding kernel on contiguous caches and pages that hold whole tiles (128
    tokens), under kernels("sm90") and under "auto" (dispatch.cu: it is the faster there), with no
    combine kernel after it; the sm80 KV-cache kernel on smaller pages (16, 48 tokens)."""
    if torch.cuda.get_device_capability() != (9, 0) or "sm90" not in flashcute.kernels.available():
        pytest.skip("the sm90 decoding kernel runs on sm90 GPUs in builds with the sm90 family")
    b, h, hkv, d, capacity = 4, 32, 8, 128, 4096
    _need_kernel("cuda", d, torch.bfloat16)
    clean = make_cache(b, capacity, hkv, d, dtype=torch.bfloat16, device="cuda", page_size=page_size)
    lens = torch.tensor([3000, 1, 0, 2048], dtype=torch.int32, device="cuda")
    cache = clean.clone()
    _poison_unused(cache, lens, float("nan"))
    q = torch.randn(b, 1, h, d, device="cuda").to(torch.bfloat16)
    kw = dict(cache_seqlens=lens, block_table=clean.block_table, **feature)
    ref_out, ref_lse, pt_out, _, _ = reference_kvcache(q, clean.k_cache, clean.v_cache, **kw)
    for family in ("sm90", "auto"):
        decoding = page_size is None or page_size % 128 == 0
        for ns in (0, 1, 2, 3, 5, 8):
            with on(("cuda", family)), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                out, lse = run_kvcache(q, cache.k_cache, cache.v_cache, num_splits=ns, **kw)
            names = [e.name for e in prof.events() if "flashcute" in e.name]
            assert names and all(("flashcute_decode_kernel" in n) == decoding for n in names), (family, ns, names)
            check_precision(f"out ({family}, num_splits={ns})", out, ref_out, pt_out, 2.0)
            check_lse(lse, ref_lse, name=f"lse ({family}, num_splits={ns})")
            assert (out[2] == 0).all(), "out is not 0 for the empty sequence"


@gpu
@pytest.mark.parametrize("sq,nheads_kv", [(1, 4), (1, 1), (5, 1)], ids=["decode-mha", "decode-gqa4", "sq5-gqa4"])
def test_grid_past_65535_sequences(sq, nheads_kv):
    """More sequences than a grid's y extent holds (65535): the KV-cache kernels' 1-D grid
    (common/scheduler.h KvCacheTileScheduler), on decoding's tile and the 64-row one, with lengths
    from 0 to the capacity and two splits (the second one empty where a sequence has at most 128
    keys: its CTAs return before the main loop). Bitwise equal to the same sequences in two calls
    (3-D grids: every sequence computed by the same arithmetic), and the last 40 sequences within
    the criterion against the reference."""
    b, h, d, capacity = 65535 + 37, 4, 64, 256  # two 128-key tiles: two splits
    _need_kernel("cuda", d, torch.bfloat16)
    cache = make_cache(b, capacity, nheads_kv, d, dtype=torch.bfloat16, device="cuda")
    q = torch.randn(b, sq, h, d, device="cuda").to(torch.bfloat16)
    lens = torch.randint(0, capacity + 1, (b,), dtype=torch.int32, device="cuda")
    out, lse = run_kvcache(q, cache.k_cache, cache.v_cache, cache_seqlens=lens, num_splits=2)
    for part in (slice(0, b // 2), slice(b // 2, b)):
        out_p, lse_p = run_kvcache(q[part], cache.k_cache[part], cache.v_cache[part], cache_seqlens=lens[part],
                                   num_splits=2)
        assert torch.equal(out[part], out_p) and torch.equal(lse[part], lse_p), f"sequences {part}: 1-D != 3-D grid"
    tail = slice(b - 40, b)
    ref_out, ref_lse, pt_out, _, _ = reference_kvcache(q[tail], cache.k_cache[tail], cache.v_cache[tail],
                                                       cache_seqlens=lens[tail])
    check_precision("out", out[tail], ref_out, pt_out, 2.0)
    check_lse(lse[tail], ref_lse)


@gpu
@pytest.mark.parametrize("target", TARGETS[1:])
def test_sanitizer_small(target):
    """Small and quick, for compute-sanitizer: a paged cache with a random block table, random
    lengths (0 and full included), an append, GQA, causal, every num_splits."""
    b, sq, h, hkv, d, page = 4, 2, 8, 2, 64, 16
    cache = make_cache(b, 100, hkv, d, dtype=torch.float16, device="cuda", page_size=page, spare_pages=5)
    q = torch.randn(b, sq, h, d, device="cuda").half()
    k, v = make_new(b, 2, hkv, d, torch.float16, "cuda")
    lens = make_lengths("var", b, cache.capacity, 2, "cuda")
    with on(target):
        for ns in NUM_SPLITS:
            c = cache.clone()
            check_kvcache(q, c.k_cache, c.v_cache, k, v, cache_seqlens=lens, block_table=cache.block_table,
                          causal=True, num_splits=ns)
