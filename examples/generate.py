"""Greedy generation with a KV cache on ``flashcute.attention_with_kvcache``, checked against
recomputing every step from scratch.

A small decoder-only transformer (random weights from a fixed seed; RMSNorm, rotary position
embeddings, grouped-query attention with 8 query heads over 2 K/V heads of dim 32, a SiLU-gated
MLP; d_model 128) generates --steps tokens greedily for a batch of prompts of different lengths:

(a) with a KV cache: each layer owns a preallocated cache, contiguous (batch, capacity, h_k, d)
    or, with --paged, pages of 16 tokens handed out through a shuffled block table. Each prompt
    is prefilled on its own (its k, v appended at position 0, causal); then every decode step
    runs the whole batch at once, one new token per sequence, appending its k, v at position
    ``cache_seqlens[b]``, which the loop advances by one after each step (the op does not);
(b) from scratch: every step runs the model over each sequence's whole prefix with full causal
    attention (``flashcute.attention(causal=True)``, or torch SDPA with --reference sdpa) and
    takes the argmax. The prefix of step t is the prompt and the tokens (a) chose before t
    (--free-running: the ones (b) chose), so every step is checked on the same prefix.

The script prints both token sequences, the largest difference of their logits and
``same tokens: True``; it raises AssertionError when a step's tokens differ, unless the
reference's top-2 logits there are within --tie-tol (a numerical tie: possible with 16-bit
attention on a GPU, never seen in float32), or when the logits differ by more than the dtype's
bound.

    python examples/generate.py --device cpu [--paged] [--steps 24]

The model runs in float32; attention runs in float32 on the CPU and in float16 on CUDA (the
dtypes flashcute serves there; --attn-dtype to change), its K/V cache in that dtype too.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch
import torch.nn.functional as F

import flashcute

# flashcute.attention_with_kvcache (SPEC v2); flashcute.api has it in any case.
attention_with_kvcache = getattr(flashcute, "attention_with_kvcache", None) or flashcute.api.attention_with_kvcache


class Config:
    vocab = 512
    d_model = 128
    n_layers = 3
    n_heads = 8
    n_kv_heads = 2
    head_dim = 32
    d_ff = 256
    rope_base = 10000.0


def init_weights(cfg, seed, device):
    """Random float32 weights (normal, scaled by 1 / sqrt(fan_in)) from a private generator."""
    gen = torch.Generator().manual_seed(seed)

    def w(rows, cols):
        return (torch.randn(rows, cols, generator=gen) / math.sqrt(cols)).to(device)

    hq, hk, d = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim, cfg.d_model
    layers = [dict(wq=w(hq, d), wk=w(hk, d), wv=w(hk, d), wo=w(d, hq), w_gate=w(cfg.d_ff, d), w_up=w(cfg.d_ff, d),
                   w_down=w(d, cfg.d_ff)) for _ in range(cfg.n_layers)]
    # Embeddings of unit-size entries and a head that spreads the logits well apart.
    return dict(embed=torch.randn(cfg.vocab, d, generator=gen).to(device), layers=layers,
                lm_head=(3.0 * torch.randn(cfg.vocab, d, generator=gen) / math.sqrt(d)).to(device))


def rms_norm(x, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x, positions, base):
    """Rotary embedding of x (..., seq, heads, head_dim) at integer positions (..., seq)."""
    half = x.shape[-1] // 2
    freqs = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[..., None] * freqs  # (..., seq, half)
    cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]  # broadcast over heads
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def forward(cfg, weights, tokens, positions, attend):
    """Logits (b, s, vocab) of tokens (b, s) at positions (b, s); attend(layer, q, k, v) -> out
    does the attention on (b, s, heads, head_dim) tensors, whatever it keeps between calls."""
    b, s = tokens.shape
    x = weights["embed"][tokens]
    for i, lw in enumerate(weights["layers"]):
        h = rms_norm(x)
        q = (h @ lw["wq"].T).view(b, s, cfg.n_heads, cfg.head_dim)
        k = (h @ lw["wk"].T).view(b, s, cfg.n_kv_heads, cfg.head_dim)
        v = (h @ lw["wv"].T).view(b, s, cfg.n_kv_heads, cfg.head_dim)
        q, k = rope(q, positions, cfg.rope_base), rope(k, positions, cfg.rope_base)
        attn = attend(i, q, k, v).to(torch.float32).reshape(b, s, cfg.n_heads * cfg.head_dim)
        x = x + attn @ lw["wo"].T
        h = rms_norm(x)
        x = x + (F.silu(h @ lw["w_gate"].T) * (h @ lw["w_up"].T)) @ lw["w_down"].T
    return rms_norm(x) @ weights["lm_head"].T


class KVCache:
    """Per-layer K/V caches for `batch` sequences of up to `capacity` tokens: contiguous
    (batch, capacity, h_k, d), or paged (num_pages, page_size, h_k, d) with a block table that
    hands each sequence its pages in a shuffled order (plus a few spare pages never used)."""

    def __init__(self, cfg, batch, capacity, dtype, device, paged=False, page_size=16, seed=0):
        self.paged = paged
        if paged:
            pages_per_seq = math.ceil(capacity / page_size)
            num_pages = batch * pages_per_seq + 3
            perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
            self.block_table = perm[:batch * pages_per_seq].view(batch, pages_per_seq).to(torch.int32).to(device)
            shape = (num_pages, page_size, cfg.n_kv_heads, cfg.head_dim)
        else:
            self.block_table = None
            shape = (batch, capacity, cfg.n_kv_heads, cfg.head_dim)
        # NaN-filled: a read of a slot that nothing wrote would show in the logits.
        self.k = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(cfg.n_layers)]
        self.v = [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(cfg.n_layers)]

    def attend(self, rows, cache_seqlens, dtype):
        """attend(layer, q, k, v) for forward(): appends k, v of the sequences `rows` (a slice of
        the batch) at positions cache_seqlens and attends to everything up to them, causally."""
        def attend(layer, q, k, v):
            if self.paged:  # every sequence's pages live in the one pool; its table row finds them
                k_cache, v_cache = self.k[layer], self.v[layer]
                block_table = self.block_table[rows]
            else:
                k_cache, v_cache = self.k[layer][rows], self.v[layer][rows]  # views: writes land in the cache
                block_table = None
            return attention_with_kvcache(q.to(dtype), k_cache, v_cache, k.to(dtype), v.to(dtype),
                                          cache_seqlens=cache_seqlens, block_table=block_table, causal=True)
        return attend


def generate_with_cache(cfg, weights, prompts, steps, dtype, device, paged=False, seed=0):
    """(a) Greedy tokens (b, steps) and the logits of each step, with a KV cache."""
    batch = len(prompts)
    lengths = [len(p) for p in prompts]
    cache = KVCache(cfg, batch, max(lengths) + steps, dtype, device, paged=paged, seed=seed)
    cache_seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
    # Prefill: each prompt on its own (they differ in length), into its own part of the cache.
    last_logits = []
    for i, prompt in enumerate(prompts):
        tokens = torch.tensor([prompt], device=device)
        positions = torch.arange(len(prompt), device=device)[None]
        logits = forward(cfg, weights, tokens, positions, cache.attend(slice(i, i + 1), cache_seqlens[i:i + 1], dtype))
        last_logits.append(logits[0, -1])
    cache_seqlens += torch.tensor(lengths, dtype=torch.int32, device=device)
    logits = torch.stack(last_logits)
    out, all_logits = [], []
    for step in range(steps):
        next_tokens = logits.argmax(-1)
        out.append(next_tokens)
        all_logits.append(logits)
        if step == steps - 1:
            break
        # Decode: the whole batch, one token per sequence at its own position.
        positions = cache_seqlens.to(torch.int64)[:, None]
        logits = forward(cfg, weights, next_tokens[:, None], positions,
                         cache.attend(slice(None), cache_seqlens, dtype))[:, -1]
        cache_seqlens += 1  # the op appends but does not advance the lengths: the loop does
    return torch.stack(out, 1), torch.stack(all_logits, 1)


def generate_from_scratch(cfg, weights, prompts, steps, dtype, device, reference="flashcute", follow=None):
    """(b) Greedy tokens (b, steps) and logits, recomputing each sequence's whole prefix with
    full causal attention at every step. With `follow` (b, steps), step t's prefix is the prompt
    and follow[:, :t] (the KV-cache loop's tokens: one near-tie cannot derail every later step);
    otherwise this loop's own tokens."""
    def attend(layer, q, k, v):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if reference == "sdpa":
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                  is_causal=True, enable_gqa=True).transpose(1, 2)
        return flashcute.attention(q, k, v, causal=True)

    out, all_logits = [], []
    for i, prompt in enumerate(prompts):
        seq, tokens, logits_seq = list(prompt), [], []
        for t in range(steps):
            ids = torch.tensor([seq], device=device)
            logits = forward(cfg, weights, ids, torch.arange(len(seq), device=device)[None], attend)[0, -1]
            token = int(logits.argmax())
            tokens.append(token)
            logits_seq.append(logits)
            seq.append(token if follow is None else int(follow[i, t]))
        out.append(tokens)
        all_logits.append(torch.stack(logits_seq))
    return torch.tensor(out, device=device), torch.stack(all_logits)


