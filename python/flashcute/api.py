"""The Python API: ``flashcute.attention``, ``flashcute.attention_varlen``, the SDPA drop-in
``flashcute.sdpa`` and the kernel-family setting ``flashcute.kernels``."""
from __future__ import annotations

import functools
import numbers
import warnings

import torch
import torch.nn.functional as F

from .block_sparse import BlockSparseMask

_warned: set[str] = set()


# ---- argument checks that need Python types -----------------------------------------------
_NO_WINDOW = (-1, -1)


def _window(fn, window_size):
    if window_size is _NO_WINDOW:  # the default (integrations call per layer: each microsecond counts)
        return -1, -1
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in window_size)):
        raise TypeError(f"{fn}: window_size must be a pair of ints (left, right), -1 meaning unbounded; "
                        f"got {window_size!r}")
    return int(window_size[0]), int(window_size[1])


def _number(fn, name, value):
    if type(value) is float:
        return value
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a number, got {type(value).__name__}")
    return float(value)


def _dropout(fn, q, dropout_p, rng_state):
    """dropout_p as a float and the rng_state of the call: the caller's, or with dropout_p > 0 one
    drawn from torch's default generator for q's device (so torch.manual_seed makes runs
    reproducible, and a CUDA graph replay draws a new one). The op checks both."""
    dropout_p = _number(fn, "dropout_p", dropout_p)
    if rng_state is not None and not isinstance(rng_state, torch.Tensor):
        raise TypeError(f"{fn}: rng_state must be an int64 tensor (seed, offset) of shape (2,) or None, got "
                        f"{type(rng_state).__name__}")
    if rng_state is None and dropout_p > 0 and isinstance(q, torch.Tensor):
        rng_state = torch.randint(-2**63, 2**63 - 1, (2,), dtype=torch.int64, device=q.device)
    return dropout_p, rng_state


