"""flashcute as a Hugging Face transformers attention implementation.

::

    import flashcute.integrations.transformers as fct
    name = fct.register()                      # "cute_attention"
    model = AutoModelForCausalLM.from_pretrained(..., attn_implementation=name)
    # or: model.set_attn_implementation(name)

``register()`` adds two functions under one name:

- to ``transformers.AttentionInterface``: :func:`attention_forward`, which runs
  ``flashcute.attention`` (dense batches, KV-cache decoding: flashcute's causal mask is aligned
  bottom-right, so a query block attends to every cached key before it) and
  ``flashcute.attention_varlen`` (padded batches, packed sequences);
- to ``transformers.AttentionMaskInterface``: :func:`attention_mask`, which, like transformers'
  ``flash_attention_mask``, builds no 4-D mask: it returns ``None`` (dense), the 2-D padding mask
  (bool, (batch, kv_len)) or the packed-sequence ids (int, (batch, seq)). Without a registered
  mask function transformers would pass no mask at all (padding silently ignored).

**The name has no "flash" in it**: transformers >= 5 treats every implementation name that
contains "flash" as a request for a flash-attn package (``is_flash_attention_requested``) and
refuses it at model init. :func:`register` rejects such names with that explanation.

Routing (checked in this order, as transformers' own flash-attention path does):

1. a 2-D padding mask: unpad q/k/v, ``attention_varlen``, pad back (padded query rows get 0);
2. ``cu_seq_lens_q/k`` + ``max_length_q/k`` kwargs (``DataCollatorWithFlattening(
   return_flash_attn_kwargs=True)``), packed-sequence ids from the mask function, or
   ``position_ids`` that restart (packed sequences, q_len == kv_len): ``attention_varlen``;
3. otherwise ``flashcute.attention`` (causal bottom-right, GQA native, no copies).

Attention dropout (the module's rate in training) runs in the kernels. What flashcute cannot
serve goes to a plain PyTorch path (SDPA, or the explicit math where SDPA lacks the feature) with
a warning once per reason, never silently dropped: ``output_attentions``, attention sinks
(``s_aux``), value head dim != query head dim, dtypes, devices or head dims this build has no
kernel for, and masks that are not
causal/bidirectional/sliding-window/padding/packing (e.g. ``or_mask_function`` overlays,
chunked attention): for those :func:`attention_mask` returns transformers' 4-D ``sdpa_mask``.
"""
from __future__ import annotations

import inspect
import warnings

import torch
import torch.nn.functional as F

from .. import api as _api

NAME = "cute_attention"

_warned: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashcute.integrations.transformers: {reason}; using PyTorch attention for such calls",
                      stacklevel=3)


# ---- registration ---------------------------------------------------------------------------
def register(name: str = NAME) -> str:
    """Registers flashcute's attention and mask functions with transformers under ``name``.

    Returns the name, for ``attn_implementation=``. Idempotent.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"flashcute.integrations.transformers.register: name must be a non-empty str, got {name!r}")
    if "flash" in name.lower():
        raise ValueError(
            f"flashcute.integrations.transformers.register: the name {name!r} contains 'flash'; transformers >= 5 "
            "treats every attention implementation whose name contains 'flash' as a request for a flash-attn "
            "package and refuses it at model init. Use a name without 'flash', e.g. the default "
            f"{NAME!r}.")
    if name in ("eager", "sdpa", "flex_attention") or "|" in name or "/" in name:
        raise ValueError(f"flashcute.integrations.transformers.register: {name!r} is a transformers built-in or "
                         "kernel-hub name; choose another one")
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    _record_transformers_packing_check()
    return name


def unregister(name: str = NAME) -> None:
    """Removes ``name`` from transformers' two registries (models set to it stop working)."""
    from transformers import AttentionInterface, AttentionMaskInterface

    for interface in (AttentionInterface, AttentionMaskInterface):
        mapping = interface._global_mapping
        if mapping.get(name) in (attention_forward, attention_mask):
            del mapping[name]


