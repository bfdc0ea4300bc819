"""flashcute in torch's flash-attention implementation registry (``torch.nn.attention``).

::

    import flashcute.integrations.torch_registry as ftr
    from torch.nn.attention import activate_flash_attention_impl, restore_flash_attention_impl

    ftr.register()                                # adds "FLASHCUTE"; changes nothing yet
    activate_flash_attention_impl("FLASHCUTE")    # (or ftr.activate()); SDPA: flash backend first
    F.scaled_dot_product_attention(q, k, v, is_causal=True)   # SDPA's flash backend: flashcute
    torch.nn.attention.varlen.varlen_attn(...)                # flashcute's varlen kernels
    # context_parallel(...) rings over the same aten ops: flashcute kernels on every step
    restore_flash_attention_impl()                # torch's own FA2 and SDPA priority order again

Activation overrides four aten ops (as torch's own FA4 provider, ``torch/nn/attention/_fa4.py``,
does) with flashcute's kernels:

- ``aten._scaled_dot_product_flash_attention`` and its ``_backward`` (SDPA's flash backend and
  the ring steps of ``torch.distributed.tensor.experimental.context_parallel``);
- ``aten._flash_attention_forward`` / ``_backward`` (dense and varlen; ``varlen_attn``).

on CUDA and, where torch has no kernel for them at all, on CPU (flashcute's CPU backend: so
``varlen_attn`` and these ops also run on machines without a GPU). Autograd, meta kernels and
``torch.compile`` keep using torch's own registrations for these ops. Semantics are torch's:
SDPA's ``is_causal`` is top-left aligned (flashcute's own causal is bottom-right; the override
converts), ``_flash_attention_forward``'s (FA2's) bottom-right. Inputs flashcute cannot serve
(ALiBi, ``seqused_k``, debug masks, dtypes/head dims without a kernel) raise
``RuntimeError``, as torch's FA4 provider does: once the op is overridden there is no path back
to torch's FA2 kernel for that call (restore it with ``restore_flash_attention_impl()``).
Dropout runs with flashcute's mask (``flashcute.dropout_mask`` of the (seed, offset) that the
forward hands to aten as its rng_state), not torch's.

**SDPA's backend priority.** Overriding the flash ops is not enough for a plain
``F.scaled_dot_product_attention`` call: SDPA first picks a backend (``sdp::select_sdp_backend``
walks the global priority order, ``torch._C._get_sdp_priority_order()``), and torch 2.11 on
sm90/sm100 with a cuDNN newer than 9.15 (its CUDA 13 wheels bundle 9.19) puts cuDNN first, once,
at the first backend choice of the process (``priority_order()`` and
``check_prefer_cudnn_attention()`` in ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``;
``TORCH_CUDNN_SDPA_DEPRIORITIZED=1`` opts out), overwriting any order set before. torch's FA3/FA4
providers leave the order alone (FA3's ``torch._C._set_sdp_use_fa3(True)`` only widens the flash
backend's dtype check to fp8; torch's FA4 tests force the backend with ``sdpa_kernel``). Activation
therefore also moves ``FLASH_ATTENTION`` to the front of that order
(``torch._C._set_sdp_priority_order``, what ``sdpa_kernel(..., set_priority=True)`` uses; the
other backends keep their order), after making torch take its one-time default: at once if CUDA
is initialised, else in ``torch.cuda``'s lazy initialisation (a backend choice on empty tensors:
no kernel, no allocation). Restoration puts the previous order back, unless it was changed in
between. So under activation every SDPA call that SDPA's flash backend accepts (e.g. float16 or
bfloat16, head dim <= 256, no ``attn_mask``, ``is_causal`` only with s_q == s_k) runs on flashcute,
on every GPU; those flashcute cannot serve raise as above, where torch would have run cuDNN (Hopper)
or its FA2. Inside ``sdpa_kernel([...], set_priority=True)`` the order given there applies.

Not used inside AOTInductor artefacts (their C shims call torch's kernels statically): there
flashcute appears as ``torch.ops.flashcute.*``.
"""
from __future__ import annotations

import warnings

import torch
from torch.library import Library
from torch.nn.attention import SDPBackend

from .. import api

IMPL_NAME = "FLASHCUTE"

_FLASH = int(SDPBackend.FLASH_ATTENTION)

