"""Common block-sparse attention patterns, as :class:`~flashcute.block_sparse.BlockSparseMask`.

Every pattern is decided per (query block, key block) tile: a block is kept or skipped as a
whole. Each builder returns a mask with ``seq_lengths`` set, on ``device`` (default CPU);
random choices come from a ``torch.Generator`` seeded with ``seed`` on the CPU, so a pattern
is the same on every device. Pictures of the patterns: docs/MASKS.md.
"""
from __future__ import annotations

import torch

from .block_sparse import BlockSparseMask, _cdiv, _int_pair, _is_int

__all__ = ["random_blocks", "sliding_window", "longformer", "bigbird", "butterfly"]


# ---- helpers ---------------------------------------------------------------------------
def _count(name: str, value) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"flashcute.masks: {name} must be a non-negative int, got {value!r}")
    return int(value)


def _grid(seqlen_q, seqlen_k, block_size):
    """Checked (seqlen_q, seqlen_k, (bm, bn), n_q, n_kv); seqlen_k defaults to seqlen_q."""
    sq = _count("seqlen_q", seqlen_q)
    sk = sq if seqlen_k is None else _count("seqlen_k", seqlen_k)
    bm, bn = _int_pair("block_size", block_size, positive=True)
    return sq, sk, (bm, bn), _cdiv(sq, bm), _cdiv(sk, bn)


def _mask(bitmap: torch.Tensor, block_size, seq_lengths, device) -> BlockSparseMask:
    """BlockSparseMask from a bool block bitmap (NQ, NKV) or (B, H, NQ, NKV)."""
    if bitmap.dim() == 2:
        bitmap = bitmap[None, None]
    return BlockSparseMask._from_bitmap(bitmap.to(device or "cpu"), block_size, seq_lengths)


