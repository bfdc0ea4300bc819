"""A few small shapes for compute-sanitizer (memcheck, racecheck): uneven seqlens, padded
head dims, causal, GQA, dense and block-sparse (the mask's transpose stage included, and a
mask with out-of-range entries passed straight to the op); forward and backward.
Run as: compute-sanitizer --tool memcheck python scripts/sanitize_shapes.py"""
import torch

import flashcute

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal, block-sparse density)
    (1, 113, 255, 4, 2, 64, True, None),
    (2, 130, 67, 2, 1, 72, False, None),
    (1, 64, 128, 2, 2, 128, True, None),
    (1, 33, 17, 2, 2, 256, True, None),
    (1, 7, 300, 2, 1, 40, False, None),
    (1, 300, 700, 4, 2, 128, True, 0.5),
    (2, 520, 260, 2, 2, 64, False, 0.3),
]


def wild_mask(mask):
    """The mask's lists with out-of-range entries (the op must skip them, never read them)."""
    idx = mask.kv_indices.clone()
    idx[..., 0] = 1 << 30
    return (mask.kv_num_blocks, idx, None, None, list(mask.block_size))


torch.manual_seed(0)
for b, sq, sk, h, hk, d, causal, density in SHAPES:
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
        mask = None
        if density is not None:
            mask = flashcute.masks.random_blocks(sq, sk, density, batch=b, heads=h, device="cuda")
            torch.ops.flashcute.attention(q, k, v, causal, None, False, *wild_mask(mask))
        out = flashcute.attention(q, k, v, causal=causal, block_mask=mask)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
        print(f"ok fwd+bwd b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} density={density} {dtype}",
              flush=True)
