"""BlockSparseMask and flashcute.masks on the CPU (no attention computed by flashcute).

- validation: every malformed argument is a TypeError / ValueError naming it and the value;
- the query-major lists: torch.ops.flashcute.block_mask_transpose against the pure-torch
  reference, and the reference against a plain loop;
- from_dense / to_dense / to_block_dense / density, partial blocks, block-level masks;
- the patterns' structure, each against a direct statement of its rule;
- FlexAttention interop: from_flex on create_block_mask masks, as_flex round trips.
"""
from __future__ import annotations

import math
import re
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import (BlockMask, create_block_mask, create_mask,
                                               flex_attention, noop_mask)

import flashcute  # noqa: F401  (loads the op library)
from flashcute import masks
from flashcute.block_sparse import BlockSparseMask, _transpose_reference

HAS_OP = hasattr(torch.ops.flashcute, "block_mask_transpose")


@pytest.fixture(autouse=True)
def _transpose_op(monkeypatch):
    """Until the C++ op is built, the masks use the reference for their query-major lists."""
    if not HAS_OP:
        monkeypatch.setattr(torch.ops.flashcute, "block_mask_transpose", _transpose_reference,
                            raising=False)


# ---- helpers ------------------------------------------------------------------------------
def _raises(exc, fn, *patterns):
    """fn() raises exc whose message matches every regex in patterns."""
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for p in patterns:
        assert re.search(p, msg), f"message does not match {p!r}:\n{msg}"


def _random_bitmap(shape, density, gen):
    return torch.rand(shape, generator=gen) < density


def _lists(bitmap, gen):
    """Valid (kv_num_blocks, kv_indices) of a block bitmap: each row's blocks shuffled, the
    entries past the count filled with junk (out of range, duplicates) that must be ignored."""
    *lead, n_q, n_kv = bitmap.shape
    num = bitmap.sum(-1, dtype=torch.int32)
    idx = torch.full(bitmap.shape, n_kv + 7, dtype=torch.int32)
    for pos in torch.cartesian_prod(*(torch.arange(s) for s in (*lead, n_q))).reshape(-1, len(lead) + 1):
        pos = tuple(pos.tolist())
        cols = bitmap[pos].nonzero().flatten()
        idx[pos][: len(cols)] = cols[torch.randperm(len(cols), generator=gen)].int()
    return num, idx


def _transpose_loop(num, idx):
    """The query-major lists by plain Python loops."""
    b, h, n_q, n_kv = idx.shape
    q_num = torch.zeros(b, h, n_kv, dtype=torch.int32)
    q_idx = torch.zeros(b, h, n_kv, n_q, dtype=torch.int32)
    for bi in range(b):
        for hi in range(h):
            for j in range(n_kv):
                rows = [i for i in range(n_q) if j in idx[bi, hi, i, : num[bi, hi, i]].tolist()]
                q_num[bi, hi, j] = len(rows)
                q_idx[bi, hi, j, : len(rows)] = torch.tensor(rows, dtype=torch.int32)
    return q_num, q_idx


def _element_mask(bitmap, block_size, sq, sk):
    bm, bn = block_size
    return bitmap.repeat_interleave(bm, -2).repeat_interleave(bn, -1)[..., :sq, :sk]


# ---- validation ---------------------------------------------------------------------------
def _valid():
    num = torch.tensor([[[2, 0, 1]]], dtype=torch.int32)                       # (1, 1, 3)
    idx = torch.tensor([[[[1, 0, 9], [5, 5, 5], [2, -1, 2]]]], dtype=torch.int32)  # (1, 1, 3, 3)
    return num, idx


def test_valid_mask_with_junk_past_counts():
    num, idx = _valid()
    m = BlockSparseMask(num, idx)
    assert m.to_block_dense()[0, 0].tolist() == [[True, True, False], [False] * 3,
                                                 [False, False, True]]


@pytest.mark.parametrize("which", ["kv_num_blocks", "kv_indices"])
def test_not_a_tensor(which):
    num, idx = _valid()
    args = {"kv_num_blocks": num, "kv_indices": idx, which: [[1, 2]]}
    _raises(TypeError, lambda: BlockSparseMask(**args), which, "torch.Tensor", "list")


@pytest.mark.parametrize("which,dtype", [("kv_num_blocks", torch.int64), ("kv_indices", torch.int16),
                                         ("kv_indices", torch.float32)])
