"""A few small shapes for compute-sanitizer (memcheck, racecheck, synccheck), under every kernel
family of the build: uneven seqlens, padded head dims, causal, GQA, dense and block-sparse (the
mask's transpose stage included, and a mask with out-of-range entries passed straight to the op);
sliding windows, softcap, ALiBi, dropout, deterministic mode; persistent CTAs (the sm90 forward's and
backward's); the sm90 forward's 192-row tiles (d <= 64) and wider key tiles (d128, d192, d256);
packed variable-length batches with empty sequences and rows past the last sequence; forward and
backward.
Run as: compute-sanitizer --tool memcheck python scripts/sanitize_shapes.py"""
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
    # 192-row query tiles of the sm90 forward at d <= 64: dense (persistent), causal and windowed
    # calls over 4096 keys
    (20, 300, 300, 8, 2, 64, False, None, dict(dropout_p=0.1)),
    (1, 300, 4400, 2, 1, 64, True, None, {}),
    (1, 400, 4500, 2, 2, 32, False, None, dict(window_size=(3000, 1500))),
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


def wild_mask(mask):
    """The mask's lists with out-of-range entries (the op must skip them, never read them)."""
    idx = mask.kv_indices.clone()
    idx[..., 0] = 1 << 30
    return (mask.kv_num_blocks, idx, None, None, list(mask.block_size))


def dense_case(b, sq, sk, h, hk, d, causal, density, extra, dtype):
    q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
    kw = dict(extra)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = torch.rand(h, device="cuda")
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


def run(what, case, *args):
    """Runs one case; a head dim or dtype that a restricted build (FLASHCUTE_HEADDIMS /
    FLASHCUTE_DTYPES) has no kernel for is skipped, any other error stops the script."""
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