def attention(q, k, v, *, causal=False, scale=None, window_size=_NO_WINDOW, softcap=0.0, alibi_slopes=None,
              block_mask=None, dropout_p=0.0, rng_state=None, deterministic=False, return_lse=False):
    """Exact attention, FlashAttention-2 style (SPEC v2).

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim) with
    nheads % nheads_kv == 0 (GQA/MQA). Any strides with stride(-1) == 1 (no copies).
    Query row i sits at key position p_i = i + seqlen_k - seqlen_q (bottom-right aligned) and sees
    the keys j with p_i - L <= j <= p_i + R for window_size = (L, R), -1 meaning unbounded;
    causal=True forces R = 0. softcap c > 0: scores c * tanh(s / c). alibi_slopes (float32,
    (nheads,) or (batch, nheads)): scores - slope * |p_i - j|. block_mask: a
    flashcute.BlockSparseMask; scores outside its listed blocks are -inf. scale defaults to
    1/sqrt(headdim). dropout_p > 0: after the softmax, P = P * keep / (1 - dropout_p) with keep
    from ``dropout_mask(rng_state, ...)``; rng_state (int64 (2,) (seed, offset) on q's device) is
    drawn from torch's generator when None; lse never includes dropout. Returns out (q's dtype and
    shape), and with return_lse=True also lse: float32 (batch, nheads, seqlen_q), natural log.
    Rows left with no key get out 0 and lse -inf. Differentiable in q, k, v; deterministic=True
    makes the backward bitwise reproducible.
    """
    fn = "flashcute.attention"
    mask_args = ()
    if block_mask is not None:
        if not isinstance(block_mask, BlockSparseMask):
            hint = (" (for a FlexAttention BlockMask use flashcute.BlockSparseMask.from_flex)"
                    if type(block_mask).__name__ == "BlockMask" else "")
            raise TypeError(f"{fn}: block_mask must be a flashcute.BlockSparseMask, got "
                            f"{type(block_mask).__name__}{hint}")
        m = block_mask
        mask_args = (m.kv_num_blocks, m.kv_indices, m.q_num_blocks, m.q_indices, list(m.block_size))
    else:
        mask_args = (None, None, None, None, [128, 128])
    left, right = _window(fn, window_size)
    softcap = _number(fn, "softcap", softcap)
    dropout_p, rng_state = _dropout(fn, q, dropout_p, rng_state)
    if scale is not None:
        scale = _number(fn, "scale", scale)
    out, lse = torch.ops.flashcute.attention(q, k, v, bool(causal), scale, bool(deterministic), *mask_args,
                                             left, right, softcap, alibi_slopes, dropout_p, rng_state)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False, scale=None,
                     window_size=_NO_WINDOW, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None,
                     deterministic=False, return_lse=False):
    """Attention over a packed batch of variable-length sequences (SPEC v2).

    q: (total_q, nheads, headdim); k, v: (total_k, nheads_kv, headdim); sequence s owns rows
    cu_seqlens_q[s]:cu_seqlens_q[s + 1] of q and cu_seqlens_k[s]:cu_seqlens_k[s + 1] of k, v
    (int32 (n + 1,) on q's device, cu[0] = 0, nondecreasing); max_seqlen_q / max_seqlen_k: Python
    ints >= every length. Everything of ``attention`` applies per sequence (alignment, window,
    ALiBi with (n, nheads) slopes; dropout with the mask of ``dropout_mask(rng_state, n, nheads,
    max_seqlen_q, max_seqlen_k, dropout_p)``, sequence s being batch entry s). Rows of q past
    cu_seqlens_q[-1] get out 0, lse -inf and zero gradients; rows of k, v past cu_seqlens_k[-1] get
    zero gradients. lse: (nheads, total_q).
    """
    fn = "flashcute.attention_varlen"
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}")
    left, right = _window(fn, window_size)
    softcap = _number(fn, "softcap", softcap)
    dropout_p, rng_state = _dropout(fn, q, dropout_p, rng_state)
    if scale is not None:
        scale = _number(fn, "scale", scale)
    out, lse = torch.ops.flashcute.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q),
                                                    int(max_seqlen_k), bool(causal), scale, bool(deterministic),
                                                    left, right, softcap, alibi_slopes, dropout_p, rng_state)
    return (out, lse) if return_lse else out


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                           causal=False, scale=None, window_size=_NO_WINDOW, softcap=0.0, alibi_slopes=None,
                           num_splits=0, return_lse=False):
    """Attention of new queries against a KV cache, with the new keys/values appended in place
    (SPEC v2; inference only: a backward through it raises).

    q: (batch, seqlen_q, nheads, headdim). Contiguous cache: k_cache, v_cache (batch, capacity,
    nheads_kv, headdim). Paged cache: (num_pages, page_size, nheads_kv, headdim) with block_table
    int32 (batch, max_pages): position t of sequence b lives in page block_table[b, t // page_size],
    slot t % page_size; page_size a multiple of 16. cache_seqlens: int or int32 (batch,): tokens
    already in the cache (default: the whole capacity; required with a paged cache). k, v
    (batch, seqlen_new, nheads_kv, headdim), if given, are written into the cache at positions
    cache_seqlens[b] ... and attended to; cache_seqlens is not incremented. The keys of sequence b
    are its first cache_seqlens[b] + seqlen_new positions, bottom-right aligned with q (causal,
    window, ALiBi as in ``attention``). Nothing else in the cache changes. Overflowing the capacity
    raises where the lengths are on the host (an int cache_seqlens, CPU tensors); CUDA tensors are
    checked only with FLASHCUTE_CHECK_DEVICE_VALUES=1 (a device sync per call), and otherwise the
    kernels drop what would fall outside the cache and clamp page ids. num_splits: 0 picks a split
    of the keys across CTAs (flash-decoding) by a heuristic, 1 none, n > 1 forces n (at most one
    split per key tile). With GQA each K/V head is read once for all its query heads.
    """
    fn = "flashcute.attention_with_kvcache"
    left, right = _window(fn, window_size)
    softcap = _number(fn, "softcap", softcap)
    if scale is not None:
        scale = _number(fn, "scale", scale)
    if not isinstance(num_splits, numbers.Integral) or isinstance(num_splits, bool):
        raise TypeError(f"{fn}: num_splits must be an int, got {type(num_splits).__name__}")
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: k and v must be given together (k is {'None' if k is None else 'a tensor'}, "
                         f"v is {'None' if v is None else 'a tensor'})")
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{fn}: q must be a tensor, got {type(q).__name__}")
    if cache_seqlens is not None and not isinstance(cache_seqlens, torch.Tensor):
        if not isinstance(cache_seqlens, numbers.Integral) or isinstance(cache_seqlens, bool):
            raise TypeError(f"{fn}: cache_seqlens must be an int or an int32 tensor, got "
                            f"{type(cache_seqlens).__name__}")
        if cache_seqlens < 0:
            raise ValueError(f"{fn}: cache_seqlens is {cache_seqlens}; it must be >= 0")
        _check_capacity(fn, int(cache_seqlens), k_cache, k, block_table)  # free: the value is on the host
        cache_seqlens = torch.full((q.shape[0],), int(cache_seqlens), dtype=torch.int32, device=q.device)
    out, lse = torch.ops.flashcute.attention_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table,
                                                          bool(causal), scale, left, right, softcap,
                                                          alibi_slopes, int(num_splits))
    return (out, lse) if return_lse else out