def test_wrong_dtype(which, dtype):
    num, idx = _valid()
    args = {"kv_num_blocks": num, "kv_indices": idx}
    args[which] = args[which].to(dtype)
    _raises(TypeError, lambda: BlockSparseMask(**args), which, "int32", str(dtype))


def test_wrong_rank():
    num, idx = _valid()
    _raises(ValueError, lambda: BlockSparseMask(num[0], idx), "kv_num_blocks", "rank 3", r"\(1, 3\)")
    _raises(ValueError, lambda: BlockSparseMask(num, idx[0]), "kv_indices", "rank 4", r"\(1, 3, 3\)")


def test_shape_mismatch():
    num, idx = _valid()
    _raises(ValueError, lambda: BlockSparseMask(num[..., :2], idx), "kv_indices.shape",
            r"\(1, 1, 2\)", r"\(1, 1, 3, 3\)")
    _raises(ValueError, lambda: BlockSparseMask(num.expand(2, 1, 3), idx), r"\(2, 1, 3\)")


def test_device_mismatch():
    num, idx = _valid()
    _raises(ValueError, lambda: BlockSparseMask(num, idx.to("meta")), "same device", "meta", "cpu")


@pytest.mark.parametrize("block_size,exc", [((0, 128), ValueError), ((128, -64), ValueError),
                                            ((128,), TypeError), (128, TypeError),
                                            ((128.0, 128), TypeError), ((True, 128), TypeError)])
def test_bad_block_size(block_size, exc):
    num, idx = _valid()
    _raises(exc, lambda: BlockSparseMask(num, idx, block_size), "block_size", re.escape(repr(block_size)))


@pytest.mark.parametrize("seq_lengths,exc,pattern", [
    ((-1, 10), ValueError, "non-negative"),
    ((10,), TypeError, "pair"),
    ((385, 100), ValueError, "at least 4 query blocks"),   # 3 blocks of 128 hold 384 rows
    ((100, 400), ValueError, "4 key blocks"),
])
def test_bad_seq_lengths(seq_lengths, exc, pattern):
    num, idx = _valid()
    _raises(exc, lambda: BlockSparseMask(num, idx, seq_lengths=seq_lengths), "seq_lengths", pattern)


@pytest.mark.parametrize("bad", [-1, 4])
def test_num_blocks_out_of_range(bad):
    num, idx = _valid()
    num[0, 0, 1] = bad
    _raises(ValueError, lambda: BlockSparseMask(num, idx), "kv_num_blocks", r"\[0, NKV = 3\]",
            f"got {bad}", r"\(0, 0, 1\)")


@pytest.mark.parametrize("bad", [-1, 3, 1000])
def test_index_out_of_range(bad):
    num, idx = _valid()
    idx[0, 0, 0, 1] = bad
    _raises(ValueError, lambda: BlockSparseMask(num, idx), "kv_indices", r"\[0, NKV = 3\)",
            f"got {bad}", r"\(0, 0, 0, 1\)")


@pytest.mark.parametrize("row", [[2, 0, 2], [0, 1, 0]])
def test_duplicate_index(row):
    num, idx = _valid()
    num[0, 0, 2] = 3
    idx[0, 0, 2] = torch.tensor(row, dtype=torch.int32)
    _raises(ValueError, lambda: BlockSparseMask(num, idx), "twice", r"\(0, 0, 2\)", re.escape(str(row)))
    num[0, 0, 2] = 2  # the duplicate past the count is ignored
    BlockSparseMask(num, idx)


# ---- attributes and the query-major lists ---------------------------------------------------
def test_attributes():
    gen = torch.Generator().manual_seed(0)
    bitmap = _random_bitmap((2, 1, 5, 7), 0.4, gen)
    num, idx = _lists(bitmap, gen)
    idx_t = idx.transpose(-1, -2).contiguous().transpose(-1, -2)  # same values, not contiguous
    m = BlockSparseMask(num, idx_t, (64, 32), seq_lengths=(300, 200))
    assert m.kv_indices.is_contiguous() and torch.equal(m.kv_indices, idx)
    assert m.shape == (2, 1, 5, 7) and m.num_q_blocks == 5 and m.num_kv_blocks == 7
    assert m.block_size == (64, 32) and m.seq_lengths == (300, 200)
    assert m.device == torch.device("cpu")
    assert m.q_num_blocks.shape == (2, 1, 7) and m.q_indices.shape == (2, 1, 7, 5)
    assert m.q_num_blocks.dtype == m.q_indices.dtype == torch.int32
    assert torch.equal(m.q_num_blocks, bitmap.sum(-2, dtype=torch.int32))
    assert repr(m) == ("BlockSparseMask(shape=(2, 1, 5, 7), block_size=(64, 32), "
                       "seq_lengths=(300, 200), device=cpu)")
    m2 = m.to("cpu")
    assert torch.equal(m2.to_block_dense(), bitmap) and m2.seq_lengths == (300, 200)
    assert m2.block_size == (64, 32)


