"""Context parallelism: ring attention over a ``torch.distributed`` process group.

::

    import flashcute.distributed as fcd
    q_local, k_local, v_local = (fcd.shard(t, group) for t in (q, k, v))   # (b, s/P, h, d)
    out_local = fcd.ring_attention(q_local, k_local, v_local, group, causal=True)
    out = fcd.unshard(out_local, group)                                  # (b, s, h, d)

The sequence (dim 1 of flashcute's (batch, seqlen, heads, headdim) layout) is split over the P
ranks of ``group``. Each rank keeps its queries; the keys and values travel around the ring
(rank r sends to r + 1 and receives from r - 1, double-buffered: the next block is in flight while
the current one is computed), and the partial results of ``torch.ops.flashcute.attention`` are
merged exactly by their log-sum-exp (in float32). The result is the attention of the whole
sequence, up to floating-point rounding of the merge.

**Load balancing (causal).** With ``load_balance=True`` (the default of :func:`shard`,
:func:`unshard` and :func:`ring_attention`), the sequence is cut into 2P chunks and rank r holds
chunks r and 2P-1-r ("zigzag"): every ring step then costs every rank the same (half of its
queries against all visiting keys, or all its queries against half of them), instead of rank
P-1 doing P times the work of rank 0. Non-causal attention does the same work on every rank in
either layout.

**Backward** (``torch.autograd``): per ring step, ``torch.ops.flashcute.attention_backward``
with the *global* (merged) out and lse, so each step's probabilities are the final ones; dq is
accumulated locally in float32, and dk/dv accumulators (float32) travel around the ring with
their key block and come home after P steps. Gradients flow through lse as well
(``return_lse=True``).

Supported: causal or not, GQA/MQA, ``scale``, ``softcap``, ``deterministic``. Not supported
(the mask depends on absolute positions across shards): windows, ALiBi, block-sparse masks,
dropout, varlen.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["ring_attention", "shard", "unshard"]


def _group_info(group):
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_rank(group), dist.get_world_size(group)


# ---- layout ---------------------------------------------------------------------------------
def shard(x: torch.Tensor, group=None, *, dim: int = 1, load_balance: bool = True) -> torch.Tensor:
    """This rank's part of the full-sequence tensor ``x`` (the same on every rank).

    ``load_balance=True``: chunks r and 2P-1-r of 2P (the layout :func:`ring_attention` expects
    for causal attention with ``load_balance=True``); otherwise chunk r of P. The length must be
    divisible by 2P (P).
    """
    group, rank, size = _group_info(group)
    n = 2 * size if load_balance else size
    if x.shape[dim] % n:
        raise ValueError(f"flashcute.distributed.shard: the sequence length {x.shape[dim]} (dim {dim}) must be "
                         f"divisible by {n} ({'2 x ' if load_balance else ''}world size {size})")
    chunks = x.chunk(n, dim)
    if not load_balance:
        return chunks[rank].contiguous()
    return torch.cat([chunks[rank], chunks[n - 1 - rank]], dim)


@torch.no_grad()
def unshard(x: torch.Tensor, group=None, *, dim: int = 1, load_balance: bool = True) -> torch.Tensor:
    """The full-sequence tensor from every rank's part (all-gather; inverse of :func:`shard`)."""
    group, rank, size = _group_info(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x, group=group)
    if not load_balance:
        return torch.cat(parts, dim)
    heads = [p.chunk(2, dim)[0] for p in parts]
    tails = [p.chunk(2, dim)[1] for p in parts]
    return torch.cat(heads + tails[::-1], dim)


# ---- communication --------------------------------------------------------------------------
class _Ring:
    """Point-to-point exchange with the ring neighbours: send to rank + 1, receive from rank - 1."""

    def __init__(self, group, rank, size, tag):
        self.group, self.tag = group, tag
        self.next = dist.get_global_rank(group, (rank + 1) % size)
        self.prev = dist.get_global_rank(group, (rank - 1) % size)
        self.requests = []

    def start(self, tensors):
        """Starts sending ``tensors`` and receiving same-shaped ones; returns the receive buffers."""
        assert not self.requests, "previous exchange not waited for"
        buffers = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group, self.tag) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group, self.tag) for b in buffers]
        self.requests = dist.batch_isend_irecv(ops)
        return buffers

    def wait(self):
        for request in self.requests:
            request.wait()
        self.requests = []


# ---- the ring steps -------------------------------------------------------------------------
def _plan(step, rank, size, causal, load_balance, seqlen):
    """What one ring step computes: (q rows, k rows, causal) or None (nothing to do).

    The keys of step ``step`` come from rank src = rank - step. Zigzag (load_balance): step 0 is
    the local causal block; src < rank: all local queries see the first half of the visiting keys
    (chunk src) and none of its second; src > rank: only the second half of the queries (chunk
    2P-1-rank) sees the visiting keys, all of them. Contiguous: src < rank all, src > rank none.
    """
    full = slice(0, seqlen)
    if not causal:
        return full, full, False
    if step == 0:
        return full, full, True
    src = (rank - step) % size
    if not load_balance:
        return (full, full, False) if src < rank else None
    half = seqlen // 2
    if src < rank:
        return full, slice(0, half), False
    return slice(half, seqlen), full, False


def _merge(out, lse, block_out, block_lse, rows):
    """out/lse (float32, (b, s, h, d) / (b, h, s)) <- the log-sum-exp merge with a block's rows.
    -inf on both sides (no key seen yet) stays out 0, lse -inf."""
    old_lse = lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(old_lse - ref).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1)
    out[:, rows] = out[:, rows] * w_old + block_out.float() * w_new
    lse[:, :, rows] = new_lse