_OPS = ("_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_backward")


class _Handle:
    """What ``activate_flash_attention_impl`` keeps; ``remove()`` takes the overrides out and
    puts SDPA's previous backend priority order back."""

    def __init__(self, libraries):
        self.libraries = libraries
        self.saved_order = None  # SDPA's priority order before activation
        self.order = None  # the order activation set (FLASH_ATTENTION first)

    def remove(self) -> None:
        global _active
        for lib in self.libraries:
            lib._destroy()
        self.libraries = []
        if _active is self:
            _active = None
        saved, ours = self.saved_order, self.order
        self.saved_order = self.order = None
        if ours is not None and torch._C._get_sdp_priority_order() == ours:
            torch._C._set_sdp_priority_order(saved)  # not if someone set another order since


_active: _Handle | None = None  # the handle of the current activation
_cuda_hook_queued = False


# ---- SDPA's backend priority (see the module docstring) ---------------------------------------
def _flash_first(order):
    return [_FLASH] + [b for b in order if b != _FLASH]


def _settle_torch_default() -> None:
    """Makes torch take its one-time default priority order now (cuDNN first on sm90/sm100 with
    cuDNN > 9.15): it does so at the first backend choice of the process, here one on empty CUDA
    tensors of the current device (no kernel, no allocation). Needs CUDA initialised."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            empty = torch.empty((1, 1, 0, 8), device="cuda", dtype=torch.float16)
            torch._fused_sdp_choice(empty, empty, empty)
    except Exception:  # noqa: BLE001 (e.g. every backend disabled: then torch chose nothing either)
        pass


def _prefer_flash(handle: _Handle) -> None:
    """Puts FLASH_ATTENTION first in SDPA's priority order; handle keeps what to restore."""
    global _active, _cuda_hook_queued
    if torch.cuda.is_initialized():
        _settle_torch_default()
    elif torch.cuda._is_compiled() and not _cuda_hook_queued:
        torch.cuda._lazy_call(_on_cuda_init)  # once per process; it acts on the activation current then
        _cuda_hook_queued = True
    saved = torch._C._get_sdp_priority_order()
    handle.saved_order, handle.order = saved, _flash_first(saved)
    torch._C._set_sdp_priority_order(handle.order)
    _active = handle


def _on_cuda_init() -> None:
    """Runs in ``torch.cuda``'s lazy initialisation: lets torch take its one-time default, which
    would otherwise overwrite the order activation set at the first SDPA call, and puts
    FLASH_ATTENTION first again. Never raises (that would fail CUDA's initialisation)."""
    try:
        handle = _active
        if handle is None or handle.order is None:
            return  # restored before CUDA came up: nothing to keep
        before = torch._C._get_sdp_priority_order()
        _settle_torch_default()
        after = torch._C._get_sdp_priority_order()
        if before == handle.order and after != before:  # torch's default replaced ours
            handle.saved_order, handle.order = after, _flash_first(after)
            torch._C._set_sdp_priority_order(handle.order)
    except Exception:  # noqa: BLE001
        pass


