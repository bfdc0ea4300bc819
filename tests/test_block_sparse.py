"""Block-sparse attention through the op: flashcute.attention(..., block_mask=BlockSparseMask).

Against flashcute.reference.attention with the mask's dense element mask (to_dense), forward
and backward under the SPEC criterion, on the CPU backend (always) and the CUDA kernels
(marker `gpu`): random masks of densities 0, 0.05, 0.25, 0.5 and 1, per-head and broadcast
masks, causal combined, uneven seqlens, GQA; empty rows (out 0, lse -inf, zero gradients);
list order does not matter; deterministic mode; bad masks at the op; torch.compile; opcheck;
on the GPU from_flex against FlexAttention's own output.
"""
from __future__ import annotations

import pytest
import torch

import flashcute
from flashcute import BlockSparseMask, masks
from conftest import (HAS_CUDA, check_lse, check_precision, gpu, make_qkv, or_skip, reference_grads,
                      reference_outputs)

DEVICES = ["cpu", pytest.param("cuda", marks=gpu.marks)]
DENSITIES = [0.0, 0.05, 0.25, 0.5, 1.0]


def random_mask(shape, density, block_size, device, *, seed=0):
    """A BlockSparseMask from a random block bitmap of shape (Bm, Hm, NQ, NKV): each block kept
    with probability `density` (exactly all or none at 1 and 0)."""
    gen = torch.Generator().manual_seed(seed)
    bitmap = torch.rand(shape, generator=gen) < density
    return BlockSparseMask.from_dense(bitmap.to(device), block_size, block_level=True)


def _case(device, dtype=None):
    """(dtype, block size, head dim) per device: small blocks keep the CPU runs short; CUDA
    serves multiples of 128."""
    if device == "cpu":
        return dtype or torch.float32, (32, 48), 32
    return dtype or torch.bfloat16, (128, 128), 64


def _run(q, k, v, mask, causal, dout, deterministic=False):
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    out, lse = flashcute.attention(q, k, v, causal=causal, block_mask=mask, return_lse=True,
                                   deterministic=deterministic)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), lse.detach(), dq, dk, dv


