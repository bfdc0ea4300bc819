"""Ground truth for the tests: attention by plain PyTorch math.

``attention`` has the signature of ``flashcute.attention``. By default it computes in
float32 on upcast copies of the inputs (ref32 of the SPEC's precision criterion); with
``upcast=False`` it computes in the inputs' own dtype (pt of the criterion).
"""
from __future__ import annotations

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k), True where key j is visible to query i (bottom-right aligned)."""
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    return j <= i + (seqlen_k - seqlen_q)


def attention(q, k, v, *, causal=False, scale=None, block_mask=None, deterministic=False,
              return_lse=False, upcast=True):
    del deterministic  # the math is deterministic
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    b, sq, h, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    if scale is None:
        scale = d ** -0.5
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=2)
        v = v.repeat_interleave(h // h_kv, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k) if not upcast else \
        torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    visible = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if causal:
        visible = visible & causal_mask(sq, sk, q.device)
    if block_mask is not None:
        visible = visible & block_mask.to_dense(sq, sk).to(q.device)
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(scores.float(), dim=-1)  # (b, h, sq); -inf on empty rows
    # Rows with no visible key get probability 0 (out 0), with finite gradients.
    row_any = visible.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~row_any, 0.0), dim=-1).masked_fill(~row_any, 0.0)
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v).to(dtype)
    return (out, lse) if return_lse else out
