"""The Python API: ``flashcute.attention`` and the SDPA drop-in ``flashcute.sdpa``."""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F

from .block_sparse import BlockSparseMask

_warned: set[str] = set()


def attention(q, k, v, *, causal=False, scale=None, block_mask=None, deterministic=False,
              return_lse=False):
    """Exact attention, FlashAttention-2 style.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim) with
    nheads % nheads_kv == 0 (GQA/MQA). Any strides with stride(-1) == 1 (no copies).
    causal masks key j for query i when j > i + seqlen_k - seqlen_q (bottom-right aligned).
    scale defaults to 1/sqrt(headdim). Returns out (q's dtype and shape), and with
    return_lse=True also lse: float32 (batch, nheads, seqlen_q), natural log.
    Differentiable in q, k, v; deterministic=True makes the backward bitwise reproducible.
    block_mask: a flashcute.BlockSparseMask; scores outside its listed blocks are -inf (combines
    with causal). Rows left with no key get out 0 and lse -inf.
    """
    mask_args = ()
    if block_mask is not None:
        if not isinstance(block_mask, BlockSparseMask):
            hint = (" (for a FlexAttention BlockMask use flashcute.BlockSparseMask.from_flex)"
                    if type(block_mask).__name__ == "BlockMask" else "")
            raise TypeError("flashcute.attention: block_mask must be a flashcute.BlockSparseMask, got "
                            f"{type(block_mask).__name__}{hint}")
        m = block_mask
        mask_args = (m.kv_num_blocks, m.kv_indices, m.q_num_blocks, m.q_indices, list(m.block_size))
    if scale is not None:
        scale = float(scale)
    out, lse = torch.ops.flashcute.attention(q, k, v, bool(causal), scale, bool(deterministic),
                                             *mask_args)
    return (out, lse) if return_lse else out


def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashcute.sdpa: {reason}; using torch's scaled_dot_product_attention",
                      stacklevel=3)


def _unsupported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
    """Why flashcute cannot serve this call, or None when it can."""
    if attn_mask is not None:
        return "attn_mask is not supported"
    if dropout_p != 0.0:
        return "dropout_p > 0 is not supported"
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        return "only 4-D (batch, heads, seq, dim) inputs are supported"
    if not (query.device == key.device == value.device):
        return "inputs on different devices"
    allowed = (torch.float16, torch.bfloat16) if query.is_cuda else (
        (torch.float32, torch.float16, torch.bfloat16) if query.device.type == "cpu" else ())
    if not allowed:
        return f"device type {query.device.type} is not supported"
    if query.dtype not in allowed or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype} on {query.device.type} is not supported"
    d = query.shape[-1]
    if d % 8 != 0 or d > 256 or key.shape[-1] != d or value.shape[-1] != d:
        return "head dims must agree and be a multiple of 8 up to 256"
    if key.shape[1] != query.shape[1]:
        if not enable_gqa:
            return "different head counts without enable_gqa"
        if key.shape[1] == 0 or query.shape[1] % key.shape[1] != 0:
            return "query heads not a multiple of key heads"
    if is_causal and query.shape[2] != key.shape[2]:
        return "is_causal with seq_q != seq_k (top-left alignment) is not supported"
    if any(t.stride(-1) != 1 for t in (query, key, value)):
        return "inputs with stride(-1) != 1 are not supported"
    if query.is_cuda:
        if torch.cuda.get_device_capability(query.device) < (8, 0):
            return "GPUs older than sm80 are not supported"
        if not torch.ops.flashcute.has_cuda_kernel(d, query.dtype):
            return f"this build has no CUDA kernel for head dim {d} in {query.dtype}"
    return None


def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
         enable_gqa=False):
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on (b, h, s, d).

    Same semantics (``is_causal`` is top-left aligned). Calls that flashcute cannot serve
    go to PyTorch's SDPA, with a warning once per reason.
    """
    reason = _unsupported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    if reason is not None:
        _fallback(reason)
        kwargs = {"enable_gqa": enable_gqa} if enable_gqa else {}
        return F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask,
                                              dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, **kwargs)
    out = attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                    causal=is_causal, scale=scale)
    return out.transpose(1, 2)


__all__ = ["attention", "sdpa"]