@pytest.mark.parametrize("shape", [(2, 3, 6, 5), (1, 1, 4, 9), (1, 2, 9, 4), (3, 1, 1, 1)])
def test_transpose_reference_against_loop(shape):
    gen = torch.Generator().manual_seed(1)
    bitmap = _random_bitmap(shape, 0.3, gen)
    bitmap[..., 0, :] = False  # an empty row
    num, idx = _lists(bitmap, gen)
    q_num, q_idx = _transpose_reference(num, idx)
    want_num, want_idx = _transpose_loop(num, idx)
    assert torch.equal(q_num, want_num) and torch.equal(q_idx, want_idx)


@pytest.mark.skipif(not HAS_OP, reason="torch.ops.flashcute.block_mask_transpose is not built")
@pytest.mark.parametrize("shape", [(2, 3, 6, 5), (1, 1, 16, 16), (1, 4, 33, 17), (2, 1, 8, 40),
                                   (1, 1, 1, 1), (1, 1, 0, 3), (1, 1, 3, 0), (0, 2, 4, 4)])
@pytest.mark.parametrize("density", [0.0, 0.1, 0.5, 1.0])
def test_transpose_op_against_reference(shape, density):
    gen = torch.Generator().manual_seed(2)
    bitmap = _random_bitmap(shape, density, gen)
    if shape[2] > 1:
        bitmap[..., 1, :] = False  # an empty row
    num, idx = _lists(bitmap, gen)  # junk past the counts: ignored
    q_num, q_idx = torch.ops.flashcute.block_mask_transpose(num, idx)
    want_num, want_idx = _transpose_reference(num, idx)
    assert q_num.dtype == q_idx.dtype == torch.int32
    assert torch.equal(q_num, want_num) and torch.equal(q_idx, want_idx)
    # And as the mask's attribute.
    m = BlockSparseMask(num, idx)
    assert torch.equal(m.q_num_blocks, want_num) and torch.equal(m.q_indices, want_idx)


# ---- dense masks ------------------------------------------------------------------------------
@pytest.mark.parametrize("shape,block_size,seqlens", [
    ((2, 3), (128, 128), (1024, 768)),
    ((1, 4), (64, 32), (300, 201)),     # uneven: the last blocks are partly padding
    ((3, 1), (16, 48), (17, 47)),
    ((1, 1), (128, 128), (100, 1)),
])
def test_dense_round_trip(shape, block_size, seqlens):
    gen = torch.Generator().manual_seed(3)
    sq, sk = seqlens
    n_q, n_kv = math.ceil(sq / block_size[0]), math.ceil(sk / block_size[1])
    bitmap = _random_bitmap((*shape, n_q, n_kv), 0.4, gen)
    dense = _element_mask(bitmap, block_size, sq, sk)
    m = BlockSparseMask.from_dense(dense, block_size)
    assert m.shape == (*shape, n_q, n_kv) and m.seq_lengths == (sq, sk) and m.block_size == block_size
    assert torch.equal(m.to_block_dense(), bitmap)
    assert torch.equal(m.to_dense(), dense)
    assert torch.equal(m.kv_num_blocks, bitmap.sum(-1, dtype=torch.int32))
    # Lists: kept blocks first, ascending; zeros after.
    for pos in [(0, 0, 0), (shape[0] - 1, shape[1] - 1, n_q - 1)]:
        row = m.kv_indices[pos].tolist()
        k = int(m.kv_num_blocks[pos])
        assert row[:k] == bitmap[pos].nonzero().flatten().tolist() and row[k:] == [0] * (n_kv - k)
    # Other lengths, and the default lengths without seq_lengths.
    assert torch.equal(m.to_dense(sq - 1, 1), dense[..., : sq - 1, :1])
    full = BlockSparseMask(m.kv_num_blocks, m.kv_indices, block_size).to_dense()
    assert full.shape == (*shape, n_q * block_size[0], n_kv * block_size[1])


def test_to_dense_bad_lengths():
    m = masks.butterfly(512)
    _raises(ValueError, lambda: m.to_dense(513, 512), "seqlen_q", r"\[0, 512\]", "513")
    _raises(ValueError, lambda: m.to_dense(512, -1), "seqlen_k", "-1")


