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
def _attention_fake(q, k, v, causal=False, scale=None, deterministic=False):
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(_lse_shape(q), dtype=torch.float32, device=q.device)
    return out, lse


@torch.library.register_fake("flashcute::attention_backward")
def _attention_backward_fake(dout, q, k, v, out, lse, dlse, causal, scale, deterministic):
    dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    return dq, dk, dv


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, deterministic = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal = causal
    ctx.scale = scale if scale is not None else q.shape[-1] ** -0.5
    ctx.deterministic = deterministic
    ctx.set_materialize_grads(False)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.flashcute.attention_backward(
        dout, q, k, v, out, lse, dlse, ctx.causal, ctx.scale, ctx.deterministic
    )
    return dq, dk, dv, None, None, None


torch.library.register_autograd("flashcute::attention", _backward, setup_context=_setup_context)