# ---- the mask function ----------------------------------------------------------------------
# Mask functions (transformers.masking_utils) that the attention function reproduces itself from
# is_causal, sliding_window, the 2-D padding mask and the packing ids. Anything else is a pattern
# flashcute's kernels do not know: attention_mask then returns the full 4-D sdpa mask.
_KNOWN_MASK_FUNCTIONS = {
    "causal_mask_function",
    "bidirectional_mask_function",
    "sliding_window_overlay.<locals>.inner_mask",  # causal sliding window: the `sliding_window` kwarg
    "packed_sequence_mask_function.<locals>.inner_mask",
}


def _mask_parts(fn, parts):
    """Collects the known pieces of an (and_masks-composed) mask function; False for any other."""
    if getattr(fn, "__module__", None) != "transformers.masking_utils":
        return False
    qualname = getattr(fn, "__qualname__", "")
    if qualname == "and_masks.<locals>.and_mask":
        inner = inspect.getclosurevars(fn).nonlocals.get("mask_functions")
        return inner is not None and all(_mask_parts(f, parts) for f in inner)
    if qualname not in _KNOWN_MASK_FUNCTIONS:
        return False
    parts.append(fn)
    return True


def _packed_ids_of(parts):
    for fn in parts:
        if fn.__qualname__.startswith("packed_sequence_mask_function"):
            return inspect.getclosurevars(fn).nonlocals.get("packed_sequence_mask")
    return None


def attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                   attention_mask=None, **kwargs):
    """transformers mask function (``AttentionMaskInterface``) paired with :func:`attention_forward`.

    Returns ``None`` (no padding, no packing), the 2-D bool padding mask (batch, kv_len) (also
    when the cache is longer than the mask, as with a static cache), the packed-sequence ids
    (int, (batch, q_len)), or, for a mask pattern flashcute does not know, transformers'
    4-D ``sdpa_mask`` (then the attention falls back to PyTorch).
    """
    parts: list = []
    if mask_function is not None and not _mask_parts(mask_function, parts):
        from transformers.masking_utils import sdpa_mask

        kwargs.pop("allow_is_causal_skip", None)
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                         allow_is_causal_skip=False, **kwargs)
    if attention_mask is not None:
        attention_mask = attention_mask[:, -kv_length:]
        if attention_mask.shape[-1] == kv_length and bool(attention_mask.all()):
            attention_mask = None
        return attention_mask
    packed = _packed_ids_of(parts)
    if packed is not None:
        return packed.to(torch.int32)
    return None


# ---- packing --------------------------------------------------------------------------------
def _cu_seqlens_of_ids(ids: torch.Tensor):
    """cu_seqlens (int32) and max length of the flattened (batch, seq) packing ids: a sequence
    starts at each row start and wherever the id changes."""
    b, s = ids.shape
    starts = torch.ones_like(ids, dtype=torch.bool)
    if s > 1:
        starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return _cu_seqlens_of_starts(starts)


def _cu_seqlens_of_starts(starts: torch.Tensor):
    total = starts.numel()
    idx = torch.nonzero(starts.reshape(-1)).reshape(-1).to(torch.int32)
    cu = torch.cat([idx, torch.tensor([total], dtype=torch.int32, device=idx.device)])
    max_len = int(cu.diff().max().item()) if cu.numel() > 1 else 0
    return cu, max_len


# Packing analysis reads tensors on the host (a GPU sync each time), so its result is remembered
# for the tensor that every layer of one forward receives (the packing ids, the position ids),
# until the tensor changes in place. A sync in a layer costs a CPU-bound training step the
# launches queued ahead of it (the Llama benchmark, H100: docs/NOTES.md, session 13).
# The entry holds the tensor, so its memory cannot be reused by another one while the key
# (address, shape, strides, version) names it.
_memo: dict[str, tuple] = {}  # kind -> (tensor, key, result)


def _key(t: torch.Tensor):
    return (t.device, t.data_ptr(), tuple(t.shape), t.stride(), t._version)


def _remember(kind: str, tensor: torch.Tensor, result, extra=()) -> None:
    _memo[kind] = (tensor, _key(tensor) + extra, result)