def test_from_dense_partial_blocks():
    dense = torch.zeros(2, 1, 200, 300, dtype=torch.bool)
    dense[0, 0, :64, :64] = True                 # full block (0, 0)
    dense[1, 0, 70, 130] = True                  # one element of block (1, 2)
    dense[1, 0, 192:, 256:] = True               # in-range part of block (3, 4): full
    dense[0, 0, 128:192, 64:100] = True          # part of block (2, 1)
    _raises(ValueError, lambda: BlockSparseMask.from_dense(dense, (64, 64)), "2 blocks",
            r"\(0, 0, 2, 1\)", "partial_as_full=True")
    m = BlockSparseMask.from_dense(dense, (64, 64), partial_as_full=True)
    kept = set(map(tuple, m.to_block_dense().nonzero().tolist()))
    assert kept == {(0, 0, 0, 0), (1, 0, 1, 2), (1, 0, 3, 4), (0, 0, 2, 1)}
    assert torch.equal(m.to_dense() | dense, m.to_dense())  # a superset of the element mask


def test_from_dense_block_level():
    gen = torch.Generator().manual_seed(4)
    bitmap = _random_bitmap((1, 2, 5, 3), 0.5, gen)
    m = BlockSparseMask.from_dense(bitmap, (64, 128), block_level=True)
    assert m.seq_lengths is None and m.block_size == (64, 128)
    assert torch.equal(m.to_block_dense(), bitmap)
    assert m.to_dense().shape == (1, 2, 320, 384)


def test_from_dense_bad_input():
    _raises(TypeError, lambda: BlockSparseMask.from_dense(torch.ones(1, 1, 4, 4)), "mask", "bool",
            "float32")
    _raises(ValueError, lambda: BlockSparseMask.from_dense(torch.ones(4, 4, dtype=torch.bool)),
            "mask", "rank 4", r"\(4, 4\)")
    _raises(ValueError, lambda: BlockSparseMask.from_dense(torch.ones(1, 1, 4, 4, dtype=torch.bool),
                                                           (0, 4)), "block_size")


def test_density():
    bitmap = torch.zeros(1, 2, 4, 4, dtype=torch.bool)
    bitmap[0, 0] = True                  # head 0: all 16
    bitmap[0, 1, 0, 0] = True            # head 1: 1 of 16
    m = BlockSparseMask.from_dense(bitmap, (128, 128), block_level=True)
    assert m.density() == pytest.approx(17 / 32)
    assert m.density(128, 128) == pytest.approx(1.0)             # only block (0, 0) in range
    assert m.density(129, 256) == pytest.approx((4 + 1) / 8)     # 2 x 2 blocks per head
    assert m.density(0, 512) == 0.0
    m2 = BlockSparseMask(m.kv_num_blocks, m.kv_indices, seq_lengths=(200, 100))
    assert m2.density() == pytest.approx((2 + 1) / 4)


# ---- patterns ------------------------------------------------------------------------------------
def _blocks(m):
    return m.to_block_dense()


@pytest.mark.parametrize("seqlen", [2048, 1000])
def test_butterfly(seqlen):
    m = masks.butterfly(seqlen, block_size=(128, 128))
    n = math.ceil(seqlen / 128)
    want = torch.tensor([[i == j or bin(i ^ j).count("1") == 1 for j in range(n)] for i in range(n)])
    got = _blocks(m)[0, 0]
    assert torch.equal(got, want)
    assert got.diagonal().all() and got.equal(got.T)
    if seqlen == 2048:
        assert (got.sum(-1) == 5).all()       # diagonal + log2(16) partners
        assert got[5].nonzero().flatten().tolist() == [1, 4, 5, 7, 13]
    assert m.seq_lengths == (seqlen, seqlen)


