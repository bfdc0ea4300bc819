"""Loads the compiled op library and registers the ops' fake kernels.

The ops themselves (``torch.ops.flashcute.attention``, ``attention_backward``, ...) and the
autograd kernels of the attention ops are defined in C++ (``src/ops.cpp``); this module adds
what ``torch.compile`` needs on top of them (fake kernels) and the KV-cache op's no-backward
guard.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

_LIB_NAME = "libflashcute_ops.so"


def _library_path() -> Path:
    override = os.environ.get("FLASHCUTE_LIBRARY")
    if override:
        return Path(override)
    return Path(__file__).with_name(_LIB_NAME)


def _check_build_info(path: Path) -> dict | None:
    """Reads flashcute_build_info.json next to the library (cmake/build_info.cmake writes it) and
    raises ImportError when the library was built against another torch than the one imported:
    it links that exact libtorch, and loading it anyway fails with undefined symbols or worse.
    A library without the file (an older build) loads as before; FLASHCUTE_SKIP_VERSION_CHECK=1
    skips the check."""
    import json

    info_path = path.with_name("flashcute_build_info.json")
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(info, dict) or os.environ.get("FLASHCUTE_SKIP_VERSION_CHECK") == "1":
        return info if isinstance(info, dict) else None
    built = (info.get("torch_version"), info.get("torch_cuda_version"))
    have = (torch.__version__, torch.version.cuda)
    if built[0] is not None and built != have:
        def describe(version, cuda):
            return f"torch {version} ({'CUDA ' + cuda if cuda else 'CPU-only'})"

        raise ImportError(
            f"flashcute: the compiled library {path} was built for {describe(*built)}, but this Python has "
            f"{describe(*have)}. The library links the exact torch it was built against; rebuild flashcute "
            "against the installed torch: `pip install --no-build-isolation .` in the flashcute source tree "
            "(or `bash scripts/install.sh`); for a build tree (FLASHCUTE_LIBRARY), re-run cmake and ninja there. "
            "FLASHCUTE_SKIP_VERSION_CHECK=1 loads it anyway (at your own risk).")
    return info


def _load() -> None:
    path = _library_path()
    if not path.is_file():
        raise ImportError(
            f"flashcute: the compiled op library {path} is missing; build the package with "
            "`pip install --no-build-isolation .` (or set FLASHCUTE_LIBRARY to a built "
            f"{_LIB_NAME})"
        )
    _check_build_info(path)
    torch.ops.load_library(str(path))


_load()


def _lse_shape(q: torch.Tensor) -> tuple[int, int, int]:
    return (q.shape[0], q.shape[2], q.shape[1])


def _check_fake(q, k, v, rank, fn):
    """The shape rules that torch.compile can check without running the op."""
    torch._check(q.dim() == rank and k.dim() == rank and v.dim() == rank,
                 lambda: f"{fn}: q, k, v must be {rank}-D")
    torch._check(q.shape[-1] == k.shape[-1] == v.shape[-1], lambda: f"{fn}: head dims differ")
    torch._check(q.shape[-2] % k.shape[-2] == 0, lambda: f"{fn}: nheads must be a multiple of nheads_kv")


@torch.library.register_fake("flashcute::attention")
def _attention_fake(q, k, v, causal=False, scale=None, deterministic=False, kv_num_blocks=None,
                    kv_indices=None, q_num_blocks=None, q_indices=None, block_size=(128, 128),
                    window_left=-1, window_right=-1, softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    _check_fake(q, k, v, 4, "flashcute.attention")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.register_fake("flashcute::attention_backward")
def _attention_backward_fake(dout, q, k, v, out, lse, dlse, causal, scale, deterministic,
                             kv_num_blocks=None, kv_indices=None, q_num_blocks=None, q_indices=None,
                             block_size=(128, 128), window_left=-1, window_right=-1, softcap=0.0,
                             alibi_slopes=None, dropout_p=0.0, rng_state=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("flashcute::attention_varlen")
def _attention_varlen_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False,
                           scale=None, deterministic=False, window_left=-1, window_right=-1, softcap=0.0,
                           alibi_slopes=None, dropout_p=0.0, rng_state=None):
    _check_fake(q, k, v, 3, "flashcute.attention_varlen")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.register_fake("flashcute::attention_varlen_backward")
def _attention_varlen_backward_fake(dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, scale, deterministic, window_left=-1, window_right=-1,
                                    softcap=0.0, alibi_slopes=None, dropout_p=0.0, rng_state=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@torch.library.register_fake("flashcute::attention_with_kvcache")
def _attention_with_kvcache_fake(q, k_cache, v_cache, k=None, v=None, cache_seqlens=None, block_table=None,
                                 causal=False, scale=None, window_left=-1, window_right=-1, softcap=0.0,
                                 alibi_slopes=None, num_splits=0):
    torch._check(q.dim() == 4 and k_cache.dim() == 4 and v_cache.dim() == 4,
                 lambda: "flashcute.attention_with_kvcache: q, k_cache, v_cache must be 4-D")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.register_fake("flashcute::dropout_mask")
def _dropout_mask_fake(rng_state, batch, nheads, seqlen_q, seqlen_k, dropout_p):
    return torch.empty((batch, nheads, seqlen_q, seqlen_k), dtype=torch.bool, device=rng_state.device)


@torch.library.register_fake("flashcute::block_mask_transpose")
def _block_mask_transpose_fake(kv_num_blocks, kv_indices):
    b, h, nq, nkv = kv_indices.shape
    q_num = kv_num_blocks.new_empty((b, h, nkv))
    q_idx = kv_indices.new_empty((b, h, nkv, nq))
    return q_num, q_idx


# ---- autograd ------------------------------------------------------------------------------
# attention and attention_varlen have their autograd kernels in C++ (src/ops.cpp: a Python
# backward node would make autograd's device thread take the GIL on every backward call).
_lib = torch.library.Library("flashcute", "IMPL")


# The KV-cache op is inference only and mutates its caches, so torch.library.register_autograd
# does not take it: an Autograd kernel runs it below autograd and, when an input requires grad,
# hands back outputs whose backward raises (autograd's fallback for an op without a formula
# would warn at most, and give no gradient).
class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, lse, *inputs):  # inputs: those that require grad, so the outputs do
        return out.clone(), lse.clone()

    @staticmethod
    def backward(ctx, dout, dlse):
        raise RuntimeError("flashcute.attention_with_kvcache is inference only: it has no backward (use "
                           "flashcute.attention or flashcute.attention_varlen to train)")


def _kvcache_autograd(*args):
    with torch._C._AutoDispatchBelowAutograd():
        out, lse = torch.ops.flashcute.attention_with_kvcache(*args)
    need = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    if torch.is_grad_enabled() and need:
        return _NoBackward.apply(out, lse, *need)
    return out, lse


_lib.impl("attention_with_kvcache", _kvcache_autograd, "Autograd")
