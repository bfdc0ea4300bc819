"""Ground truth for the tests: attention by plain PyTorch math.

``attention``, ``attention_varlen`` and ``attention_with_kvcache`` have the signatures of
``flashcute.attention``, ``flashcute.attention_varlen`` and ``flashcute.attention_with_kvcache``
(the last one works on copies of the caches: it never modifies its inputs) and follow the
SPEC's score pipeline literally (scale, softcap, ALiBi, masks, softmax, dropout). By default
they compute in float32 on upcast copies of the inputs (ref32 of the SPEC's precision
criterion); with ``upcast=False`` in the inputs' own dtype (pt of the criterion). Two hooks
take FlexAttention-style functions of broadcast index tensors, so a test can describe a new
feature without writing a kernel:

- ``mask_mod(b, h, q_idx, kv_idx) -> bool``: True where the score is kept;
- ``score_mod(score, b, h, q_idx, kv_idx) -> score``: applied after ALiBi, before the masks.
"""
from __future__ import annotations

import torch


def causal_mask(seqlen_q: int, seqlen_k: int, device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k), True where key j is visible to query i (bottom-right aligned)."""
    return window_mask(seqlen_q, seqlen_k, (-1, 0), device=device)


def window_mask(seqlen_q: int, seqlen_k: int, window_size=(-1, -1), device=None) -> torch.Tensor:
    """Bool (seqlen_q, seqlen_k): key j is visible to query i iff p_i - L <= j <= p_i + R, with
    p_i = i + seqlen_k - seqlen_q and -1 meaning unbounded on that side."""
    left, right = window_size
    i = torch.arange(seqlen_q, device=device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=device).unsqueeze(0)
    p = i + (seqlen_k - seqlen_q)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device)
    if left >= 0:
        visible &= j >= p - left
    if right >= 0:
        visible &= j <= p + right
    return visible


def alibi_bias(slopes: torch.Tensor, batch: int, seqlen_q: int, seqlen_k: int) -> torch.Tensor:
    """-slope * |p_i - j| as (batch, nheads, seqlen_q, seqlen_k) float32; slopes (h,) or (b, h)."""
    slopes = slopes.float()
    if slopes.dim() == 1:
        slopes = slopes.unsqueeze(0).expand(batch, -1)
    i = torch.arange(seqlen_q, device=slopes.device).unsqueeze(1)
    j = torch.arange(seqlen_k, device=slopes.device).unsqueeze(0)
    dist = (i + (seqlen_k - seqlen_q) - j).abs().float()
    return -slopes[:, :, None, None] * dist


def _index_grids(b, h, sq, sk, device):
    return (torch.arange(b, device=device)[:, None, None, None], torch.arange(h, device=device)[None, :, None, None],
            torch.arange(sq, device=device)[None, None, :, None], torch.arange(sk, device=device)[None, None, None, :])


def attention(q, k, v, *, causal=False, scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
              block_mask=None, dropout_p=0.0, rng_state=None, dropout_mask=None, deterministic=False,
              return_lse=False, upcast=True, mask_mod=None, score_mod=None):
    """Attention on (batch, seqlen, heads, headdim) tensors by the SPEC's score pipeline.

    dropout: the keep mask is ``dropout_mask`` if given, else ``flashcute.dropout_mask(rng_state, ...)``.
    """
    del deterministic  # the math is deterministic
    dtype = q.dtype
    if upcast:
        q, k, v = q.float(), k.float(), v.float()
    b, sq, h, d = q.shape
    sk, h_kv = k.shape[1], k.shape[2]
    if scale is None:
        scale = d ** -0.5
    if h != h_kv:
        k = k.repeat_interleave(h // h_kv, dim=2)
        v = v.repeat_interleave(h // h_kv, dim=2)
    # 1. s = scale q.k (pt: q scaled first, in q's dtype, as a kernel in that dtype would)
    scores = torch.einsum("bqhd,bkhd->bhqk", q * scale, k) if not upcast else \
        torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    # 2. softcap
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    # 3. ALiBi
    if alibi_slopes is not None:
        scores = scores + alibi_bias(alibi_slopes.to(q.device), b, sq, sk).to(scores.dtype)
    if score_mod is not None:
        scores = score_mod(scores, *_index_grids(b, h, sq, sk, q.device))
    # 4. masks
    left, right = window_size
    if causal:
        right = 0
    visible = window_mask(sq, sk, (left, right), q.device).expand(b, h, sq, sk)
    if block_mask is not None:
        visible = visible & block_mask.to_dense(sq, sk).to(q.device)
    if mask_mod is not None:
        visible = visible & mask_mod(*_index_grids(b, h, sq, sk, q.device))
    scores = scores.masked_fill(~visible, float("-inf"))
    # 5. softmax; lse of the visible scores (-inf on rows with none)
    lse = torch.logsumexp(scores.float(), dim=-1)  # (b, h, sq)
    row_any = visible.any(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(~row_any, 0.0), dim=-1).masked_fill(~row_any, 0.0)
    # 6. dropout
    if dropout_p > 0:
        if dropout_mask is None:
            from .api import dropout_mask as _dropout_mask

            dropout_mask = _dropout_mask(rng_state, b, h, sq, sk, dropout_p)
        probs = probs * dropout_mask.to(probs.device) / (1.0 - dropout_p)
    # 7. out
    out = torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v).to(dtype)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, alibi_slopes=None,
                     dropout_p=0.0, rng_state=None, dropout_mask=None, return_lse=False, **kwargs):
    """Packed batches (total, heads, headdim): ``attention`` on each sequence; rows outside every
    sequence get out 0 and lse -inf. ALiBi slopes (n, h) are per sequence; dropout uses the mask
    of sequence s at batch index s with max_seqlen_q x max_seqlen_k (SPEC)."""
    cu_q = [int(x) for x in cu_seqlens_q.tolist()]
    cu_k = [int(x) for x in cu_seqlens_k.tolist()]
    n, h = len(cu_q) - 1, q.shape[1]
    if dropout_p > 0 and dropout_mask is None:
        from .api import dropout_mask as _dropout_mask

        dropout_mask = _dropout_mask(rng_state, n, h, max_seqlen_q, max_seqlen_k, dropout_p)
    outs, lses = [], []
    for s in range(n):
        qs, ks, vs = (t[a:e].unsqueeze(0) for t, a, e in ((q, cu_q[s], cu_q[s + 1]), (k, cu_k[s], cu_k[s + 1]),
                                                          (v, cu_k[s], cu_k[s + 1])))
        slopes = None
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[s:s + 1]
        mask = dropout_mask[s:s + 1, :, :qs.shape[1], :ks.shape[1]] if dropout_p > 0 else None
        o, l = attention(qs, ks, vs, alibi_slopes=slopes, dropout_p=dropout_p, dropout_mask=mask, return_lse=True,
                         **kwargs)
        outs.append(o[0])
        lses.append(l[0])
    # Rows outside every sequence: out 0, lse -inf. Concatenated (not written in place) so that
    # autograd flows through every sequence's slice.
    first = cu_q[0] if n > 0 else q.shape[0]
    last = cu_q[-1] if n > 0 else q.shape[0]
    dtype = outs[0].dtype if outs else q.dtype
    pad = lambda rows: torch.zeros((rows,) + tuple(q.shape[1:]), dtype=dtype, device=q.device)  # noqa: E731
    neg = lambda rows: torch.full((h, rows), float("-inf"), dtype=torch.float32, device=q.device)  # noqa: E731
    out = torch.cat([pad(first)] + outs + [pad(q.shape[0] - last)], dim=0)
    lse = torch.cat([neg(first)] + lses + [neg(q.shape[0] - last)], dim=1)
    return (out, lse) if return_lse else out


def _kvcache_lengths(fn, cache_seqlens, batch, capacity, paged):
    """cache_seqlens (None | int | int tensor (batch,)) as a list of Python ints."""
    if cache_seqlens is None:
        if paged:
            raise ValueError(f"{fn}: a paged cache (block_table given) needs cache_seqlens")
        return [capacity] * batch
    if isinstance(cache_seqlens, torch.Tensor):
        lengths = [int(x) for x in cache_seqlens.reshape(-1).tolist()]
        if len(lengths) != batch:
            raise ValueError(f"{fn}: cache_seqlens has {len(lengths)} entries, expected batch = {batch}")
        return lengths
    return [int(cache_seqlens)] * batch


def attention_with_kvcache(q, k_cache, v_cache, k=None, v=None, *, cache_seqlens=None, block_table=None,
                           causal=False, scale=None, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           num_splits=0, return_lse=False, upcast=True, return_cache=False):
    """``flashcute.attention_with_kvcache`` by plain PyTorch; the inputs are never modified.

    The caches are cloned; k, v (batch, seqlen_new, nheads_kv, headdim), if given, are written into
    the copies at positions cache_seqlens[b] + t (through block_table for a paged cache: position t
    of sequence b lives in page block_table[b, t // page_size], slot t % page_size); then each
    sequence's first cache_seqlens[b] + seqlen_new positions are gathered into a contiguous
    (1, sk_b, nheads_kv, headdim) tensor and ``attention`` runs on it (bottom-right alignment,
    ALiBi slopes (h,) or the sequence's row of (b, h)). Returns out (b, sq, h, d) [and lse
    (b, h, sq)]; with ``return_cache=True`` (out, lse, k_cache_new, v_cache_new). num_splits is
    ignored (the result does not depend on it). A sequence with no key gets out 0, lse -inf.
    """
    del num_splits
    fn = "reference.attention_with_kvcache"
    if (k is None) != (v is None):
        raise ValueError(f"{fn}: k and v must be given together")
    paged = block_table is not None
    batch, seqlen_q, nheads, _ = q.shape
    k_new, v_new = k_cache.clone(), v_cache.clone()
    if paged:
        page_size = k_cache.shape[1]
        capacity = block_table.shape[1] * page_size
    else:
        capacity = k_cache.shape[1]
    lengths = _kvcache_lengths(fn, cache_seqlens, batch, capacity, paged)
    s_new = 0 if k is None else k.shape[1]
    for b, n in enumerate(lengths):
        if n < 0:
            raise ValueError(f"{fn}: cache_seqlens[{b}] = {n} < 0")
        if n + s_new > capacity:
            raise ValueError(f"{fn}: KV-cache overflow: cache_seqlens[{b}] = {n} plus {s_new} new tokens exceeds "
                             f"the capacity {capacity}")

    def where(b, positions):
        """(page or batch index, slot) tensors of sequence b's positions."""
        if paged:
            table = block_table[b].to(device=k_cache.device, dtype=torch.int64)
            return table[positions // page_size], positions % page_size
        return torch.full_like(positions, b), positions

    dev = k_cache.device
    # 1. the appends
    if s_new > 0:
        for b, n in enumerate(lengths):
            idx = where(b, torch.arange(n, n + s_new, device=dev))
            k_new[idx] = k[b].to(k_new.dtype)
            v_new[idx] = v[b].to(v_new.dtype)
    # 2. attention of each sequence on its first n + s_new positions
    outs, lses = [], []
    for b, n in enumerate(lengths):
        idx = where(b, torch.arange(n + s_new, device=dev))
        kb, vb = k_new[idx].unsqueeze(0), v_new[idx].unsqueeze(0)
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[b:b + 1]
        o, l = attention(q[b:b + 1], kb, vb, causal=causal, scale=scale, window_size=window_size, softcap=softcap,
                         alibi_slopes=slopes, return_lse=True, upcast=upcast)
        outs.append(o)
        lses.append(l)
    if outs:
        out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=0)
    else:  # batch 0
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.empty((0, nheads, seqlen_q), dtype=torch.float32, device=q.device)
    if return_cache:
        return out, lse, k_new, v_new
    return (out, lse) if return_lse else out