@pytest.mark.parametrize("sq,sk,window,block_size", [
    (1024, 1024, 128, (128, 128)), (1024, 1024, 0, (128, 128)), (1024, 1024, 129, (128, 128)), (1000, 1000, 300, (128, 64)),
    (512, 2048, 200, (128, 128)), (2048, 512, 100, (64, 128)), (333, 777, 50, (32, 96)),
])
def test_sliding_window(sq, sk, window, block_size):
    m = masks.sliding_window(sq, sk, window=window, block_size=block_size)
    # The blocks touching the element-level band |key - (row + sk - sq)| <= window.
    r = torch.arange(sq)[:, None] + sk - sq
    band = (torch.arange(sk)[None, :] - r).abs() <= window
    want = BlockSparseMask.from_dense(band[None, None], block_size, partial_as_full=True)
    assert torch.equal(_blocks(m), want.to_block_dense())
    assert m.seq_lengths == (sq, sk)
    assert torch.equal(m.to_dense()[0, 0] & band, band)  # covers the band
    if (sq, sk, window, block_size) == (1024, 1024, 128, (128, 128)):
        i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
        assert torch.equal(_blocks(m)[0, 0], (i - j).abs() <= 1)
    if window == 0 and sq == sk:
        assert torch.equal(_blocks(m)[0, 0], torch.eye(sq // block_size[0], dtype=torch.bool))


def test_random_blocks():
    m = masks.random_blocks(2048, 1000, 0.3, batch=2, heads=3, block_size=(128, 64), seed=5)
    n_kv = math.ceil(1000 / 64)
    assert m.shape == (2, 3, 16, n_kv) and m.seq_lengths == (2048, 1000)
    assert (m.kv_num_blocks == round(0.3 * n_kv)).all()
    assert (_blocks(m).sum(-1) == round(0.3 * n_kv)).all()  # distinct blocks
    assert not torch.equal(_blocks(m)[0, 0], _blocks(m)[1, 2])  # per batch and head
    again = masks.random_blocks(2048, 1000, 0.3, batch=2, heads=3, block_size=(128, 64), seed=5)
    assert torch.equal(_blocks(m), _blocks(again))
    other = masks.random_blocks(2048, 1000, 0.3, batch=2, heads=3, block_size=(128, 64), seed=6)
    assert not torch.equal(_blocks(m), _blocks(other))
    # Uniform: every key block is about equally likely.
    big = _blocks(masks.random_blocks(4096, density=0.25, batch=8, heads=8, seed=1)).float()
    freq = big.mean(dim=(0, 1, 2))
    assert (freq - 0.25).abs().max() < 0.06
    assert masks.random_blocks(1024, density=0.0).kv_num_blocks.sum() == 0
    assert _blocks(masks.random_blocks(1024, density=1.0)).all()
    _raises(ValueError, lambda: masks.random_blocks(1024, density=1.5), "density", "1.5")


def test_longformer():
    m = masks.longformer(2048, window=256, global_tokens=200, block_size=(128, 128))
    got = _blocks(m)[0, 0]
    window = _blocks(masks.sliding_window(2048, window=256))[0, 0]
    glob = torch.zeros(16, 16, dtype=torch.bool)
    glob[:2] = True   # 200 tokens -> 2 blocks
    glob[:, :2] = True
    assert torch.equal(got, window | glob)
    assert got[:2].all() and got[:, :2].all() and not got[2:, 2:].all()
    assert got[10].nonzero().flatten().tolist() == [0, 1, 8, 9, 10, 11, 12]


def test_bigbird():
    kw = dict(window=128, global_tokens=128, block_size=(128, 128))
    m = masks.bigbird(2048, random_blocks=3, batch=2, heads=2, seed=3, **kw)
    base = _blocks(masks.longformer(2048, **kw))
    got = _blocks(m)
    assert m.shape == (2, 2, 16, 16)
    assert torch.equal(got & base, base.expand_as(got))                # window + global
    free = (~base).sum(-1)
    assert torch.equal((got & ~base).sum(-1), torch.clamp(free, max=3).expand(2, 2, 16))
    assert not torch.equal(got[0, 0], got[1, 1])
    # More random blocks than free ones: the rows are full.
    assert _blocks(masks.bigbird(512, random_blocks=10, **kw)).all()


def test_pattern_bad_args():
    _raises(ValueError, lambda: masks.sliding_window(1024, window=-1), "window", "-1")
    _raises(ValueError, lambda: masks.longformer(1024, window=8, global_tokens=1.5), "global_tokens")
    _raises(ValueError, lambda: masks.butterfly(-5), "seqlen_q", "-5")
    _raises(ValueError, lambda: masks.butterfly(256, block_size=(0, 128)), "block_size")


def test_pattern_default_device():
    assert masks.butterfly(256).device == torch.device("cpu")


# ---- FlexAttention ------------------------------------------------------------------------------
def _aligned_mod(b, h, q, k):
    """Block-aligned (128): a function of the block indices, batch and head only."""
    return ((q // 128) + (k // 128) + b + h) % 3 != 0


def _aligned_bitmap(B, H, n_q, n_kv):
    b, h, i, j = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(n_q),
                                torch.arange(n_kv), indexing="ij")
    return (i + j + b + h) % 3 != 0


def test_from_flex_block_aligned():
    bm = create_block_mask(_aligned_mod, 2, 3, 512, 768, device="cpu")
    m = BlockSparseMask.from_flex(bm)
    assert m.block_size == (128, 128) and m.seq_lengths == (512, 768)
    assert torch.equal(m.to_block_dense(), _aligned_bitmap(2, 3, 4, 6))


def test_from_flex_partial_blocks():
    causal = create_block_mask(lambda b, h, q, k: q >= k, None, None, 512, 512, device="cpu")
    _raises(ValueError, lambda: BlockSparseMask.from_flex(causal), "4 partial blocks",
            "partial_as_full=True", "causal=True")
    m = BlockSparseMask.from_flex(causal, partial_as_full=True)
    i, j = torch.arange(4)[:, None], torch.arange(4)[None, :]
    assert torch.equal(m.to_block_dense()[0, 0], j <= i)
    # Uneven lengths: flex marks the last blocks partial even for a block-aligned mask_mod;
    # computed as full blocks they are exact.
    bm = create_block_mask(_aligned_mod, 1, 2, 300, 700, device="cpu")
    _raises(ValueError, lambda: BlockSparseMask.from_flex(bm), "partial", r"\(300, 700\)")
    m = BlockSparseMask.from_flex(bm, partial_as_full=True)
    assert m.seq_lengths == (300, 700)
    assert torch.equal(m.to_block_dense(), _aligned_bitmap(1, 2, 3, 6))
    b, h, q, k = torch.meshgrid(torch.arange(1), torch.arange(2), torch.arange(300), torch.arange(700),
                                indexing="ij")
    assert torch.equal(m.to_dense(), _aligned_mod(b, h, q, k))


def test_from_flex_noop_mask_mod_partial_ok():
    # Flex blocks listed as partial under a noop mask_mod are whole blocks.
    num = torch.tensor([[[1, 2]]], dtype=torch.int32)
    idx = torch.tensor([[[[1, 0], [0, 1]]]], dtype=torch.int32)
    fm = BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(64, 128))
    assert fm.mask_mod is noop_mask
    m = BlockSparseMask.from_flex(fm)
    assert m.block_size == (64, 128) and m.seq_lengths == (128, 256)
    assert m.to_block_dense()[0, 0].tolist() == [[False, True], [True, True]]


@pytest.mark.parametrize("make", [
    lambda: masks.bigbird(1024, window=128, global_tokens=64, random_blocks=1, heads=2),
    lambda: masks.sliding_window(300, 700, window=100, block_size=(64, 128)),
    lambda: BlockSparseMask.from_dense(torch.rand(2, 1, 4, 3) < 0.5, block_level=True),
])
def test_as_flex_round_trip(make):
    m = make()
    fm = m.as_flex()
    # All blocks full: flex's kernels never evaluate the mask_mod.
    assert int(fm.kv_num_blocks.sum()) == 0
    assert torch.equal(fm.full_kv_num_blocks, m.kv_num_blocks)
    assert torch.equal(fm.full_kv_indices, m.kv_indices)
    assert tuple(fm.BLOCK_SIZE) == m.block_size
    assert tuple(fm.seq_lengths) == (m.seq_lengths or (m.num_q_blocks * m.block_size[0],
                                                       m.num_kv_blocks * m.block_size[1]))
    assert torch.equal(fm.to_dense().bool(), m.to_block_dense())   # flex's own block view
    back = BlockSparseMask.from_flex(fm)
    assert torch.equal(back.to_block_dense(), m.to_block_dense())
    assert back.seq_lengths == tuple(fm.seq_lengths) and back.block_size == m.block_size


@pytest.mark.parametrize("batch,heads", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_as_flex_attention_matches_dense_mask(batch, heads):
    """Flex's element-wise paths (create_mask, eager flex_attention, which evaluate mask_mod
    on every score) agree with to_dense()."""
    m = masks.bigbird(512, window=64, global_tokens=0, random_blocks=1, batch=batch, heads=heads,
                      block_size=(128, 64), seed=7)
    fm = m.as_flex()
    dense = m.to_dense().expand(2, 2, 512, 512)
    assert torch.equal(create_mask(fm.mask_mod, 2, 2, 512, 512, device="cpu"), dense)
    q, k, v = (torch.randn(2, 2, 512, 32) for _ in range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "flex_attention called without torch.compile"
        out = flex_attention(q, k, v, block_mask=fm)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