def _add_random(base: torch.Tensor, n: int, seed: int) -> torch.Tensor:
    """base | n key blocks per row chosen uniformly among those not in base (all that are
    left where fewer than n are)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.rand(base.shape, generator=gen).masked_fill_(base, 2.0)  # base blocks sort last
    picked = torch.zeros_like(base).scatter_(-1, keys.argsort(-1)[..., :n], True)
    return base | (picked & ~base)


def _window_blocks(sq, sk, block_size, n_q, n_kv, window) -> torch.Tensor:
    """(NQ, NKV) bool: blocks holding a (query, key) pair with |key - query| <= window, the
    query row r at key position r + sk - sq (bottom-right aligned, like causal)."""
    bm, bn = block_size
    i, j = torch.arange(n_q), torch.arange(n_kv)
    q_lo = i * bm + (sk - sq)
    q_hi = torch.clamp((i + 1) * bm, max=sq) - 1 + (sk - sq)
    k_lo, k_hi = j * bn, torch.clamp((j + 1) * bn, max=sk) - 1
    return (k_lo[None, :] <= q_hi[:, None] + window) & (k_hi[None, :] >= q_lo[:, None] - window)


def _global_blocks(n_q, n_kv, block_size, global_tokens) -> torch.Tensor:
    """(NQ, NKV) bool: the rows and columns of the first global_tokens tokens (rounded up to
    whole blocks)."""
    rows = torch.arange(n_q) < _cdiv(global_tokens, block_size[0])
    cols = torch.arange(n_kv) < _cdiv(global_tokens, block_size[1])
    return rows[:, None] | cols[None, :]


# ---- patterns -----------------------------------------------------------------------------
def random_blocks(seqlen_q, seqlen_k=None, density=0.25, *, batch=1, heads=1,
                  block_size=(128, 128), seed=0, device=None) -> BlockSparseMask:
    """Random blocks: every query block keeps exactly ``round(density * n_kv_blocks)``
    distinct key blocks (n_kv_blocks = ceil(seqlen_k / bn)), chosen uniformly and
    independently per batch, head and query block; ``seqlen_k`` defaults to ``seqlen_q``.
    The mask has shape (batch, heads, NQ, NKV): pass batch=1 / heads=1 to broadcast one
    pattern."""
    sq, sk, bs, n_q, n_kv = _grid(seqlen_q, seqlen_k, block_size)
    if not isinstance(density, (int, float)) or not 0.0 <= density <= 1.0:
        raise ValueError(f"flashcute.masks.random_blocks: density must be in [0, 1], got {density!r}")
    base = torch.zeros(_count("batch", batch), _count("heads", heads), n_q, n_kv, dtype=torch.bool)
    return _mask(_add_random(base, round(density * n_kv), seed), bs, (sq, sk), device)


def sliding_window(seqlen_q, seqlen_k=None, *, window, block_size=(128, 128),
                   device=None) -> BlockSparseMask:
    """Sliding window (local attention): key block j is kept for query block i when their
    token ranges come within ``window`` tokens of each other, i.e. the block holds a pair
    with |key position - query position| <= window, query row r sitting at key position
    r + seqlen_k - seqlen_q (bottom-right aligned, like ``causal=True``). The kept blocks
    cover the band; at block granularity they hold up to a block more on either side. Combine
    with ``causal=True`` for a causal window (keys in [r - window, r])."""
    sq, sk, bs, n_q, n_kv = _grid(seqlen_q, seqlen_k, block_size)
    window = _count("window", window)
    return _mask(_window_blocks(sq, sk, bs, n_q, n_kv, window), bs, (sq, sk), device)


def longformer(seqlen, *, window, global_tokens, block_size=(128, 128),
               device=None) -> BlockSparseMask:
    """Longformer (local + global attention): the sliding window of :func:`sliding_window`,
    plus the first ``global_tokens`` tokens, rounded up to whole blocks, as global tokens:
    they attend to every key (full block rows) and every query attends to them (full block
    columns)."""
    sq, sk, bs, n_q, n_kv = _grid(seqlen, None, block_size)
    bitmap = (_window_blocks(sq, sk, bs, n_q, n_kv, _count("window", window))
              | _global_blocks(n_q, n_kv, bs, _count("global_tokens", global_tokens)))
    return _mask(bitmap, bs, (sq, sk), device)


def bigbird(seqlen, *, window, global_tokens, random_blocks=2, batch=1, heads=1,
            block_size=(128, 128), seed=0, device=None) -> BlockSparseMask:
    """BigBird (window + global + random): the :func:`longformer` pattern plus, in every
    query block row, ``random_blocks`` more key blocks chosen uniformly among the ones the
    window and global blocks leave out (all of them where fewer are left), independently per
    batch and head; the mask has shape (batch, heads, NQ, NKV)."""
    sq, sk, bs, n_q, n_kv = _grid(seqlen, None, block_size)
    base = (_window_blocks(sq, sk, bs, n_q, n_kv, _count("window", window))
            | _global_blocks(n_q, n_kv, bs, _count("global_tokens", global_tokens)))
    base = base.expand(_count("batch", batch), _count("heads", heads), n_q, n_kv)
    bitmap = _add_random(base, _count("random_blocks", random_blocks), seed)
    return _mask(bitmap, bs, (sq, sk), device)


def butterfly(seqlen, *, block_size=(128, 128), device=None) -> BlockSparseMask:
    """Flat butterfly, the block-sparse pattern of the FlashAttention paper (from Pixelated
    Butterfly, Chen et al. 2021): block (i, j) is kept iff i == j or i XOR j is a power of
    two, i.e. the union of the butterfly factors' supports; each row keeps about
    1 + log2(n_blocks) blocks."""
    sq, sk, bs, n_q, n_kv = _grid(seqlen, None, block_size)
    x = torch.arange(n_q)[:, None] ^ torch.arange(n_kv)[None, :]
    return _mask((x & (x - 1)) == 0, bs, (sq, sk), device)
