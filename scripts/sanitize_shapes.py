"""A few small shapes for compute-sanitizer (memcheck, racecheck): uneven seqlens, padded
head dims, causal, GQA; forward, and backward where the build has the CUDA backward.
Run as: compute-sanitizer --tool memcheck python scripts/sanitize_shapes.py"""
import torch

import flashcute

SHAPES = [  # (batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, causal)
    (1, 113, 255, 4, 2, 64, True),
    (2, 130, 67, 2, 1, 72, False),
    (1, 64, 128, 2, 2, 128, True),
    (1, 33, 17, 2, 2, 256, True),
    (1, 7, 300, 2, 1, 40, False),
]

torch.manual_seed(0)
for b, sq, sk, h, hk, d, causal in SHAPES:
    for dtype in (torch.float16, torch.bfloat16):
        q = torch.randn(b, sq, h, d, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(b, sk, hk, d, device="cuda", dtype=dtype, requires_grad=True)
        out = flashcute.attention(q, k, v, causal=causal)
        try:
            out.backward(torch.randn_like(out))
            what = "fwd+bwd"
        except RuntimeError as exc:
            if "not built yet" not in str(exc):
                raise
            what = "fwd"
        torch.cuda.synchronize()
        print(f"ok {what} b={b} sq={sq} sk={sk} h={h}/{hk} d={d} causal={causal} {dtype}", flush=True)
