"""flashcute: FlashAttention-2 as CUTLASS/CuTe CUDA kernels for PyTorch.

``import flashcute`` loads the compiled library, which registers the dispatcher ops
``torch.ops.flashcute.*`` (CPU and CUDA kernels, fake kernels, autograd).
"""
from . import _ops  # noqa: F401  (registers torch.ops.flashcute.*)
from . import masks, reference
from .api import attention, attention_varlen, attention_with_kvcache, dropout_mask, kernels, sdpa
from .block_sparse import BlockSparseMask

__all__ = ["attention", "attention_varlen", "attention_with_kvcache", "dropout_mask", "kernels", "sdpa",
           "BlockSparseMask", "masks", "reference"]
__version__ = "0.1.0"