def _memoized(kind: str, tensor: torch.Tensor, compute, extra=()):
    """compute(), or its remembered result for this tensor (and the other arguments, extra)."""
    if torch.compiler.is_compiling():
        return compute()
    hit = _memo.get(kind)
    if hit is not None and hit[1] == _key(tensor) + extra:
        return hit[2]
    result = compute()
    _remember(kind, tensor, result, extra)
    return result


def _packing_of_ids(ids: torch.Tensor):
    """(cu_seqlens, max_len) of the packing ids that the mask function returned."""
    return _memoized("ids", ids, lambda: _cu_seqlens_of_ids(ids))


def _packing_of_position_ids(position_ids: torch.Tensor, batch: int, q_len: int):
    """(cu_seqlens, max_len) when the position ids restart inside a row (packed sequences, the
    rule of transformers' find_packed_sequence_indices: a sequence starts where the id does not
    grow by 1), else None."""
    if position_ids.dim() != 2 or position_ids.shape[-1] != q_len or position_ids.shape[0] not in (1, batch):
        return None

    pos = position_ids if position_ids.shape[0] == batch else position_ids.expand(batch, -1)

    def compute():
        starts = torch.ones_like(pos, dtype=torch.bool)
        if q_len > 1:
            starts[:, 1:] = pos[:, 1:] - pos[:, :-1] != 1
        return _cu_seqlens_of_starts(starts) if bool(starts[:, 1:].any()) else None

    return _memoized("position_ids", pos, compute)


def _record_transformers_packing_check() -> None:
    """Where transformers has itself looked for packing in these position ids (its mask
    preparation does, without a cache and a 2-D mask) and found none, the attention need not
    look again: wraps masking_utils.find_packed_sequence_indices to remember a None answer for
    the (batch-expanded) tensor it was given. When it finds packing, the mask function carries
    the ids, and the attention never reaches the position ids. Idempotent."""
    from transformers import masking_utils

    original = getattr(masking_utils, "find_packed_sequence_indices", None)
    if original is None or getattr(original, "_flashcute_recording", False):
        return

    def find_packed_sequence_indices(position_ids, *args, **kwargs):
        result = original(position_ids, *args, **kwargs)
        if result is None and isinstance(position_ids, torch.Tensor) and not torch.compiler.is_compiling():
            _remember("position_ids", position_ids, None)
        return result

    find_packed_sequence_indices._flashcute_recording = True
    find_packed_sequence_indices.__wrapped__ = original
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