def _check_all(q, k, v, mask, causal):
    dout = torch.randn_like(q)
    ours = _run(q, k, v, mask, causal, dout)
    ref = reference_grads(q, k, v, dout, causal=causal, block_mask=mask)
    for name, o, r, p in zip(("out", "lse", "dq", "dk", "dv"), ours, ref["ref"], ref["pt"]):
        if name == "lse":
            check_lse(o, r)
        else:
            check_precision(name, o, r, p)
    return ours


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("density", DENSITIES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_random_masks(device, density, causal):
    dtype, bs, d = _case(device)
    b, h, h_kv = 2, 4, 2
    sq, sk = (100, 150) if device == "cpu" else (700, 1000)  # uneven, partial last blocks
    nq, nkv = -(-sq // bs[0]), -(-sk // bs[1])
    q, k, v = make_qkv(b, sq, sk, h, h_kv, d, dtype=dtype, device=device)
    mask = random_mask((b, h, nq, nkv), density, bs, device)  # per batch and per head
    out, lse, dq, dk, dv = _check_all(q, k, v, mask, causal)
    if density == 0.0:
        assert torch.isneginf(lse).all() and (out == 0).all()
        assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask_shape", [(1, 1), (2, 1), (1, 8)], ids=["bcast", "per-batch", "per-head"])
def test_broadcast_and_gqa(device, mask_shape):
    dtype, bs, d = _case(device)
    sq = sk = 4 * bs[0] if device == "cpu" else 512
    q, k, v = make_qkv(2, sq, sk, 8, 2, d, dtype=dtype, device=device)
    mask = random_mask(mask_shape + (-(-sq // bs[0]), -(-sk // bs[1])), 0.5, bs, device, seed=3)
    _check_all(q, k, v, mask, causal=False)


@pytest.mark.parametrize("device", DEVICES)
def test_patterns(device):
    """The masks module's patterns run and match the reference (sliding window with causal)."""
    dtype, bs, d = _case(device)
    s = 8 * bs[0]
    q, k, v = make_qkv(1, s, s, 2, 2, d, dtype=dtype, device=device)
    for mask, causal in [
        (masks.sliding_window(s, window=2 * bs[0], block_size=bs, device=device), True),
        (masks.butterfly(s, block_size=bs, device=device), False),
        (masks.bigbird(s, window=bs[0], global_tokens=bs[0], random_blocks=1, heads=2,
                       block_size=bs, device=device), False),
    ]:
        _check_all(q, k, v, mask, causal)


@pytest.mark.parametrize("device", DEVICES)
def test_list_order_does_not_matter(device):
    """The kernels visit the listed blocks in list order: reversing the lists changes nothing
    beyond rounding."""
    dtype, bs, d = _case(device)
    s = 6 * bs[0]
    q, k, v = make_qkv(1, s, s, 2, 2, d, dtype=dtype, device=device)
    mask = random_mask((1, 2, 6, -(-s // bs[1])), 0.5, bs, device, seed=5)
    n = mask.kv_num_blocks.long()
    idx = mask.kv_indices.clone()
    for i in range(idx.shape[2]):  # reverse the listed entries of every row
        for h in range(idx.shape[1]):
            m = int(n[0, h, i])
            idx[0, h, i, :m] = idx[0, h, i, :m].flip(0)
    rev = BlockSparseMask(mask.kv_num_blocks, idx, bs)
    out_a = flashcute.attention(q, k, v, block_mask=mask)
    out_b = flashcute.attention(q, k, v, block_mask=rev)
    ref, _, pt = reference_outputs(q, k, v, block_mask=mask)
    check_precision("out (reversed lists)", out_b, ref, pt)
    torch.testing.assert_close(out_a.float(), out_b.float(), atol=2e-2, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic(device):
    dtype, bs, d = _case(device)
    s = 8 * bs[0]
    q, k, v = make_qkv(1, s, s, 4, 2, d, dtype=dtype, device=device)
    mask = random_mask((1, 4, 8, -(-s // bs[1])), 0.5, bs, device, seed=7)
    dout = torch.randn_like(q)
    a = _run(q, k, v, mask, False, dout, deterministic=True)
    b = _run(q, k, v, mask, False, dout, deterministic=True)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    dtype, bs, d = _case(device)
    s = 4 * bs[0]
    q, k, v = make_qkv(1, s, s, 2, 2, d, dtype=dtype, device=device, requires_grad=True)
    mask = random_mask((1, 1, 4, -(-s // bs[1])), 0.5, bs, device, seed=9)

    def f(q, k, v):
        return flashcute.attention(q, k, v, causal=True, block_mask=mask).float().square().sum()

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    loss_c = compiled(q, k, v)
    grads_c = torch.autograd.grad(loss_c, (q, k, v))
    loss_e = f(q, k, v)
    grads_e = torch.autograd.grad(loss_e, (q, k, v))
    torch.testing.assert_close(loss_c, loss_e)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge)


def test_opcheck_with_mask():
    q, k, v = make_qkv(1, 64, 96, 2, 1, 32, requires_grad=True)
    mask = random_mask((1, 2, 2, 2), 0.5, (32, 48), "cpu", seed=11)
    args = (q, k, v, True, None, False, mask.kv_num_blocks, mask.kv_indices, mask.q_num_blocks,
            mask.q_indices, list(mask.block_size))
    torch.library.opcheck(torch.ops.flashcute.attention.default, args)
    torch.library.opcheck(torch.ops.flashcute.block_mask_transpose.default,
                          (mask.kv_num_blocks, mask.kv_indices))


@pytest.mark.parametrize("device", DEVICES)
def test_backward_without_q_lists(device):
    """The backward op computes the query-major lists itself when not given them."""
    dtype, bs, d = _case(device)
    s = 4 * bs[0]
    q, k, v = make_qkv(1, s, s, 2, 2, d, dtype=dtype, device=device)
    mask = random_mask((1, 2, 4, -(-s // bs[1])), 0.5, bs, device, seed=13)
    out, lse = flashcute.attention(q, k, v, block_mask=mask, return_lse=True)
    dout = torch.randn_like(q)
    scale = d ** -0.5
    # deterministic=True: dQ's fp32 atomics then add in a fixed order, so the two calls can be
    # compared bitwise.
    common = (dout, q, k, v, out, lse, None, False, scale, True, mask.kv_num_blocks, mask.kv_indices)
    with_lists = torch.ops.flashcute.attention_backward(*common, mask.q_num_blocks, mask.q_indices,
                                                        list(bs))
    without = torch.ops.flashcute.attention_backward(*common, None, None, list(bs))
    for a, b in zip(with_lists, without):
        assert torch.equal(a, b)


# ---- bad masks at the op ------------------------------------------------------------------
def _op(q, k, v, kv_num, kv_idx, block_size=(32, 32)):
    return torch.ops.flashcute.attention(q, k, v, False, None, False, kv_num, kv_idx, None, None,
                                         list(block_size))


@pytest.mark.parametrize("device", DEVICES)
def test_bad_masks(device):
    dtype, _, d = _case(device)
    bs = (128, 128) if device == "cuda" else (32, 32)
    s = 2 * bs[0]
    q, k, v = make_qkv(2, s, s, 2, 2, d, dtype=dtype, device=device)
    num = torch.full((1, 1, 2), 2, dtype=torch.int32, device=device)
    idx = torch.arange(2, dtype=torch.int32, device=device).expand(1, 1, 2, 2).contiguous()
    _op(q, k, v, num, idx, bs)  # the good one
    with pytest.raises(TypeError, match="kv_num_blocks has dtype torch.int64; it must be torch.int32"):
        _op(q, k, v, num.long(), idx, bs)
    with pytest.raises(ValueError, match="kv_indices must be 4-D"):
        _op(q, k, v, num, idx[0], bs)
    with pytest.raises(ValueError, match="its batch dim must be 1 or q's batch 2"):
        _op(q, k, v, num.expand(3, 1, 2).contiguous(), idx.expand(3, 1, 2, 2).contiguous(), bs)
    with pytest.raises(ValueError, match="its head dim must be 1 or q's nheads 2"):
        _op(q, k, v, num.expand(1, 3, 2).contiguous(), idx.expand(1, 3, 2, 2).contiguous(), bs)
    with pytest.raises(ValueError, match=r"kv_num_blocks has 1 query blocks; seqlen_q \d+ with "
                                         r"block_size .* needs at least 2"):
        _op(q, k, v, num[..., :1], idx[:, :, :1], bs)
    with pytest.raises(ValueError, match="kv_indices has 1 key blocks per row"):
        _op(q, k, v, num, idx[..., :1], bs)
    with pytest.raises(ValueError, match="must be given together"):
        _op(q, k, v, num, None, bs)
    with pytest.raises(ValueError, match="block_size .* must be two positive ints"):
        _op(q, k, v, num, idx, (0, bs[1]))
    if device == "cuda":
        with pytest.raises(ValueError, match="cannot be served by the CUDA kernels; on CUDA both must be "
                                             "multiples of 128"):
            _op(q, k, v, num, idx, (64, 64))
        with pytest.raises(ValueError, match="kv_num_blocks is on cpu but q is on cuda"):
            _op(q, k, v, num.cpu(), idx, bs)
    # Out-of-range entries that reach the op directly are skipped, never read out of bounds.
    wild = idx.clone()
    wild[0, 0, 0, 0] = 1 << 30
    wild[0, 0, 1, 1] = -5
    out, _ = _op(q, k, v, num, wild, bs)
    assert torch.isfinite(out).all()


def test_transpose_op_matches_reference():
    from flashcute.block_sparse import _transpose_reference

    devices = ["cpu"] + (["cuda"] if HAS_CUDA else [])
    for device in devices:
        for shape in [(1, 1, 5, 7), (2, 3, 9, 4), (1, 2, 40, 33)]:
            mask = random_mask(shape, 0.4, (128, 128), device, seed=sum(shape))
            got = torch.ops.flashcute.block_mask_transpose(mask.kv_num_blocks, mask.kv_indices)
            want = _transpose_reference(mask.kv_num_blocks, mask.kv_indices)
            for g, w in zip(got, want):
                assert torch.equal(g.cpu(), w.cpu()), f"{device} {shape}"


# ---- GPU only ----------------------------------------------------------------------------
@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("d", [32, 96, 128, 256])
@pytest.mark.parametrize("block_size", [(128, 128), (256, 128), (128, 256)])
def test_cuda_head_dims_and_block_sizes(dtype, d, block_size):
    """Every kernel tile shape (the backward's 64- and 128-row tiles, 64- and 128-key tiles)
    inside blocks of several sizes, causal combined."""
    sq, sk = 640, 900
    q, k, v = make_qkv(1, sq, sk, 4, 2, d, dtype=dtype, device="cuda")
    nq, nkv = -(-sq // block_size[0]), -(-sk // block_size[1])
    mask = random_mask((1, 4, nq, nkv), 0.5, block_size, "cuda", seed=d)
    or_skip(lambda: _check_all(q, k, v, mask, causal=True))


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_cuda_persistent_walk(d, causal):
    """More query tiles than SMs (4 sequences x 8 heads x 12 blocks = 384; causal: 192 pairs): the
    sm90 forward's persistent CTAs each walk several tiles' lists, of lengths from 0 (every fourth
    query block's row is empty) to all of the row's blocks."""
    b, h, h_kv, sq, sk = 4, 8, 2, 1500, 1400
    nq, nkv = -(-sq // 128), -(-sk // 128)
    if causal + 1 > (b * h * nq) / torch.cuda.get_device_properties(0).multi_processor_count:
        pytest.skip("this GPU has a CTA per tile (or pair) of this call")
    gen = torch.Generator().manual_seed(d + 2 * causal)
    row_density = torch.rand(b, h, nq, 1, generator=gen)
    row_density[:, :, ::4] = 0.0
    row_density[:, :, 1::4] = 1.0
    bitmap = torch.rand((b, h, nq, nkv), generator=gen) < row_density
    mask = BlockSparseMask.from_dense(bitmap.cuda(), (128, 128), block_level=True)
    q, k, v = make_qkv(b, sq, sk, h, h_kv, d, dtype=torch.bfloat16, device="cuda")
    out = _check_all(q, k, v, mask, causal)[0]
    assert (out[:, :128] == 0).all(), "query block 0's rows are empty: out 0"


@gpu
def test_cuda_from_flex_matches_flex_attention():
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    b, h, s, d = 2, 4, 1024, 64
    gen = torch.Generator().manual_seed(17)
    blocks = (torch.rand(b, h, s // 128, s // 128, generator=gen) < 0.4).cuda()

    def mask_mod(bi, hi, qi, ki):  # block-aligned: no partial blocks
        return blocks[bi, hi, qi // 128, ki // 128]

    flex_mask = create_block_mask(mask_mod, b, h, s, s, device="cuda")
    mask = BlockSparseMask.from_flex(flex_mask)
    q, k, v = make_qkv(b, s, s, h, h, d, dtype=torch.bfloat16, device="cuda")
    ours = flashcute.attention(q, k, v, block_mask=mask)
    theirs = flex_attention(*(t.transpose(1, 2) for t in (q, k, v)), block_mask=flex_mask).transpose(1, 2)
    ref, _, pt = reference_outputs(q, k, v, block_mask=mask)
    # Rows with no block: flex gives 0 as well.
    check_precision("out vs ref", ours, ref, pt)
    check_precision("flex vs ref", theirs, ref, pt)  # the two agree through the reference
    assert torch.equal(mask.to_block_dense(), blocks)
