"""BlockSparseMask: the block mask of block-sparse FlashAttention.

A mask over (query block, key block) tiles: for every batch b, head h and query block i,
``kv_indices[b, h, i, :kv_num_blocks[b, h, i]]`` lists the key blocks that query block i
attends to. Scores outside the listed blocks are -inf; the kernels skip the other blocks.
Batch and head dims of size 1 broadcast. The query-major lists (for every key block, the
query blocks that list it), which the backward iterates, are computed once, on the mask's
device, when the mask is built.
"""
from __future__ import annotations

import numbers
from typing import Optional, Tuple

import torch

__all__ = ["BlockSparseMask"]


# ---- lists <-> bitmaps ------------------------------------------------------------------
def _listed(num_blocks: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Bool (..., n_cols): True where a row's entry is one of its first num_blocks."""
    return torch.arange(n_cols, device=num_blocks.device) < num_blocks.unsqueeze(-1)


def _lists_to_bitmap(num_blocks: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(num_blocks (..., R), indices (..., R, C)) -> bool (..., R, C); assumes valid lists."""
    n_cols = indices.shape[-1]
    # Unlisted entries scatter into an extra column that is cut off afterwards.
    cols = torch.where(_listed(num_blocks, n_cols), indices.long(), n_cols)
    bitmap = torch.zeros(*indices.shape[:-1], n_cols + 1, dtype=torch.bool, device=indices.device)
    return bitmap.scatter_(-1, cols, True)[..., :n_cols].contiguous()


def _bitmap_to_lists(bitmap: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """bool (..., R, C) -> (num_blocks int32 (..., R), indices int32 (..., R, C)).

    Each row lists its True columns first, ascending; the entries past num_blocks are 0.
    """
    num_blocks = bitmap.sum(-1, dtype=torch.int32)
    # A stable sort of ~bitmap puts the True columns first, in ascending order.
    order = torch.argsort((~bitmap).to(torch.uint8), dim=-1, stable=True)
    indices = torch.where(_listed(num_blocks, bitmap.shape[-1]), order, 0)
    return num_blocks, indices.to(torch.int32).contiguous()


def _transpose_reference(kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor):
    """Pure-torch reference of ``torch.ops.flashcute.block_mask_transpose``.

    (kv_num_blocks (B, H, NQ), kv_indices (B, H, NQ, NKV)) -> (q_num_blocks (B, H, NKV),
    q_indices (B, H, NKV, NQ)): for key block j, the query blocks whose lists contain j,
    ascending; entries past q_num_blocks are 0. int32.
    """
    return _bitmap_to_lists(_lists_to_bitmap(kv_num_blocks, kv_indices).transpose(-2, -1))


# ---- argument checks --------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _int_pair(name: str, value, *, positive: bool) -> Tuple[int, int]:
    what = "positive" if positive else "non-negative"
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and all(map(_is_int, value))):
        raise TypeError(f"BlockSparseMask: {name} must be a pair of {what} ints, got {value!r}")
    a, b = int(value[0]), int(value[1])
    if min(a, b) < (1 if positive else 0):
        raise ValueError(f"BlockSparseMask: {name} must be a pair of {what} ints, got {value!r}")
    return a, b


def _int32_tensor(name: str, value, rank: int, shape: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"BlockSparseMask: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype != torch.int32:
        raise TypeError(f"BlockSparseMask: {name} must have dtype torch.int32, got {value.dtype}")
    if value.dim() != rank:
        raise ValueError(f"BlockSparseMask: {name} must have rank {rank} {shape}, "
                         f"got shape {tuple(value.shape)}")
    return value.contiguous()


def _bool_mask(name: str, mask) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"BlockSparseMask.from_dense: {name} must be a bool tensor, got {got}")
    if mask.dim() != 4:
        raise ValueError(f"BlockSparseMask.from_dense: {name} must have rank 4 (B|1, H|1, rows, "
                         f"cols), got shape {tuple(mask.shape)}")
    return mask


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _first_index(bad: torch.Tensor) -> tuple:
    return tuple(bad.nonzero()[0].tolist())


# ---- the mask -----------------------------------------------------------------------------
class BlockSparseMask:
    """Block mask for ``flashcute.attention(..., block_mask=...)``.

    Args:
        kv_num_blocks: int32 (B|1, H|1, NQ): how many key blocks query block i attends to.
        kv_indices: int32 (B|1, H|1, NQ, NKV): the first ``kv_num_blocks[b, h, i]`` entries of
            ``kv_indices[b, h, i]`` are those key blocks (distinct, in [0, NKV), any order).
        block_size: (rows of a query block, columns of a key block).
        seq_lengths: optional (seqlen_q, seqlen_k) the mask was made for; the defaults of
            :meth:`to_dense` and :meth:`density`.

    Attributes ``q_num_blocks`` int32 (B|1, H|1, NKV) and ``q_indices`` int32
    (B|1, H|1, NKV, NQ) hold the transposed lists: for key block j, the query blocks that list
    j, ascending (entries past ``q_num_blocks`` are 0).
    """

    def __init__(self, kv_num_blocks, kv_indices, block_size=(128, 128), seq_lengths=None):
        num = _int32_tensor("kv_num_blocks", kv_num_blocks, 3, "(B|1, H|1, NQ)")
        idx = _int32_tensor("kv_indices", kv_indices, 4, "(B|1, H|1, NQ, NKV)")
        if idx.device != num.device:
            raise ValueError(f"BlockSparseMask: kv_indices is on {idx.device} but kv_num_blocks "
                             f"on {num.device}; both must be on the same device")
        if idx.shape[:3] != num.shape:
            raise ValueError(f"BlockSparseMask: kv_indices.shape[:3] must equal kv_num_blocks.shape "
                             f"{tuple(num.shape)}, got kv_indices.shape {tuple(idx.shape)}")
        self.block_size = _int_pair("block_size", block_size, positive=True)
        n_q, n_kv = idx.shape[2], idx.shape[3]
        if seq_lengths is not None:
            seq_lengths = _int_pair("seq_lengths", seq_lengths, positive=False)
            need = (_cdiv(seq_lengths[0], self.block_size[0]), _cdiv(seq_lengths[1], self.block_size[1]))
            if n_q < need[0] or n_kv < need[1]:
                raise ValueError(
                    f"BlockSparseMask: seq_lengths {seq_lengths} with block_size {self.block_size} "
                    f"need at least {need[0]} query blocks and {need[1]} key blocks, "
                    f"but the mask has (NQ, NKV) = ({n_q}, {n_kv})")
        self.seq_lengths = seq_lengths
        self._check_values(num, idx)
        self._set_lists(num, idx)

    def _set_lists(self, num, idx, q_lists=None) -> None:
        """The key-major lists and their transposes (computed once, on the lists' device)."""
        self.kv_num_blocks, self.kv_indices = num, idx
        self.q_num_blocks, self.q_indices = q_lists or torch.ops.flashcute.block_mask_transpose(num, idx)

    @classmethod
    def _valid(cls, num, idx, block_size, seq_lengths=None, q_lists=None) -> "BlockSparseMask":
        """From lists valid by construction (made from a bitmap, or a checked mask moved):
        no value checks, so no device sync."""
        self = cls.__new__(cls)
        self.block_size = _int_pair("block_size", block_size, positive=True)
        self.seq_lengths = seq_lengths
        self._set_lists(num, idx, q_lists)
        return self

    @staticmethod
    def _check_values(num: torch.Tensor, idx: torch.Tensor) -> None:
        """Counts in [0, NKV], listed indices in [0, NKV), no duplicates: one device sync."""
        n_kv = idx.shape[-1]
        listed = _listed(num, n_kv)
        bad_num = (num < 0) | (num > n_kv)
        bad_idx = listed & ((idx < 0) | (idx >= n_kv))
        # Sorting a row (unlisted entries as -1) makes duplicates of listed entries adjacent.
        srt = torch.where(listed, idx, -1).sort(-1).values
        dup = (srt[..., 1:] == srt[..., :-1]) & (srt[..., 1:] >= 0)
        checks = [bad_num.flatten(), bad_idx.flatten(), dup.flatten()]
        if not torch.cat(checks).any().item():
            return
        # Failure: details for the message (more syncs are fine now).
        if bad_num.any():
            at = _first_index(bad_num)
            raise ValueError(f"BlockSparseMask: kv_num_blocks must be in [0, NKV = {n_kv}], got "
                             f"{num[at].item()} at (b, h, i) = {at}")
        if bad_idx.any():
            at = _first_index(bad_idx)
            raise ValueError(f"BlockSparseMask: kv_indices must be in [0, NKV = {n_kv}) in the first "
                             f"kv_num_blocks entries of a row, got {idx[at].item()} at "
                             f"(b, h, i, n) = {at}")
        b, h, i, _ = _first_index(dup)
        row = idx[b, h, i, : num[b, h, i]].tolist()
        raise ValueError(f"BlockSparseMask: kv_indices lists a key block twice in row (b, h, i) = "
                         f"{(b, h, i)}: {row}; each listed block must be distinct")

    # ---- shape -------------------------------------------------------------------------------
    @property
    def shape(self) -> Tuple[int, int, int, int]:
        """(Bm, Hm, NQ, NKV)."""
        return tuple(self.kv_indices.shape)

    @property
    def num_q_blocks(self) -> int:
        return self.kv_indices.shape[2]

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_indices.shape[3]

    @property
    def device(self) -> torch.device:
        return self.kv_indices.device

    def __repr__(self) -> str:
        return (f"BlockSparseMask(shape={self.shape}, block_size={self.block_size}, "
                f"seq_lengths={self.seq_lengths}, device={self.device})")

    def to(self, device) -> "BlockSparseMask":
        moved = [t.to(device) for t in (self.kv_num_blocks, self.kv_indices, self.q_num_blocks, self.q_indices)]
        return BlockSparseMask._valid(*moved[:2], self.block_size, self.seq_lengths, tuple(moved[2:]))

    # ---- views -------------------------------------------------------------------------------
    def _seqlens(self, seqlen_q, seqlen_k) -> Tuple[int, int]:
        """Defaults (seq_lengths, else the whole block grid) and bounds of the seqlens."""
        bm, bn = self.block_size
        default = self.seq_lengths or (self.num_q_blocks * bm, self.num_kv_blocks * bn)
        sq = default[0] if seqlen_q is None else seqlen_q
        sk = default[1] if seqlen_k is None else seqlen_k
        for name, s, limit in (("seqlen_q", sq, self.num_q_blocks * bm),
                               ("seqlen_k", sk, self.num_kv_blocks * bn)):
            if not _is_int(s) or not 0 <= s <= limit:
                raise ValueError(f"BlockSparseMask: {name} must be an int in [0, {limit}] (the "
                                 f"mask's blocks times block_size), got {s!r}")
        return int(sq), int(sk)

    def to_block_dense(self) -> torch.Tensor:
        """bool (Bm, Hm, NQ, NKV): True for the kept blocks."""
        return _lists_to_bitmap(self.kv_num_blocks, self.kv_indices)

    def to_dense(self, seqlen_q: Optional[int] = None, seqlen_k: Optional[int] = None) -> torch.Tensor:
        """bool (Bm, Hm, seqlen_q, seqlen_k) element mask: True where the score is kept.

        The seqlens default to ``seq_lengths``, else to NQ * bm and NKV * bn.
        """
        sq, sk = self._seqlens(seqlen_q, seqlen_k)
        bm, bn = self.block_size
        dense = self.to_block_dense().repeat_interleave(bm, dim=2).repeat_interleave(bn, dim=3)
        return dense[:, :, :sq, :sk]

    def density(self, seqlen_q: Optional[int] = None, seqlen_k: Optional[int] = None) -> float:
        """Fraction of the in-range blocks that are kept (blocks i < ceil(seqlen_q / bm),
        j < ceil(seqlen_k / bn)), averaged over the mask's batch and heads; 0.0 if none."""
        sq, sk = self._seqlens(seqlen_q, seqlen_k)
        blocks = self.to_block_dense()[:, :, : _cdiv(sq, self.block_size[0]), : _cdiv(sk, self.block_size[1])]
        return blocks.float().mean().item() if blocks.numel() else 0.0

    # ---- conversions ---------------------------------------------------------------------------
    @classmethod
    def _from_bitmap(cls, bitmap: torch.Tensor, block_size, seq_lengths=None) -> "BlockSparseMask":
        """From a bool block bitmap (B|1, H|1, NQ, NKV)."""
        return cls._valid(*_bitmap_to_lists(bitmap), block_size, seq_lengths)

    @classmethod
    def from_dense(cls, mask: torch.Tensor, block_size=(128, 128), *, block_level: bool = False,
                   partial_as_full: bool = False) -> "BlockSparseMask":
        """From a bool element mask (B|1, H|1, Sq, Sk), or a block mask (B|1, H|1, NQ, NKV)
        with ``block_level=True``.

        A block is kept if any of its in-range elements is True (elements past Sq / Sk, the
        padding of the last blocks, do not count). A block that is only partly True cannot be
        represented: ValueError, unless ``partial_as_full=True`` (it is then computed whole).
        """
        mask = _bool_mask("mask", mask)
        bm, bn = _int_pair("block_size", block_size, positive=True)
        if block_level:
            return cls._from_bitmap(mask, (bm, bn))
        b, h, sq, sk = mask.shape
        n_q, n_kv = _cdiv(sq, bm), _cdiv(sk, bn)
        pad = (0, n_kv * bn - sk, 0, n_q * bm - sq)

        def tiles(fill: bool) -> torch.Tensor:  # (B, H, NQ, bm, NKV, bn), padding = fill
            return torch.nn.functional.pad(mask, pad, value=fill).view(b, h, n_q, bm, n_kv, bn)

        any_true = tiles(False).any(dim=5).any(dim=3)
        if not partial_as_full:
            partial = any_true & ~tiles(True).all(dim=5).all(dim=3)
            if partial.any():
                raise ValueError(
                    f"BlockSparseMask.from_dense: {int(partial.sum())} blocks of size {(bm, bn)} are "
                    f"only partly True, the first at (b, h, i, j) = {_first_index(partial)}; a block "
                    "mask keeps whole blocks. Pass partial_as_full=True to compute them as full blocks")
        return cls._from_bitmap(any_true, (bm, bn), (sq, sk))

    @classmethod
    def from_flex(cls, block_mask, *, partial_as_full: bool = False) -> "BlockSparseMask":
        """From a FlexAttention ``BlockMask``: the union of its full and partial blocks.

        Flex's partial blocks (``kv_num_blocks`` / ``kv_indices``) apply its ``mask_mod``
        inside the block, which a BlockSparseMask cannot: they are a ValueError unless
        ``partial_as_full=True`` (computed as full blocks) or the mask_mod is flex's noop_mask.
        """
        from torch.nn.attention.flex_attention import noop_mask

        partial = _lists_to_bitmap(block_mask.kv_num_blocks, block_mask.kv_indices)
        if not partial_as_full and block_mask.mask_mod is not noop_mask and partial.any():
            seq_lengths = tuple(block_mask.seq_lengths)
            raise ValueError(
                f"BlockSparseMask.from_flex: the BlockMask has {int(partial.sum())} partial blocks "
                f"(the first at (b, h, i, j) = {_first_index(partial)}), where its mask_mod masks "
                "single elements; a BlockSparseMask keeps whole blocks. For a causal mask_mod, build "
                "the BlockMask without its causal part and pass causal=True to flashcute.attention; "
                "to compute partial blocks as full blocks pass partial_as_full=True (exact for a block-aligned "
                f"mask_mod, whose partial blocks are only the last ones of seq_lengths {seq_lengths} "
                f"when these are not multiples of BLOCK_SIZE {tuple(block_mask.BLOCK_SIZE)})")
        bitmap = partial
        if block_mask.full_kv_num_blocks is not None:
            bitmap = bitmap | _lists_to_bitmap(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
        return cls._from_bitmap(bitmap, tuple(block_mask.BLOCK_SIZE), tuple(block_mask.seq_lengths))

    def as_flex(self):
        """A FlexAttention ``BlockMask`` with the same blocks, all listed as full blocks (no
        partial ones), so flex's kernels skip the others and never evaluate its mask_mod.

        Its mask_mod looks the blocks up (rather than flex's noop_mask), so that flex's paths
        that evaluate mask_mod on every element (eager flex_attention, ``create_mask``) agree
        with the block lists. It holds the bitmap on this mask's device: move the mask with
        :meth:`to` before converting, not the BlockMask.
        """
        from torch.nn.attention.flex_attention import BlockMask

        bm, bn = self.block_size
        blocks = self.to_block_dense()
        n_b, n_h = blocks.shape[:2]

        def block_mask_mod(b, h, q_idx, kv_idx):  # batch and head dims of 1 broadcast
            return blocks[b if n_b > 1 else 0, h if n_h > 1 else 0, q_idx // bm, kv_idx // bn]

        seq_lengths = self.seq_lengths or (self.num_q_blocks * bm, self.num_kv_blocks * bn)
        return BlockMask.from_kv_blocks(
            torch.zeros_like(self.kv_num_blocks), torch.zeros_like(self.kv_indices),
            self.kv_num_blocks, self.kv_indices, BLOCK_SIZE=self.block_size,
            mask_mod=block_mask_mod, seq_lengths=seq_lengths)
