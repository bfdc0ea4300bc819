"""A few small shapes for compute-sanitizer (memcheck, racecheck, synccheck), under every kernel
family of the build: uneven seqlens, padded head dims, causal, GQA, dense and block-sparse (the
mask's transpose stage included, and a mask with out-of-range entries passed straight to the op);
sliding windows, softcap, ALiBi, dropout, deterministic mode; persistent CTAs (the sm90 forward's and
backward's); the sm90 forward's 192-row tiles (d <= 64) and wider key tiles (d128, d192, d256);
packed variable-length batches with empty sequences and rows past the last sequence; forward and
backward; the KV cache (attention_with_kvcache): appends, contiguous and paged caches in random page
order, decoding's 16-row tile and the 64-row one, forced and heuristic splits with their combine,
the sm90 decoding kernel (TMA, a cluster of splits; under kernels("sm90") and where "auto" picks it),
GQA packing, MQA, windows, softcap, ALiBi, the sm90 forward over a cache (kernels("sm90")), and
device-side values out of range (lengths past the capacity, page ids outside the pool), which
the kernels must clamp or drop.
Run as: compute-sanitizer --tool memcheck python scripts/sanitize_shapes.py [WORD ...]
(with words: only the cases whose description contains one of them, e.g. `kvcache`)."""
import sys

import torch

import flashcute

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, block-sparse density, extra kwargs)
    (1, 113, 255, 4, 2, 64, True, None, {}),
    (2, 130, 67, 2, 1, 72, False, None, {}),
    (1, 64, 128, 2, 2, 128, True, None, {}),
    (1, 33, 17, 2, 2, 256, True, None, {}),
    (1, 7, 300, 2, 1, 40, False, None, {}),
    (1, 300, 700, 4, 2, 128, True, 0.5, {}),
    (2, 520, 260, 2, 2, 64, False, 0.3, {}),
    (1, 400, 333, 4, 2, 128, True, None, dict(window_size=(70, 0), softcap=20.0)),
    (2, 200, 300, 4, 4, 64, False, None, dict(window_size=(33, 50), alibi_slopes="h")),
    (1, 113, 255, 4, 2, 64, True, None, dict(dropout_p=0.2)),
    (1, 300, 700, 4, 2, 128, False, 0.5, dict(dropout_p=0.1, softcap=10.0)),
    (2, 300, 400, 4, 2, 96, True, None, dict(deterministic=True)),
    # more tiles than an H100's 132 SMs, short keys: persistent CTAs of the sm90 forward (pairs of
    # query blocks when causal; every 132nd tile when dense)
    (20, 256, 256, 8, 2, 64, True, None, {}),
    (6, 384, 400, 8, 8, 128, False, None, {}),
    # ... and block-sparse (persistent at any key range: pairs of query blocks when causal)
    (6, 700, 900, 8, 2, 128, True, 0.3, {}),
    (6, 640, 640, 8, 8, 64, False, 0.2, {}),
    # 192-row query tiles of the sm90 forward at d <= 64: dense (persistent), causal and windowed
    # calls over 4096 keys
    (20, 300, 300, 8, 2, 64, False, None, dict(dropout_p=0.1)),
    (1, 300, 4400, 2, 1, 64, True, None, {}),
    (1, 400, 4500, 2, 2, 32, False, None, dict(window_size=(3000, 1500))),
    (1, 400, 4500, 2, 2, 64, False, None, dict(window_size=(3000, 1500), softcap=10.0)),  # (not the plain twin)
    # last query tiles with whole warpgroups of rows past the sequence (two of the three of a
    # 192-row tile, one of the two of a 128-row tile), on the sm90 forward's persistent grids
    (20, 200, 200, 8, 2, 64, False, None, {}),
    (6, 320, 400, 8, 8, 128, False, None, {}),
    # the sm90 forward's wider key tiles of plain calls: d128 dense over 4096 keys (176), d192 (112)
    # and d256 (80) dense and windowed (partial last key tiles)
    (1, 200, 4500, 2, 1, 128, False, None, {}),
    (2, 150, 333, 2, 2, 192, False, None, {}),
    (1, 260, 300, 2, 1, 256, False, None, dict(window_size=(100, 20))),
]
# Packed batches: (sequence lengths q, k, extra rows of q past the last sequence, heads, kv heads, headdim, causal,
# dropout_p)
VARLEN = [
    ([5, 0, 130, 64, 1], [7, 9, 0, 200, 1], 3, 4, 2, 64, True, 0.0),
    ([100, 300], [300, 100], 0, 2, 1, 128, False, 0.0),
    ([5, 0, 130, 64, 1], [7, 9, 0, 200, 1], 3, 4, 2, 128, False, 0.15),
    # more key tiles than an H100's 132 SMs (432): the sm90 backward's persistent CTAs walk several,
    # skipping those past a sequence's end
    ([0, 300, 3, 0, 260, 1] * 6, [129, 300, 0, 5, 260, 300] * 6, 3, 4, 4, 64, True, 0.0),
]
# KV cache: (batch, seqlen_q, seqlen_new, capacity, heads, kv heads, headdim, page size (0: contiguous),
# num_splits, causal, extra kwargs)
KVCACHE = [
    (3, 1, 1, 320, 8, 2, 128, 16, 0, False, {}),  # decoding's tile (4 packed rows), heuristic splits
    (3, 1, 0, 300, 8, 2, 64, 0, 3, True, dict(window_size=(100, 0))),  # decoding's tile, windowed
    (2, 5, 2, 256, 8, 2, 128, 128, 0, True, {}),  # the 64-row tile (20 packed rows)
    (2, 1, 1, 200, 8, 1, 64, 0, 17, False, dict(softcap=30.0)),  # MQA, softcap: the 64-row tile
    (2, 3, 0, 192, 4, 4, 128, 16, 2, True, dict(alibi_slopes="h")),  # ALiBi: one head per CTA
    # ALiBi on GQA-packed rows (the kRowSlopes kernels): 69 packed rows, the second tile starting
    # inside a position; MQA with a window
    (2, 23, 0, 300, 6, 2, 128, 16, 0, True, dict(alibi_slopes="h")),
    (2, 1, 1, 200, 8, 1, 64, 0, 5, False, dict(alibi_slopes="h", window_size=(60, 0))),
    (1, 70, 10, 400, 4, 2, 64, 0, 1, True, {}),  # chunked prefill (the sm90 forward under kernels("sm90"))
    # the sm90 decoding kernel (the second above too, under kernels("sm90")): a cluster of 8 splits
    # over 128-token pages; 5 splits over a contiguous cache whose lengths end inside tiles
    (2, 1, 0, 1024, 32, 8, 128, 128, 8, False, {}),
    (2, 2, 1, 777, 16, 8, 64, 0, 5, True, {}),
    # pages smaller than the decoding kernel's tile, 48 tokens (the sm80 kernel's paged path): a
    # tile's rows in different pages, lengths ending inside a page
    (3, 1, 1, 480, 16, 4, 128, 48, 0, False, {}),
]
# (the same, then: lengths past the capacity and page ids outside the pool; CUDA tensors are not
# checked on the host, so only the kernels stand between these values and memory)
KVCACHE_WILD = [
    (3, 1, 1, 64, 4, 1, 64, 16, 3, False, {}),
    (3, 2, 2, 96, 4, 2, 128, 0, 0, True, {}),
    (3, 1, 1, 128, 8, 2, 128, 32, 4, False, {}),
]