# ---- the attention function -----------------------------------------------------------------
def _target_dtype(query, module):
    """fp32 inputs on CUDA (PEFT-cast norms): the dtype transformers' flash path casts to."""
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "_is_quantized"):
        return config.dtype
    for layer in module.modules():
        if isinstance(layer, torch.nn.Linear):
            return layer.weight.dtype
    return query.dtype


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                      sliding_window=None, softcap=None, s_aux=None, **kwargs):
    """transformers attention function (``AttentionInterface``) on flashcute's kernels.

    query (batch, heads, q_len, d), key/value (batch, kv_heads, kv_len, d) (GQA: fewer kv heads);
    returns (attn_output (batch, q_len, heads, d), None). See the module docstring for routing.
    """
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    output_attentions = bool(kwargs.get("output_attentions", False))
    reason = None
    if output_attentions:
        reason = "output_attentions=True needs the attention weights"
    elif s_aux is not None:
        reason = "attention sinks (s_aux) are not supported"
    elif attention_mask is not None and attention_mask.dim() == 4:
        reason = "a 4-D attention mask (a pattern other than causal/bidirectional/sliding-window/padding/packing)"
    elif value.shape[-1] != query.shape[-1]:
        reason = "value head dim differs from the query head dim"
    elif sliding_window is not None and not causal:
        reason = "bidirectional sliding windows are not supported"

    q_len, kv_len = query.shape[2], key.shape[2]
    if reason is None:
        q, k, v = query, key, value
        if query.dtype == torch.float32 and query.is_cuda:
            target = _target_dtype(query, module)
            if target in (torch.float16, torch.bfloat16):
                q, k, v = q.to(target), k.to(target), v.to(target)
        reason = _api._unsupported(q, k, v, None, 0.0, False, True)
    if reason is not None:
        _warn_once(reason)
        return _fallback_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 causal=causal, sliding_window=sliding_window, softcap=softcap, s_aux=s_aux,
                                 output_attentions=output_attentions, position_ids=kwargs.get("position_ids"))
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # flashcute's (batch, seq, heads, d)

    # Attention dropout (transformers passes the module's rate in training, 0 in eval): the kernels'.
    opts = dict(causal=causal and q_len > 1, scale=scaling, softcap=float(softcap or 0.0),
                dropout_p=float(dropout or 0.0))
    if sliding_window is not None and kv_len > sliding_window:
        opts["window_size"] = (int(sliding_window) - 1, 0)
    b = q.shape[0]

    # 1. padding
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        return _padded_forward(q, k, v, attention_mask, causal=causal, opts=opts), None

    # 2. packed sequences
    packing = None
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q, max_k = kwargs.get("max_length_q"), kwargs.get("max_length_k")
    if cu_q is not None and cu_k is not None and max_q is not None and max_k is not None:
        packing = (cu_q.to(torch.int32), cu_k.to(torch.int32), int(max_q), int(max_k))
    elif attention_mask is not None and attention_mask.dim() == 2 and q_len == kv_len:  # packing ids
        cu, max_len = _packing_of_ids(attention_mask)
        packing = (cu, cu, max_len, max_len)
    elif kwargs.get("position_ids") is not None and q_len == kv_len and q_len > 1:
        found = _packing_of_position_ids(kwargs["position_ids"], b, q_len)
        if found is not None:
            packing = (found[0], found[0], found[1], found[1])
    if packing is not None:
        cu_q, cu_k, max_q, max_k = packing
        opts["causal"] = causal
        out = _api.attention_varlen(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, max_q, max_k,
                                    **opts)
        return out.view(b, q_len, *out.shape[1:]), None

    # 3. dense (decoding with a cache included: bottom-right causal)
    return _api.attention(q, k, v, **opts), None


def _unpadding(mask, q_len, causal):
    """The kept rows of a 2-D padding mask (batch, L) as flat indices, cu_seqlens and max length:
    for the keys, and for the queries (None: every query row is kept). Its GPU syncs (nonzero, the
    max lengths) happen once per mask: the result is remembered for the mask every layer receives."""
    def compute():
        b, L = mask.shape

        def rows(m):
            seqlens = m.sum(-1, dtype=torch.int32)
            cu = F.pad(seqlens.cumsum(0, dtype=torch.int32), (1, 0))
            return torch.nonzero(m.reshape(-1)).reshape(-1), cu, int(seqlens.max().item())

        if q_len == L:
            q_mask = mask
        elif causal:
            q_mask = mask[:, -q_len:]  # the new tokens are the last q_len ones (left padding)
        else:
            q_mask = None  # cross attention / bidirectional: every query row is kept
        keys = rows(mask)
        if q_mask is None or (q_len == 1 and q_len != L):
            return keys, (None, torch.arange(b + 1, dtype=torch.int32, device=mask.device) * q_len, q_len)
        return keys, rows(q_mask)

    return _memoized("padding", mask, compute, extra=(q_len, causal))


def _padded_forward(q, k, v, mask, *, causal, opts):
    """2-D padding mask (batch, L): unpad, attention_varlen, pad back (as transformers' _upad_input)."""
    b, q_len = q.shape[0], q.shape[1]
    mask = mask.to(device=q.device)
    L = mask.shape[-1]
    if k.shape[1] > L:  # static cache: the slots past the mask are not filled
        k, v = k[:, :L], v[:, :L]
    (idx_k, cu_k, max_k), (idx_q, cu_q, max_q) = _unpadding(mask, q_len, causal)
    k_un, v_un = (t.reshape(b * L, *t.shape[2:]).index_select(0, idx_k) for t in (k, v))
    q_un = q.flatten(0, 1) if idx_q is None else q.reshape(b * q_len, *q.shape[2:]).index_select(0, idx_q)
    opts = dict(opts, causal=causal)
    out_un = _api.attention_varlen(q_un, k_un, v_un, cu_q, cu_k, max_q, max_k, **opts)
    if idx_q is None:
        return out_un.view(b, q_len, *out_un.shape[1:])
    out = out_un.new_zeros((b * q_len,) + tuple(out_un.shape[1:]))
    return out.index_copy(0, idx_q, out_un).view(b, q_len, *out_un.shape[1:])


