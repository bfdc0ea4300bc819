"""Raises one argument error through the op, on the CPU and on CUDA: a build whose C++ runtime
does not match torch's crashes here instead of raising (scripts/gpu_check.sh runs it first)."""
import torch

import flashcute

for device in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
    q = torch.randn(1, 4, 2, 12, device=device, dtype=torch.bfloat16)
    try:
        flashcute.attention(q, q, q)
    except ValueError as e:
        print(f"ok: {device} error raised: {str(e).splitlines()[0][:80]}")
