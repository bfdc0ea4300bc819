"""One backward (and forward) of flashcute and of SDPA's flash backend on the same inputs, for
`ncu` to compare kernel by kernel (see docs/NOTES.md). Usage:
ncu --clock-control none --kernel-name regex:"flashcute_bwd_kernel|flash_bwd|flashcute_fwd|flash_fwd" \
    --section SpeedOfLight --section WarpStateStats python scripts/ncu_compare.py"""
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcute

b, s, h, d = 2, 4096, 16, int(sys.argv[1]) if len(sys.argv) > 1 else 128
causal = len(sys.argv) > 2 and sys.argv[2] == "causal"
q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    flashcute.attention(q, k, v, causal=causal).backward(g)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=causal).backward(g.transpose(1, 2))
torch.cuda.synchronize()