def _check_capacity(fn, length, k_cache, k, block_table):
    """cache_seqlens given as an int: the overflow check on the host, free on every device (the op
    checks tensors of lengths: on the CPU always, on CUDA with FLASHCUTE_CHECK_DEVICE_VALUES=1)."""
    if not isinstance(k_cache, torch.Tensor) or k_cache.dim() != 4:
        return  # the op names what is wrong
    s_new = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else 0
    paged = isinstance(block_table, torch.Tensor) and block_table.dim() == 2
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[1]
    if length + s_new > capacity:
        origin = (f"block_table.shape[1] pages of page_size tokens = {block_table.shape[1]} x {k_cache.shape[1]}"
                  if paged else "k_cache.shape[1]")
        raise ValueError(f"{fn}: KV-cache overflow: cache_seqlens {length} plus {s_new} new tokens exceeds the "
                         f"capacity {capacity} ({origin})")


# ---- kernel families ------------------------------------------------------------------------
_FAMILIES = {"auto": 0, "sm80": 80, "sm90": 90}
_NAMES = {v: k for k, v in _FAMILIES.items()}


class kernels:  # noqa: N801 (used like a function, as torch.backends' switches)
    """The process-wide kernel family: ``"auto"`` (the default: sm90 on sm90 GPUs for the calls
    it serves, sm80 otherwise), ``"sm80"`` or ``"sm90"``.

    ``flashcute.kernels("sm80")`` sets it; ``with flashcute.kernels("sm80"): ...`` sets it for the
    block and restores the previous one after. A call the forced family does not support runs on
    the other one. Asking for a family that this build or the current GPU lacks raises
    RuntimeError; an unknown name raises ValueError. ``flashcute.kernels.current()`` names the
    setting.
    """

    def __init__(self, family: str = "auto"):
        if family not in _FAMILIES:
            raise ValueError(f"flashcute.kernels: unknown kernel family {family!r}; "
                             f"it must be one of {', '.join(repr(f) for f in _FAMILIES)}")
        if family != "auto":
            _check_family_available(family)
        self._previous = _NAMES[torch.ops.flashcute.set_kernel_family(_FAMILIES[family])]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        torch.ops.flashcute.set_kernel_family(_FAMILIES[self._previous])
        return False

    @staticmethod
    def current() -> str:
        value = torch.ops.flashcute.set_kernel_family(0)
        torch.ops.flashcute.set_kernel_family(value)
        return _NAMES[value]

    @staticmethod
    def available() -> list[str]:
        """The families this build has forward kernels of (``[]`` for a CPU-only build)."""
        return [_NAMES[f] for f in torch.ops.flashcute.kernel_families()]

    @staticmethod
    def runnable(device=None) -> list[str]:
        """The families whose kernels run on ``device`` (default: the current CUDA device). A
        default build compiles the sm80 family's forward and backward for sm90 GPUs only where the
        sm90 family has no kernel, so on an H100 this is ``["sm90"]`` unless the build had
        ``FLASHCUTE_SM80_ON_SM90=ON``."""
        if not torch.cuda.is_available():
            return []
        major, minor = torch.cuda.get_device_capability(device)
        return [_NAMES[f] for f in torch.ops.flashcute.kernel_families(10 * major + minor)]


def _check_family_available(family: str) -> None:
    built = kernels.available()
    if family not in built:
        have = ", ".join(built) if built else "none: this build has only the CPU backend"
        hint = (" (rebuild with FLASHCUTE_CUDA_ARCHS including 90)" if family == "sm90" and built else
                " (rebuild with FLASHCUTE_SM80_ON_SM90=ON, or FLASHCUTE_CUDA_ARCHS including 80)"
                if family == "sm80" and built else "")
        raise RuntimeError(f"flashcute.kernels({family!r}): this build has no {family} kernels "
                           f"(it has: {have}){hint}")
    if not torch.cuda.is_available():
        raise RuntimeError(f"flashcute.kernels({family!r}): no CUDA GPU is available to run the {family} family")
    cap = torch.cuda.get_device_capability()
    need = (9, 0) if family == "sm90" else (8, 0)
    if (family == "sm90" and cap != need) or cap < need:
        raise RuntimeError(f"flashcute.kernels({family!r}): the GPU {torch.cuda.get_device_name()} has compute "
                           f"capability {cap[0]}.{cap[1]}; the {family} family needs {need[0]}.{need[1]}"
                           + ("" if family == "sm80" else " exactly (sm_90a code)"))
    if family not in kernels.runnable():
        raise RuntimeError(f"flashcute.kernels({family!r}): this build has no {family} forward code for the GPU "
                           f"{torch.cuda.get_device_name()} (compute capability {cap[0]}.{cap[1]}): a default build "
                           "compiles the sm80 family for sm90 GPUs only where the sm90 family has no kernel; "
                           "rebuild with -DFLASHCUTE_SM80_ON_SM90=ON (CMAKE_ARGS) to run it there")