def wild_mask(mask):
    """The mask's lists with out-of-range entries (the op must skip them, never read them)."""
    idx = mask.kv_indices.clone()
    idx[..., 0] = 1 << 30
    return (mask.kv_num_blocks, idx, None, None, list(mask.block_size))


def with_slopes(extra, h):
    """The case's extra kwargs, alibi_slopes="h" made (h,) random slopes."""
    kw = dict(extra)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = torch.rand(h, device="cuda")
    return kw


def dense_case(b, sq, sk, h, hk, d, causal, density, extra, dtype):
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    kw = with_slopes(extra, h)
    mask = None
    if density is not None:
        mask = flashcute.masks.random_blocks(sq, sk, density, batch=b, heads=h, device="cuda")
        torch.ops.flashcute.attention(q, k, v, causal, None, False, *wild_mask(mask))
    out = flashcute.attention(q, k, v, causal=causal, block_mask=mask, **kw)
    out.backward(torch.randn_like(out))


def varlen_case(lens_q, lens_k, extra_rows, h, hk, d, causal, dropout_p, dtype):
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lens_q) + extra_rows, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lens_k) + 2, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lens_k) + 2, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    out = flashcute.attention_varlen(q, k, v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                     window_size=(40, -1), alibi_slopes=torch.rand(len(lens_q), h, device="cuda"),
                                     dropout_p=dropout_p)
    out.backward(torch.randn_like(out))


def kvcache_case(b, sq, s_new, cap, h, hk, d, page, num_splits, causal, extra, dtype, wild=False):
    pages = b * cap // page + 3 if page else b
    rows = page if page else cap
    k_cache = torch.randn(pages, rows, hk, d, device="cuda", dtype=dtype)
    v_cache = torch.randn(pages, rows, hk, d, device="cuda", dtype=dtype)
    table = torch.randperm(pages, device="cuda")[:b * (cap // page)].view(b, -1).int() if page else None
    lens = torch.randint(0, cap - s_new + 1, (b,), device="cuda", dtype=torch.int32)
    lens[0], lens[-1] = 0, cap - s_new
    if wild:
        lens[1] = cap + 37  # past the capacity: the append drops it, the keys stop at the capacity
        if table is not None:
            table[0, 0], table[-1, -1] = 1 << 20, -3  # outside the pool: clamped
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype)
    k, v = (torch.randn(b, s_new, hk, d, device="cuda", dtype=dtype) for _ in range(2)) if s_new else (None, None)
    kw = with_slopes(extra, h)
    flashcute.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=lens, block_table=table,
                                     causal=causal, num_splits=num_splits, **kw)


def run(what, case, *args):
    """Runs one case; a head dim or dtype that a restricted build (FLASHCUTE_HEADDIMS /
    FLASHCUTE_DTYPES) has no kernel for is skipped, any other error stops the script."""
    if len(sys.argv) > 1 and not any(word in what for word in sys.argv[1:]):
        return
    try:
        case(*args)
    except RuntimeError as e:
        if "has no kernel in this build" not in str(e):
            raise
        print(f"skip {what}: {str(e).splitlines()[0]}", flush=True)
        return
    torch.cuda.synchronize()
    print(f"ok {what}", flush=True)


torch.manual_seed(0)
for family in flashcute.kernels.runnable():
    with flashcute.kernels(family):
        for dtype in (torch.float16, torch.bfloat16):
            for shape in SHAPES:
                run(f"{family} fwd+bwd {shape[:8]} {shape[8]} {dtype}", dense_case, *shape, dtype)
            for case in VARLEN:
                run(f"{family} varlen fwd+bwd {case} {dtype}", varlen_case, *case, dtype)
            for case in KVCACHE:
                run(f"{family} kvcache {case[:10]} {case[10]} {dtype}", kvcache_case, *case, dtype)
            for case in KVCACHE_WILD:
                run(f"{family} kvcache wild {case[:10]} {dtype}", kvcache_case, *case, dtype, True)