def _cpu_has_torch_kernel(op: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CPU")


def _register_kernels(devices=("cuda", "cpu")) -> _Handle:
    libraries = []
    impls = {
        "_flash_attention_forward": _flash_attention_forward,
        "_flash_attention_backward": _flash_attention_backward,
        "_scaled_dot_product_flash_attention": _sdpa_flash_forward,
        "_scaled_dot_product_flash_attention_backward": _sdpa_flash_backward,
    }
    for device in devices:
        key = {"cuda": "CUDA", "cpu": "CPU"}[device]
        lib = Library("aten", "IMPL", key)  # noqa: TOR901
        for op in _OPS:
            if key == "CPU" and _cpu_has_torch_kernel(op):
                continue  # never replace a CPU kernel that torch has
            with warnings.catch_warnings():
                # Replacing torch's CUDA kernel is the point of activation: not worth a warning.
                warnings.filterwarnings("ignore", message=r"(?s).*Overriding a previously registered kernel")
                lib.impl(op, impls[op], key)
        libraries.append(lib)
    handle = _Handle(libraries)
    _prefer_flash(handle)
    return handle


def register() -> str:
    """Adds ``"FLASHCUTE"`` to torch's registry (``list_flash_attention_impls()``); does not
    activate it. Idempotent; returns the name."""
    from torch.nn.attention import register_flash_attention_impl

    register_flash_attention_impl(IMPL_NAME, register_fn=_register_kernels)
    return IMPL_NAME


def activate() -> None:
    """``register()`` and ``torch.nn.attention.activate_flash_attention_impl("FLASHCUTE")``."""
    from torch.nn.attention import activate_flash_attention_impl

    register()
    activate_flash_attention_impl(IMPL_NAME)


def deactivate() -> None:
    """Restores torch's own flash attention if flashcute's is the active one."""
    from torch.nn.attention import current_flash_attention_impl, restore_flash_attention_impl

    if current_flash_attention_impl() == IMPL_NAME:
        restore_flash_attention_impl()


def is_active() -> bool:
    from torch.nn.attention import current_flash_attention_impl

    return current_flash_attention_impl() == IMPL_NAME


# ---- checks ---------------------------------------------------------------------------------
def _fail(where: str, why: str):
    raise RuntimeError(f"flashcute ({IMPL_NAME}) {where}: {why}; call torch.nn.attention."
                       "restore_flash_attention_impl() to use torch's own flash attention for such calls")


def _check_forward(where, query, key, value, return_debug_mask, alibi_slopes=None, seqused_k=None):
    if return_debug_mask:
        _fail(where, "return_debug_mask=True is not supported")
    if alibi_slopes is not None:
        _fail(where, "alibi_slopes are not supported (the aten backward cannot receive them)")
    if seqused_k is not None:
        _fail(where, "seqused_k is not supported")
    _check_tensors(where, query, key, value)


def _check_tensors(where, query, key, value):
    if not (query.device == key.device == value.device):
        _fail(where, "query, key and value are on different devices")
    if query.is_cuda:
        if query.dtype not in (torch.float16, torch.bfloat16):
            _fail(where, f"dtype {query.dtype} on CUDA is not supported (float16, bfloat16)")
        if not torch.ops.flashcute.has_cuda_kernel(query.shape[-1], query.dtype):
            _fail(where, f"this flashcute build has no CUDA kernel for head dim {query.shape[-1]} in {query.dtype} "
                  "(see python -m flashcute.info)")


def _window(left, right):
    return (-1 if left is None else int(left)), (-1 if right is None else int(right))


def _as_like(ref: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """value with the strides of torch.empty_like(ref) (what torch's meta kernels promise).

    value is dense (a kernel output or its transpose): equal strides mean ref is dense too, so
    empty_like(ref) would have them."""
    if value.stride() == ref.stride():
        return value
    out = torch.empty_like(ref)
    out.copy_(value)
    return out


def _philox(query, dropout_p):
    """(flashcute's rng_state or None, aten's rng_state, aten's unused offset): with dropout,
    flashcute's (seed, offset) drawn as flashcute.attention draws it, handed to aten as its uint64
    (2,) rng_state (the same bits), which the backward gets back. The mask is flashcute's
    (flashcute.dropout_mask), not torch's flash backend's."""
    _, state = api._dropout("flashcute (FLASHCUTE)", query, dropout_p, None)
    aten_state = state.view(torch.uint64) if state is not None else torch.zeros((2,), dtype=torch.uint64,
                                                                                 device=query.device)
    return state, aten_state, torch.zeros((), dtype=torch.uint64, device=query.device)


def _rng_state(dropout_p, aten_state):
    """flashcute's rng_state from the one the forward handed to aten."""
    return aten_state.view(torch.int64) if dropout_p > 0 else None


# ---- aten::_flash_attention_forward / _backward (FA2 semantics: bottom-right causal) ----------
def _flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                             return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                             seqused_k=None, alibi_slopes=None):
    where = "aten._flash_attention_forward"
    _check_forward(where, query, key, value, return_debug_mask, alibi_slopes, seqused_k)
    left, right = _window(window_size_left, window_size_right)
    state, rng_state, unused = _philox(query, dropout_p)
    if cum_seq_q is None:
        out, lse = torch.ops.flashcute.attention(query, key, value, bool(is_causal), scale, False, None, None, None,
                                                 None, [128, 128], left, right, 0.0, None, dropout_p, state)
    else:
        out, lse = torch.ops.flashcute.attention_varlen(query, key, value, cum_seq_q, cum_seq_k, int(max_q),
                                                        int(max_k), bool(is_causal), scale, False, left, right, 0.0,
                                                        None, dropout_p, state)
    out = _as_like(query, out)
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, rng_state, unused, debug


def _flash_attention_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k,
                              dropout_p, is_causal, rng_state, unused, *, scale=None, window_size_left=None,
                              window_size_right=None):
    where = "aten._flash_attention_backward"
    _check_tensors(where, query, key, value)
    state = _rng_state(dropout_p, rng_state)
    left, right = _window(window_size_left, window_size_right)
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    deterministic = torch.are_deterministic_algorithms_enabled()
    lse = logsumexp.contiguous()
    if query.dim() == 4:
        dq, dk, dv = torch.ops.flashcute.attention_backward(grad_out, query, key, value, out, lse, None,
                                                            bool(is_causal), scale, deterministic, None, None, None,
                                                            None, [128, 128], left, right, 0.0, None, dropout_p, state)
    else:
        dq, dk, dv = torch.ops.flashcute.attention_varlen_backward(grad_out, query, key, value, out, lse, None,
                                                                   cum_seq_q, cum_seq_k, int(max_q), int(max_k),
                                                                   bool(is_causal), scale, deterministic, left,
                                                                   right, 0.0, None, dropout_p, state)
    return _as_like(query, dq), _as_like(key, dk), _as_like(value, dv)