# Per attention dtype: a step where the two loops pick different tokens is a numerical tie when the
# reference's top-2 logits are this close (float32 agrees to ~1e-5; bf16 attention moves logits by
# ~2e-2 on this model), and the logits of the two loops must agree this well.
TIE_TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}
LOGIT_TOL = {torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 2e-1}


def make_prompts(cfg, lengths, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    return [torch.randint(cfg.vocab, (n,), generator=gen).tolist() for n in lengths]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--paged", action="store_true", help="a paged KV cache (pages of 16, shuffled block table)")
    p.add_argument("--steps", type=int, default=24, help="tokens to generate per sequence")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[7, 19, 12], help="one prompt per length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--attn-dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="attention's (and the cache's) dtype; default float32 on the CPU, float16 on CUDA")
    p.add_argument("--head-dim", type=int, default=Config.head_dim,
                   help=f"the attention heads' dim (default {Config.head_dim}; 128 for a build restricted to it)")
    p.add_argument("--reference", choices=["flashcute", "sdpa"], default="flashcute",
                   help="the from-scratch loop's attention: flashcute.attention(causal=True) or torch SDPA")
    p.add_argument("--free-running", action="store_true",
                   help="the from-scratch loop feeds back its own tokens (default: the KV-cache loop's, so that "
                        "each step is checked on the same prefix)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads for torch while it runs (default 1: the model is tiny, threads only add "
                        "synchronisation)")
    p.add_argument("--tie-tol", type=float, default=None,
                   help="a step whose tokens differ passes when the reference's top-2 logits are within this "
                        "(default: 1e-4 float32, 1e-2 float16, 5e-2 bfloat16)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA GPU is available")
    if args.steps < 1 or not args.prompt_lens or min(args.prompt_lens) < 1:
        p.error("--steps and every --prompt-lens must be >= 1")
    if args.head_dim < 2 or args.head_dim % 2:
        p.error("--head-dim must be even (rotary embeddings rotate pairs)")
    dtype = getattr(torch, args.attn_dtype or ("float16" if args.device == "cuda" else "float32"))
    device = torch.device(args.device)

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    try:
        return _run(args, dtype, device)
    finally:
        torch.set_num_threads(threads)


