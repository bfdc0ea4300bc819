"""flashcute: FlashAttention-2 as CUTLASS/CuTe CUDA kernels for PyTorch.

``import flashcute`` loads the compiled library, which registers the dispatcher op
``torch.ops.flashcute.attention`` (CPU and CUDA kernels, fake kernel, autograd).
"""
from . import _ops  # noqa: F401  (registers torch.ops.flashcute.*)
from . import masks, reference
from .api import attention, sdpa
from .block_sparse import BlockSparseMask

__all__ = ["attention", "sdpa", "BlockSparseMask", "masks", "reference"]
__version__ = "0.1.0"