def _forward(q, k, v, ring, rank, size, causal, load_balance, scale, softcap, deterministic):
    b, s, h, d = q.shape
    out = torch.zeros((b, s, h, d), dtype=torch.float32, device=q.device)
    lse = torch.full((b, h, s), float("-inf"), dtype=torch.float32, device=q.device)
    kv = (k, v)
    for step in range(size):
        incoming = ring.start(kv) if step + 1 < size else None
        plan = _plan(step, rank, size, causal, load_balance, s)
        if plan is not None:
            rows, cols, blk_causal = plan
            blk_out, blk_lse = torch.ops.flashcute.attention(
                q[:, rows], kv[0][:, cols], kv[1][:, cols], blk_causal, scale, deterministic, None, None, None, None,
                [128, 128], -1, -1, softcap, None)
            if step == 0 and rows == slice(0, s):
                out.copy_(blk_out)
                lse.copy_(blk_lse)
            else:
                _merge(out, lse, blk_out, blk_lse, rows)
        if incoming is not None:
            ring.wait()
            kv = tuple(incoming)
    return out.to(q.dtype), lse


def _backward(dout, dlse, q, k, v, out, lse, kv_ring, acc_ring, rank, size, causal, load_balance, scale, softcap,
              deterministic):
    b, s = q.shape[:2]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    kv = (k, v)
    acc = None  # (dk, dv) float32 of the key block in hand, all contributions so far
    acc_incoming = None
    for step in range(size):
        incoming = kv_ring.start(kv) if step + 1 < size else None
        plan = _plan(step, rank, size, causal, load_balance, s)
        block = None
        if plan is not None:
            rows, cols, blk_causal = plan
            part = slice(None) if rows == slice(0, s) else rows
            blk_dq, blk_dk, blk_dv = torch.ops.flashcute.attention_backward(
                dout[:, part].contiguous(), q[:, part], kv[0][:, cols], kv[1][:, cols], out[:, part].contiguous(),
                lse[:, :, part].contiguous(), None if dlse is None else dlse[:, :, part].contiguous(), blk_causal,
                scale, deterministic, None, None, None, None, [128, 128], -1, -1, softcap, None)
            dq[:, part] += blk_dq
            block = (cols, blk_dk, blk_dv)
        # the accumulators of this key block, with the contributions of the ranks before this one
        # (in flight during the computation above)
        if step == 0:
            acc = (torch.zeros(k.shape, dtype=torch.float32, device=k.device),
                   torch.zeros(v.shape, dtype=torch.float32, device=v.device))
        else:
            acc_ring.wait()
            acc = tuple(acc_incoming)
        if block is not None:
            cols, blk_dk, blk_dv = block
            acc[0][:, cols] += blk_dk
            acc[1][:, cols] += blk_dv
        if size > 1:
            acc_incoming = acc_ring.start(acc)  # to the next rank; the last step's goes home
        if incoming is not None:
            kv_ring.wait()
            kv = tuple(incoming)
    if size > 1:
        acc_ring.wait()
        acc = tuple(acc_incoming)
    return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, load_balance, scale, softcap, deterministic):
        group, rank, size = _group_info(group)
        k, v = k.contiguous(), v.contiguous()  # sent as they are
        ring = _Ring(group, rank, size, tag=0)
        out, lse = _forward(q, k, v, ring, rank, size, causal, load_balance, scale, softcap, deterministic)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (group, rank, size, causal, load_balance, scale, softcap, deterministic)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        group, rank, size, causal, load_balance, scale, softcap, deterministic = ctx.args
        if dout is None:
            dout = torch.zeros_like(out)
        kv_ring = _Ring(group, rank, size, tag=1)
        acc_ring = _Ring(group, rank, size, tag=2)
        dq, dk, dv = _backward(dout, dlse, q, k, v, out, lse, kv_ring, acc_ring, rank, size, causal, load_balance,
                               scale, softcap, deterministic)
        return dq, dk, dv, None, None, None, None, None, None


def ring_attention(q, k, v, group=None, *, causal: bool = False, scale: float | None = None, softcap: float = 0.0,
                   deterministic: bool = False, load_balance: bool = True, return_lse: bool = False):
    """Attention of this rank's queries against the keys of every rank of ``group``.

    q: (batch, seqlen_local, nheads, headdim), k, v: (batch, seqlen_local, nheads_kv, headdim): this
    rank's part of the sequence, in the layout of :func:`shard` with the same ``load_balance``
    (chunks r and 2P-1-r when True, which needs an even ``seqlen_local``; chunk r otherwise). Every
    rank must call with the same shapes and arguments. Returns out (q's dtype and shape) and, with
    ``return_lse``, lse (float32, (batch, nheads, seqlen_local)): those of
    ``flashcute.attention`` on the whole sequence, for this rank's rows. Differentiable in q, k, v
    (and through lse). ``scale`` defaults to 1/sqrt(headdim).
    """
    fn = "flashcute.distributed.ring_attention"
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{fn}: torch.distributed is not initialized (call dist.init_process_group first)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be a 4-D (batch, seqlen_local, heads, headdim) tensor, got "
                             f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"{fn}: q, k and v must hold the same part of the sequence; got local lengths "
                         f"{q.shape[1]}, {k.shape[1]}, {v.shape[1]}")
    if causal and load_balance and q.shape[1] % 2:
        raise ValueError(f"{fn}: with causal=True and load_balance=True each rank holds two chunks, so the local "
                         f"length must be even; got {q.shape[1]}")
    scale = float(scale) if scale is not None else q.shape[-1] ** -0.5
    out, lse = _RingAttention.apply(q, k, v, group, bool(causal), bool(load_balance), scale, float(softcap),
                                    bool(deterministic))
    return (out, lse) if return_lse else out