# ---- aten::_scaled_dot_product_flash_attention / _backward (SDPA: top-left causal) -----------
def _top_left(is_causal, s_q, s_k):
    """flashcute arguments for SDPA's top-left causal mask (j <= i): (causal, keys kept, right
    window). s_q == s_k: flashcute's causal; s_q < s_k: keys past s_q are never seen (cut them);
    s_q > s_k: j <= i is j <= p_i + (s_q - s_k) with flashcute's p_i = i + s_k - s_q."""
    if not is_causal:
        return False, s_k, -1
    if s_q <= s_k:
        return True, s_q, -1
    return False, s_k, s_q - s_k


def _sdpa_flash_forward(query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    where = "aten._scaled_dot_product_flash_attention"
    _check_forward(where, query, key, value, return_debug_mask)
    s_q, s_k = query.shape[2], key.shape[2]
    causal, keep, right = _top_left(is_causal, s_q, s_k)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2)[:, :keep], value.transpose(1, 2)[:, :keep]
    state, seed, offset = _philox(query, dropout_p)
    out, lse = torch.ops.flashcute.attention(q, k, v, causal, scale, False, None, None, None, None, [128, 128], -1,
                                             right, 0.0, None, dropout_p, state)
    out = _as_like(query, out.transpose(1, 2))
    debug = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, lse, None, None, s_q, s_k, seed, offset, debug


def _sdpa_flash_backward(grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
                         is_causal, philox_seed, philox_offset, *, scale=None):
    where = "aten._scaled_dot_product_flash_attention_backward"
    _check_tensors(where, query, key, value)
    state = _rng_state(dropout_p, philox_seed)
    s_q, s_k = query.shape[2], key.shape[2]
    causal, keep, right = _top_left(is_causal, s_q, s_k)
    q, k, v = query.transpose(1, 2), key.transpose(1, 2)[:, :keep], value.transpose(1, 2)[:, :keep]
    o, do = out.transpose(1, 2), grad_out.transpose(1, 2)
    scale = float(scale) if scale is not None else query.shape[-1] ** -0.5
    dq, dk, dv = torch.ops.flashcute.attention_backward(do, q, k, v, o, logsumexp.contiguous(), None, causal, scale,
                                                        torch.are_deterministic_algorithms_enabled(), None, None, None,
                                                        None, [128, 128], -1, right, 0.0, None, dropout_p, state)
    dq, dk, dv = dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
    if keep < s_k:
        dk = torch.nn.functional.pad(dk, (0, 0, 0, s_k - keep))
        dv = torch.nn.functional.pad(dv, (0, 0, 0, s_k - keep))
    return _as_like(query, dq), _as_like(key, dk), _as_like(value, dv)


__all__ = ["IMPL_NAME", "register", "activate", "deactivate", "is_active"]