def _run(args, dtype, device):
    cfg = Config()
    cfg.head_dim = args.head_dim
    weights = init_weights(cfg, args.seed, device)
    prompts = make_prompts(cfg, args.prompt_lens, args.seed)
    with torch.no_grad():
        cached, cached_logits = generate_with_cache(cfg, weights, prompts, args.steps, dtype, device,
                                                    paged=args.paged, seed=args.seed)
        scratch, scratch_logits = generate_from_scratch(cfg, weights, prompts, args.steps, dtype, device,
                                                        reference=args.reference,
                                                        follow=None if args.free_running else cached)
    same = torch.equal(cached.cpu(), scratch.cpu())
    # Logits are comparable where both loops saw the same prefix: every step when following.
    agree = (cached == scratch).cumprod(1).bool() if args.free_running else torch.ones_like(cached, dtype=torch.bool)
    agree = torch.cat([torch.ones_like(agree[:, :1]), agree[:, :-1]], 1)  # step t's prefix: tokens before t
    max_diff = float((cached_logits - scratch_logits).abs().amax(-1)[agree].max())
    tie_tol = TIE_TOL[dtype] if args.tie_tol is None else args.tie_tol
    top2 = scratch_logits.topk(2, dim=-1).values
    margins = top2[..., 0] - top2[..., 1]
    differ = (cached != scratch).nonzero().tolist()
    if args.free_running:
        differ = differ[:1]  # past the first difference the prefixes differ
    ties = [(b, t, float(margins[b, t])) for b, t in differ if float(margins[b, t]) <= tie_tol]
    ok = len(ties) == len(differ) and max_diff <= LOGIT_TOL[dtype]

    layout = "paged (16-token pages, shuffled block table)" if args.paged else "contiguous"
    print(f"model: {cfg.n_layers} layers, d_model {cfg.d_model}, {cfg.n_heads} query heads over {cfg.n_kv_heads} "
          f"K/V heads of dim {cfg.head_dim}; {args.device}, attention in {str(dtype).replace('torch.', '')}; "
          f"KV cache {layout}; from scratch with {args.reference}"
          + (" (free running)" if args.free_running else " (on the KV-cache loop's prefixes)"))
    for i, prompt in enumerate(prompts):
        print(f"sequence {i} (prompt of {len(prompt)}):")
        print(f"  kv cache:     {cached[i].tolist()}")
        print(f"  from scratch: {scratch[i].tolist()}")
    print(f"max |logits(kv cache) - logits(from scratch)| = {max_diff:.3e} (bound {LOGIT_TOL[dtype]:.0e})")
    print(f"same tokens: {same}")
    if not same and ok:
        print(f"the tokens differ only at near-ties (the reference's top-2 logits within {tie_tol:.0e}): "
              + ", ".join(f"sequence {b} step {t} (margin {m:.1e})" for b, t, m in ties)
              + ("; free running, the steps after it are not comparable" if args.free_running else ""))
    if not ok:
        b, t = differ[0] if differ else (None, None)
        where = (f"first difference: sequence {b}, step {t}: kv cache {int(cached[b, t])}, from scratch "
                 f"{int(scratch[b, t])}, the reference's top-2 margin there {float(margins[b, t]):.3e} "
                 f"(ties: <= {tie_tol:.0e})" if differ else "the tokens agree")
        raise AssertionError(f"the KV-cache loop disagrees with recomputing from scratch: {where}; max logit "
                             f"difference {max_diff:.3e} (bound {LOGIT_TOL[dtype]:.0e})")
    return dict(tokens_cache=cached.tolist(), tokens_scratch=scratch.tolist(), same=same, ok=ok,
                near_ties=ties, max_logit_diff=max_diff)


if __name__ == "__main__":
    main()
    sys.exit(0)
