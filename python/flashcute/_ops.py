"""Loads the compiled op library and registers the op's fake kernels and autograd formula.

The ops themselves (``torch.ops.flashcute.attention`` and ``attention_backward``) are
defined in C++ (``src/ops.cpp``); this module adds what ``torch.compile`` and autograd
need on top of them.
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


def _load() -> None:
    path = _library_path()
    if not path.is_file():
        raise ImportError(
            f"flashcute: the compiled op library {path} is missing; build the package with "
            "`pip install --no-build-isolation .` (or set FLASHCUTE_LIBRARY to a built "
            f"{_LIB_NAME})"
        )
    torch.ops.load_library(str(path))


_load()


def _lse_shape(q: torch.Tensor) -> tuple[int, int, int]:
    return (q.shape[0], q.shape[2], q.shape[1])


@torch.library.register_fake("flashcute::attention")
def _attention_fake(q, k, v, causal=False, scale=None, deterministic=False, kv_num_blocks=None,
                    kv_indices=None, q_num_blocks=None, q_indices=None, block_size=(128, 128)):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.register_fake("flashcute::attention_backward")
def _attention_backward_fake(dout, q, k, v, out, lse, dlse, causal, scale, deterministic,
                             kv_num_blocks=None, kv_indices=None, q_num_blocks=None, q_indices=None,
                             block_size=(128, 128)):
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return dq, dk, dv


@torch.library.register_fake("flashcute::block_mask_transpose")
def _block_mask_transpose_fake(kv_num_blocks, kv_indices):
    b, h, nq, nkv = kv_indices.shape
    q_num = kv_num_blocks.new_empty((b, h, nkv))
    q_idx = kv_indices.new_empty((b, h, nkv, nq))
    return q_num, q_idx


def _setup_context(ctx, inputs, output):
    # torch.library passes every argument, defaults filled in.
    q, k, v, causal, scale, deterministic, kv_num, kv_idx, q_num, q_idx, block_size = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, kv_num, kv_idx, q_num, q_idx)
    ctx.causal = causal
    ctx.scale = scale if scale is not None else q.shape[-1] ** -0.5
    ctx.deterministic = deterministic
    ctx.block_size = list(block_size)
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_num, kv_idx, q_num, q_idx = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.flashcute.attention_backward(
        dout, q, k, v, out, lse, dlse, ctx.causal, ctx.scale, ctx.deterministic,
        kv_num, kv_idx, q_num, q_idx, ctx.block_size,
    )
    return dq, dk, dv, None, None, None, None, None, None, None, None


torch.library.register_autograd("flashcute::attention", _backward, setup_context=_setup_context)
