"""flashcute in other libraries' plug-in points.

- :mod:`flashcute.integrations.transformers`: ``register()`` makes flashcute a Hugging Face
  transformers attention implementation (``attn_implementation="cute_attention"``), with its
  mask function; padded and packed batches go to ``flashcute.attention_varlen``.
- :mod:`flashcute.integrations.torch_registry`: ``register()`` adds ``"FLASHCUTE"`` to torch's
  flash-attention implementation registry (``torch.nn.attention``); after
  ``torch.nn.attention.activate_flash_attention_impl("FLASHCUTE")`` SDPA's flash backend (put
  first in SDPA's backend priority order while active), ``torch.nn.attention.varlen.varlen_attn``
  and context parallelism run flashcute's kernels.

Neither is imported by ``import flashcute``: transformers is an optional dependency, and the
torch registration changes the dispatcher only when activated.
"""
from __future__ import annotations

import importlib

__all__ = ["transformers", "torch_registry"]


def __getattr__(name):
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