# ---- SDPA drop-in -----------------------------------------------------------------------------
def _fallback(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashcute.sdpa: {reason}; using torch's scaled_dot_product_attention",
                      stacklevel=3)


_ALLOWED_DTYPES = {"cuda": (torch.float16, torch.bfloat16), "cpu": (torch.float32, torch.float16, torch.bfloat16)}


def _unsupported(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa):
    """Why flashcute cannot serve this call, or None when it can. (Integrations call it for every
    attention call: written for host time, 4-5 us on a CPU tensor.)"""
    if attn_mask is not None:
        return "attn_mask is not supported"
    if (type(dropout_p) is not float and (not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool))
            or not 0.0 <= dropout_p < 1.0):
        return "dropout_p outside [0, 1)"
    for t in (query, key, value):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            return "only 4-D (batch, heads, seq, dim) inputs are supported"
    device, dtype = query.device, query.dtype
    if key.device != device or value.device != device:
        return "inputs on different devices"
    allowed = _ALLOWED_DTYPES.get(device.type)
    if allowed is None:
        return f"device type {device.type} is not supported"
    if dtype not in allowed or key.dtype != dtype or value.dtype != dtype:
        return f"dtype {dtype} on {device.type} is not supported"
    (_, hq, sq, d), (_, hk, sk, dk), dv = query.shape, key.shape, value.shape[3]
    if d % 8 != 0 or d > 256 or dk != d or dv != d:
        return "head dims must agree and be a multiple of 8 up to 256"
    if hk != hq:
        if not enable_gqa:
            return "different head counts without enable_gqa"
        if hk == 0 or hq % hk != 0:
            return "query heads not a multiple of key heads"
    if is_causal and sq != sk:
        return "is_causal with seq_q != seq_k (top-left alignment) is not supported"
    if query.stride(3) != 1 or key.stride(3) != 1 or value.stride(3) != 1:
        return "inputs with stride(-1) != 1 are not supported"
    if device.type == "cuda":
        return _cuda_unsupported(device, d, dtype)
    return None


@functools.lru_cache(maxsize=None)
def _cuda_unsupported(device, d, dtype):
    """The GPU and build checks of _unsupported, once per (device, head dim, dtype): integrations
    call it for every attention call, and a CPU-bound step pays each microsecond of host time."""
    if torch.cuda.get_device_capability(device) < (8, 0):
        return "GPUs older than sm80 are not supported"
    if not torch.ops.flashcute.has_cuda_kernel(d, dtype):
        return f"this build has no CUDA kernel for head dim {d} in {dtype}"
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
                    causal=is_causal, scale=scale, dropout_p=dropout_p)
    return out.transpose(1, 2)


def dropout_mask(rng_state, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    """The keep mask (bool, (batch, nheads, seqlen_q, seqlen_k), on rng_state's device) that a call
    with these arguments applies (for attention_varlen: batch = sequence index, seqlen = max_seqlen).
    A pure function of its arguments: the same on CPU and CUDA, in both kernel families and every
    tile shape. An element is kept with probability (floor((1 - p) 255) + 1) / 256, within 1/256 of
    1 - p; kept scores are scaled by 1 / (1 - p)."""
    fn = "flashcute.dropout_mask"
    if not isinstance(rng_state, torch.Tensor):
        raise TypeError(f"{fn}: rng_state must be an int64 tensor (seed, offset) of shape (2,), got "
                        f"{type(rng_state).__name__}")
    for name, value in (("batch", batch), ("nheads", nheads), ("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{fn}: {name} must be an int, got {type(value).__name__}")
    dropout_p = _number(fn, "dropout_p", dropout_p)
    return torch.ops.flashcute.dropout_mask(rng_state, int(batch), int(nheads), int(seqlen_q), int(seqlen_k),
                                            dropout_p)


__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "dropout_mask", "kernels", "sdpa"]