# ---- the PyTorch fallback -------------------------------------------------------------------
def _fallback_forward(module, query, key, value, mask, *, dropout, scaling, causal, sliding_window, softcap,
                      s_aux, output_attentions, position_ids):
    """Attention by PyTorch for what flashcute does not serve: SDPA with a bool mask, or the
    explicit math when softcap, sinks or the weights are needed. (b, h, s, d) in, (b, s, h, d) out."""
    b, h, q_len, d = query.shape
    h_kv = key.shape[1]
    if mask is not None and mask.dim() == 4:
        allowed = mask
        if allowed.shape[-1] < key.shape[2]:
            key, value = key[:, :, :allowed.shape[-1]], value[:, :, :allowed.shape[-1]]
    else:
        if mask is not None and mask.dtype == torch.bool and key.shape[2] > mask.shape[-1]:
            key, value = key[:, :, :mask.shape[-1]], value[:, :, :mask.shape[-1]]
        kv_len = key.shape[2]
        i = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)  # bottom-right
        j = torch.arange(kv_len, device=query.device)[None, :]
        allowed = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device)
        if causal:
            allowed &= j <= i
            if sliding_window is not None:
                allowed &= j > i - int(sliding_window)
        elif sliding_window is not None:
            allowed &= (i - j).abs() <= int(sliding_window)
        allowed = allowed[None, None].expand(b, 1, q_len, kv_len)
        ids = None
        if mask is not None and mask.dtype == torch.bool:
            allowed = allowed & mask[:, None, None, :]
        elif mask is not None and mask.dim() == 2:
            ids = mask
        elif position_ids is not None and q_len == kv_len and q_len > 1:
            found = _packing_of_position_ids(position_ids, b, q_len)
            if found is not None:
                seq = torch.zeros(b * q_len, dtype=torch.int32, device=query.device)
                seq[found[0][1:-1].long()] = 1
                ids = seq.cumsum(0).view(b, q_len)
        if ids is not None:
            allowed = allowed & (ids[:, None, :, None] == ids[:, None, None, :])
        # rows with no visible key (padding queries) attend to everything: finite garbage, as
        # transformers' sdpa mask does; their outputs are never used.
        allowed = allowed | ~allowed.any(-1, keepdim=True)
    if softcap is None and s_aux is None and not output_attentions:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, dropout_p=dropout,
                                             scale=scaling, enable_gqa=h != h_kv)
        return out.transpose(1, 2).contiguous(), None
    if h != h_kv:
        key = key.repeat_interleave(h // h_kv, dim=1)
        value = value.repeat_interleave(h // h_kv, dim=1)
    scale = scaling if scaling is not None else d ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if allowed.dtype == torch.bool:
        scores = scores.masked_fill(~allowed, float("-inf"))
    else:
        scores = scores + allowed
    if s_aux is not None:
        sinks = s_aux.reshape(1, -1, 1, 1).expand(b, -1, q_len, 1).to(scores.dtype)
        combined = torch.cat([scores, sinks], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = F.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1]
    else:
        probs = F.softmax(scores, dim=-1, dtype=torch.float32)
    probs = F.dropout(probs, p=dropout, training=True).to(value.dtype) if dropout else probs.to(value.dtype)
    out = torch.matmul(probs, value)
    return out.transpose(1, 2).contiguous(), (probs if output_attentions else None)


__all__ = ["NAME", "register", "unregister", "attention_forward", "attention_mask"]
