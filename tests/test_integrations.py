"""flashcute's integrations: Hugging Face transformers, torch's flash-attention registry, the
build record and ``python -m flashcute.info``.

transformers (``pytest.importorskip``; offline, a tiny randomly initialised Llama, no download):
the model with ``attn_implementation="cute_attention"`` against the same weights under
transformers' own ``"sdpa"``:
- CPU (CI), float32: logits and parameter gradients under the SPEC criterion one precision up
  (max|ours - ref64| <= 2 max|sdpa32 - ref64| + 1e-5, ref64: the sdpa model in float64), for
  dense, left- and right-padded batches (padding -> attention_varlen), packed sequences
  (position_ids, and DataCollatorWithFlattening's cu_seq_lens kwargs -> attention_varlen, against
  the documents run one by one), Mistral's sliding window; greedy generate() with the dynamic and
  the static cache gives the same tokens; the PyTorch fallback (output_attentions) warns and
  matches; names with "flash" are refused.
- GPU (``gpu``), bfloat16: the same criterion against the float32 model (ref32) with sdpa's bf16
  error as the yardstick, and greedy generate() with the same tokens.

torch registry: registration, activation and restoration, also of SDPA's backend priority
order (FLASH_ATTENTION first while active, also against torch's one-time cuDNN-first default on
Hopper); on CPU the aten flash ops and ``varlen_attn`` run flashcute's CPU backend (against
F.scaled_dot_product_attention, with gradients, top-left causal for s_q != s_k); on the GPU SDPA
picks its flash backend under the registration and a plain F.scaled_dot_product_attention shows
flashcute's forward and backward kernels in the profiler trace (also in a fresh process that
activates before CUDA is initialised), ``varlen_attn`` matches, and transformers' ``sdpa`` model
runs on them.
"""
from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import flashcute
from conftest import HAS_CUDA, gpu

os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ---- helpers --------------------------------------------------------------------------------
def _maxabs(x):
    return x.abs().max().item() if x.numel() else 0.0


def _check(name, ours, ref, pt, atol):
    """max|ours - ref| <= 2 max|pt - ref| + atol (the SPEC's criterion on model outputs)."""
    ours, ref, pt = ours.double(), ref.double(), pt.double()
    assert torch.isfinite(ours).all(), f"{name}: non-finite values"
    err, base = _maxabs(ours - ref), _maxabs(pt - ref)
    assert err <= 2 * base + atol, f"{name}: max|ours - ref| = {err:.3e} > 2 * {base:.3e} + {atol:.0e}"


@pytest.fixture(scope="module")
def hf():
    transformers = pytest.importorskip("transformers")
    from flashcute.integrations import transformers as fct

    name = fct.register()
    yield transformers, fct, name


def _llama_config(transformers, **kw):
    args = dict(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1, pad_token_id=0,
                bos_token_id=1, eos_token_id=2)
    args.update(kw)
    return transformers.LlamaConfig(**args)


def _models(transformers, config, specs, device="cpu"):
    """One random model, copied into each (attn_implementation, dtype) of specs (eval mode)."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    state = base.state_dict()
    models = []
    for impl, dtype in specs:
        m = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=impl, dtype=dtype)
        m.load_state_dict(state)
        models.append(m.to(device).eval())
    return models


class _Spy:
    """Counts the flashcute entry points the integration calls."""

    def __init__(self, monkeypatch, fct):
        self.calls = []
        api = fct._api
        for fn_name in ("attention", "attention_varlen"):
            original = getattr(api, fn_name)

            def wrapper(*args, _fn=original, _name=fn_name, **kwargs):
                self.calls.append(_name)
                return _fn(*args, **kwargs)

            monkeypatch.setattr(api, fn_name, wrapper)

    def used(self):
        return set(self.calls)


def _forward_backward(model, ids, **kwargs):
    """Logits, and the gradients of every parameter for a cross-entropy loss on the logits."""
    model.zero_grad(set_to_none=True)
    labels = kwargs.pop("labels", ids)
    out = model(ids, **kwargs)
    logits = out.logits
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=-100)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


def _compare_models(name, ours, sdpa, ref, ids, atol, keep=None, **kwargs):
    lo, go = _forward_backward(ours, ids, **copy.deepcopy(kwargs))
    lp, gp = _forward_backward(sdpa, ids, **copy.deepcopy(kwargs))
    lr, gr = _forward_backward(ref, ids, **copy.deepcopy(kwargs))
    if keep is not None:
        lo, lp, lr = lo[keep], lp[keep], lr[keep]
    _check(f"{name}: logits", lo, lr, lp, atol)
    assert go.keys() == gr.keys()
    for p in gr:
        _check(f"{name}: grad {p}", go[p], gr[p], gp[p], atol)


# ---- transformers on the CPU backend (float32) ---------------------------------------------
@pytest.fixture(scope="module")
def cpu_models(hf):
    transformers, fct, name = hf
    cfg = _llama_config(transformers)
    ours, sdpa, ref = _models(transformers, cfg, [(name, torch.float32), ("sdpa", torch.float32),
                                                  ("sdpa", torch.float64)])
    return ours, sdpa, ref


def test_register_and_names(hf):
    transformers, fct, name = hf
    assert name == "cute_attention" and "flash" not in name
    from transformers import AttentionInterface, AttentionMaskInterface
    assert AttentionInterface._global_mapping[name] is fct.attention_forward
    assert AttentionMaskInterface._global_mapping[name] is fct.attention_mask
    assert fct.register() == name  # idempotent
    for bad in ("flashcute", "my_FLASH_attn"):
        with pytest.raises(ValueError, match="contains 'flash'"):
            fct.register(bad)
    for bad in ("sdpa", "org/repo"):
        with pytest.raises(ValueError):
            fct.register(bad)
    fct.register("cute_tmp")
    assert "cute_tmp" in AttentionInterface._global_mapping
    fct.unregister("cute_tmp")
    assert "cute_tmp" not in AttentionInterface._global_mapping
    assert "cute_tmp" not in AttentionMaskInterface._global_mapping


def test_set_attn_implementation(hf, cpu_models):
    transformers, fct, name = hf
    cfg = _llama_config(transformers)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
    model.set_attn_implementation(name)
    assert model.config._attn_implementation == name


def test_dense_logits_and_grads(hf, cpu_models, monkeypatch):
    ours, sdpa, ref = cpu_models
    spy = _Spy(monkeypatch, hf[1])
    ids = torch.randint(3, 97, (2, 40))
    _compare_models("dense", ours, sdpa, ref, ids, atol=1e-5)
    assert spy.used() == {"attention"}


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_goes_to_varlen(hf, cpu_models, monkeypatch, side):
    ours, sdpa, ref = cpu_models
    spy = _Spy(monkeypatch, hf[1])
    ids = torch.randint(3, 97, (3, 32))
    mask = torch.ones_like(ids)
    lengths = [32, 19, 7]
    for b, n in enumerate(lengths):
        if side == "left":
            mask[b, :32 - n] = 0
        else:
            mask[b, n:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    labels = ids.masked_fill(mask == 0, -100)
    _compare_models(f"padded-{side}", ours, sdpa, ref, ids, atol=1e-5, keep=mask.bool(), attention_mask=mask,
                    labels=labels)
    assert spy.used() == {"attention_varlen"}


def _per_document(model, ids, lengths):
    with torch.no_grad():
        outs, start = [], 0
        for n in lengths:
            outs.append(model(ids[:, start:start + n]).logits)
            start += n
    return torch.cat(outs, 1)


@pytest.mark.parametrize("use_cache", [False, True])
def test_packed_position_ids_go_to_varlen(hf, cpu_models, monkeypatch, use_cache):
    """Packed documents (position_ids restart): no attention across documents, with or without
    a cache (transformers' sdpa path detects packing only without one)."""
    ours, sdpa, ref = cpu_models
    lengths = [11, 20, 1, 16]
    ids = torch.randint(3, 97, (1, sum(lengths)))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    spy = _Spy(monkeypatch, hf[1])
    with torch.no_grad():
        got = ours(ids, position_ids=pos, use_cache=use_cache).logits
    assert spy.used() == {"attention_varlen"}
    _check("packed logits", got, _per_document(ref, ids, lengths), _per_document(sdpa, ids, lengths), 1e-5)


def test_packing_analysis_runs_once_per_forward(hf, cpu_models, monkeypatch):
    """Packing and padding analysis syncs with the GPU: where transformers has already looked at
    the position ids and found no packing the attention does not look again, and the ids or the
    mask of one forward are analysed once for all (2) layers."""
    _, fct, _ = hf
    ours, _, _ = cpu_models
    computed = []
    memoized = fct._memoized

    def spy(kind, tensor, compute, extra=()):
        return memoized(kind, tensor, lambda: computed.append(kind) or compute(), extra)

    monkeypatch.setattr(fct, "_memoized", spy)
    ids = torch.randint(3, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    packed = torch.cat([torch.arange(5), torch.arange(7)])[None].expand(2, -1)
    with torch.no_grad():
        for kw, expected in [({}, []), ({"position_ids": packed}, ["ids"]), ({"attention_mask": mask}, ["padding"]),
                             ({"position_ids": packed, "use_cache": True}, ["position_ids"])]:
            computed.clear()
            ours(ids, **{"use_cache": False, **kw})
            assert computed == expected, kw


def test_packed_cu_seq_lens_kwargs(hf, cpu_models, monkeypatch):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True) batches, with gradients."""
    transformers, fct, name = hf
    ours, sdpa, ref = cpu_models
    lengths = [9, 23, 14]
    docs = [torch.randint(3, 97, (n,)).tolist() for n in lengths]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)([{"input_ids": d} for d in docs])
    spy = _Spy(monkeypatch, fct)
    ids = batch.pop("input_ids")
    logits, grads = _forward_backward(ours, ids, **batch)
    assert spy.used() == {"attention_varlen"}
    _check("cu_seq_lens logits", logits, _per_document(ref, ids, lengths), _per_document(sdpa, ids, lengths), 1e-5)
    # gradients: the same loss summed over the documents run one by one
    def per_doc_grads(model):
        model.zero_grad(set_to_none=True)
        total, start = 0, 0
        n_tokens = sum(n - 1 for n in lengths)
        for n in lengths:
            lg = model(ids[:, start:start + n]).logits
            total = total + F.cross_entropy(lg[0, :-1].float(), ids[0, start + 1:start + n], reduction="sum")
            start += n
        (total / n_tokens).backward()
        return {k: p.grad.detach().clone() for k, p in model.named_parameters() if p.grad is not None}

    g_ref, g_pt = per_doc_grads(ref), per_doc_grads(sdpa)
    for p in g_ref:
        _check(f"cu_seq_lens grad {p}", grads[p], g_ref[p], g_pt[p], 1e-5)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_greedy_generate_same_tokens(hf, cpu_models, monkeypatch, cache):
    ours, sdpa, _ = cpu_models
    ids = torch.randint(3, 97, (2, 12))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # left padding
    ids = ids.masked_fill(mask == 0, 0)
    kw = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    if cache == "static":
        kw["cache_implementation"] = "static"
    spy = _Spy(monkeypatch, hf[1])
    got = ours.generate(ids, **kw)
    assert spy.used() == {"attention_varlen"}
    want = sdpa.generate(ids, **kw)
    assert torch.equal(got, want), f"greedy tokens differ:\n{got}\n{want}"
    # no padding: dense prefill, then decoding steps of one query against the cache
    spy.calls.clear()
    got = ours.generate(ids[:1, :], max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert spy.used() == {"attention"}
    assert torch.equal(got, sdpa.generate(ids[:1, :], max_new_tokens=8, do_sample=False, pad_token_id=0))


def test_sliding_window(hf):
    """Mistral's sliding window (shorter than the sequence): window_size = (W - 1, 0)."""
    transformers, fct, name = hf
    cfg = transformers.MistralConfig(vocab_size=97, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                                     max_position_embeddings=256, pad_token_id=0)
    ours, sdpa, ref = _models(transformers, cfg, [(name, torch.float32), ("sdpa", torch.float32),
                                                  ("sdpa", torch.float64)])
    ids = torch.randint(3, 97, (2, 30))
    _compare_models("sliding window", ours, sdpa, ref, ids, atol=1e-5)
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    _compare_models("sliding window, padded", ours, sdpa, ref, ids, atol=1e-5, keep=mask.bool(),
                    attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))


def test_fallback_warns_and_matches(hf, cpu_models, monkeypatch):
    transformers, fct, name = hf
    ours, sdpa, ref = cpu_models
    monkeypatch.setattr(fct, "_warned", set())
    ids = torch.randint(3, 97, (2, 16))
    with pytest.warns(UserWarning, match="output_attentions"):
        with torch.no_grad():
            got = ours(ids, output_attentions=True)
    assert got.attentions is not None and got.attentions[0].shape == (2, 4, 16, 16)
    with torch.no_grad():
        want, r = sdpa(ids).logits, ref(ids).logits
    _check("fallback logits", got.logits, r, want, 1e-5)


def test_attention_dropout_runs_in_the_kernels(hf):
    """transformers passes the attention dropout rate in training: flashcute serves it (no fallback
    warning), drawing the mask as flashcute.attention does."""
    import types
    transformers, fct, name = hf
    q, k, v = (torch.randn(2, 4, 16, 32) for _ in range(3))
    module = types.SimpleNamespace(is_causal=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.manual_seed(5)
        out, _ = fct.attention_forward(module, q, k, v, None, dropout=0.25)
    torch.manual_seed(5)
    want = flashcute.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True, dropout_p=0.25)
    assert torch.equal(out, want)
    assert not torch.equal(out, flashcute.attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    causal=True))


def test_unknown_mask_pattern_gets_a_4d_mask(hf):
    """A mask function transformers composes from something flashcute does not know (an
    or_mask overlay) returns the full sdpa mask, which sends the call to the fallback."""
    transformers, fct, name = hf
    from transformers.masking_utils import causal_mask_function, or_masks

    def overlay(b, h, q, kv):
        return kv == 0

    mask = fct.attention_mask(batch_size=1, q_length=5, kv_length=5, mask_function=or_masks(causal_mask_function,
                                                                                              overlay),
                              attention_mask=None, device="cpu", dtype=torch.float32)
    assert mask is not None and mask.dim() == 4
    assert fct.attention_mask(batch_size=1, q_length=5, kv_length=5, mask_function=causal_mask_function,
                              attention_mask=None) is None


# ---- transformers on the GPU (bfloat16) ---------------------------------------------------
@pytest.fixture(scope="module")
def gpu_models(hf):
    """(cute_attention bf16, sdpa bf16, sdpa float32 = ref32 with TF32 off) on the GPU."""
    transformers, fct, name = hf
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = _llama_config(transformers)
    yield _models(transformers, cfg, [(name, torch.bfloat16), ("sdpa", torch.bfloat16), ("sdpa", torch.float32)],
                  device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = old


@gpu
def test_gpu_bf16_logits_and_grads(hf, gpu_models, monkeypatch):
    ours, sdpa, ref = gpu_models
    spy = _Spy(monkeypatch, hf[1])
    ids = torch.randint(3, 97, (2, 256), device="cuda")
    _compare_models("gpu dense", ours, sdpa, ref, ids, atol=1e-4)
    mask = torch.ones_like(ids)
    mask[1, :100] = 0
    _compare_models("gpu padded", ours, sdpa, ref, ids, atol=1e-4, keep=mask.bool(), attention_mask=mask,
                    labels=ids.masked_fill(mask == 0, -100))
    assert spy.used() == {"attention", "attention_varlen"}


def _check_greedy(ours, sdpa, ref, ids, mask, new_tokens):
    """Greedy generate() of ours and of sdpa (bf16): the same tokens. They may part only at a
    step where the exact (float32) logits of the two chosen tokens are closer than the two
    runs' own bf16 errors there: a tie that bf16 rounding decides, for either implementation."""
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0, output_scores=True,
              return_dict_in_generate=True)
    got, want = ours.generate(ids, **kw), sdpa.generate(ids, **kw)
    n = ids.shape[1]
    for b in range(ids.shape[0]):
        diff = (got.sequences[b, n:] != want.sequences[b, n:]).nonzero()
        if not len(diff):
            continue
        t = diff[0].item()
        prefix = want.sequences[b:b + 1, :n + t]
        prefix_mask = torch.cat([mask[b:b + 1], mask.new_ones(1, t)], 1)
        with torch.no_grad():
            exact = ref(prefix, attention_mask=prefix_mask).logits[0, -1].float()
        s_got, s_want = got.scores[t][b].float(), want.scores[t][b].float()
        noise = _maxabs(s_got - exact) + _maxabs(s_want - exact)
        tok_got, tok_want = got.sequences[b, n + t].item(), want.sequences[b, n + t].item()
        margin = abs(exact[tok_want] - exact[tok_got]).item()
        assert margin <= noise, (f"sequence {b} parts at new token {t} ({tok_got} vs sdpa's {tok_want}) although "
                                 f"their exact logits differ by {margin:.3g} > the bf16 noise {noise:.3g}")
    return got.sequences, want.sequences


@gpu
def test_gpu_bf16_greedy_generate(hf, gpu_models):
    ours, sdpa, ref = gpu_models
    ids = torch.randint(3, 97, (4, 64), device="cuda")
    mask = torch.ones_like(ids)
    mask[0, :20] = 0
    mask[2, :3] = 0
    _check_greedy(ours, sdpa, ref, ids.masked_fill(mask == 0, 0), mask, 32)


# ---- torch's flash-attention registry --------------------------------------------------------
@pytest.fixture
def registry():
    from torch.nn.attention import current_flash_attention_impl, restore_flash_attention_impl

    from flashcute.integrations import torch_registry

    assert current_flash_attention_impl() is None
    torch_registry.register()
    yield torch_registry
    if current_flash_attention_impl() is not None:
        restore_flash_attention_impl()


def _has_cpu_kernel(op):
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op}", "CPU")


def test_registry_register_activate_restore(registry):
    from torch.nn.attention import (activate_flash_attention_impl, current_flash_attention_impl,
                                    list_flash_attention_impls, restore_flash_attention_impl)

    assert "FLASHCUTE" in list_flash_attention_impls()
    assert current_flash_attention_impl() is None and not registry.is_active()
    assert not _has_cpu_kernel("_flash_attention_forward")  # torch has none: flashcute adds its CPU backend
    activate_flash_attention_impl("FLASHCUTE")
    assert current_flash_attention_impl() == "FLASHCUTE" and registry.is_active()
    assert _has_cpu_kernel("_flash_attention_forward") and _has_cpu_kernel("_scaled_dot_product_flash_attention")
    restore_flash_attention_impl()
    assert current_flash_attention_impl() is None
    assert not _has_cpu_kernel("_flash_attention_forward")
    registry.activate()
    registry.deactivate()
    assert current_flash_attention_impl() is None and not _has_cpu_kernel("_flash_attention_forward")


@pytest.mark.parametrize("causal,s_q,s_k", [(False, 33, 47), (True, 40, 40), (True, 24, 50), (True, 50, 24)])
def test_registry_sdpa_flash_op_on_cpu(registry, causal, s_q, s_k):
    """aten._scaled_dot_product_flash_attention (SDPA semantics: top-left causal) with autograd."""
    registry.activate()
    q = torch.randn(2, 4, s_q, 32, requires_grad=True)
    k, v = (torch.randn(2, 4, s_k, 32, requires_grad=True) for _ in range(2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], acc_events=True) as prof:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=causal)[:2]
    assert "flashcute::attention" in {e.name for e in prof.events()}
    want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    assert lse.shape == (2, 4, s_q) and out.stride() == torch.empty_like(q).stride()
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    ref = torch.autograd.grad(want, (q, k, v), dout)
    for name, a, b in zip("qkv", got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_registry_varlen_attn_on_cpu(registry):
    from torch.nn.attention.varlen import varlen_attn

    registry.activate()
    lengths = [5, 17, 1, 9]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    total = cu[-1].item()
    q, k, v = (torch.randn(total, 4, 32, requires_grad=True) for _ in range(3))
    out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), window_size=(-1, 0))
    want = torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                                                     is_causal=True).transpose(0, 1)
                      for a, b in zip(cu[:-1].tolist(), cu[1:].tolist())])
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    dout = torch.randn_like(out)
    for name, a, b in zip("qkv", torch.autograd.grad(out, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=lambda m: f"d{name}: {m}")


def test_registry_refuses_what_it_cannot_serve(registry):
    registry.activate()
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="return_debug_mask"):
        torch.ops.aten._scaled_dot_product_flash_attention(q, q, q, return_debug_mask=True)


@pytest.mark.parametrize("causal", [False, True])
def test_registry_dropout_on_cpu(registry, causal):
    """SDPA with dropout through the override: flashcute's mask for the (seed, offset) that the op
    returns as its rng_state, the same in the backward; F.scaled_dot_product_attention trains."""
    registry.activate()
    q, k, v = (torch.randn(2, 4, 40, 32, requires_grad=True) for _ in range(3))
    res = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p=0.2, is_causal=causal)
    out, lse, state = res[0], res[1], res[6].view(torch.int64)
    want, want_lse = flashcute.attention(*(t.transpose(1, 2) for t in (q, k, v)), causal=causal, dropout_p=0.2,
                                         rng_state=state, return_lse=True)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)
    dout = torch.randn_like(out)
    got = torch.ops.aten._scaled_dot_product_flash_attention_backward(dout, q, k, v, out, lse, None, None, 40, 40, 0.2,
                                                                      causal, res[6], res[7])
    ref = torch.autograd.grad(want.transpose(1, 2), (q, k, v), dout)
    for name, a, b in zip("qkv", got, ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=lambda m: f"d{name}: {m}")
    y = F.scaled_dot_product_attention(q, k, v, dropout_p=0.2, is_causal=causal)
    assert all(torch.isfinite(g).all() for g in torch.autograd.grad(y.sum(), (q, k, v)))


def _order():
    return torch._C._get_sdp_priority_order()


def _backends():
    from torch.nn.attention import SDPBackend

    return tuple(int(getattr(SDPBackend, n)) for n in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION",
                                                        "MATH", "OVERRIDEABLE"))


@pytest.fixture
def sdpa_order():
    """Puts SDPA's backend priority order back after the test."""
    original = _order()
    yield
    torch._C._set_sdp_priority_order(original)


def test_registry_sdpa_priority(registry, sdpa_order, monkeypatch):
    """Activation puts FLASH_ATTENTION first in SDPA's priority order (the rest keep their order);
    restoration puts the previous order back, unless another was set in between."""
    from torch.nn.attention import restore_flash_attention_impl

    monkeypatch.setattr(registry, "_settle_torch_default", lambda: None)  # torch's default: the next test
    flash, cudnn, eff, math, over = _backends()
    hopper = [cudnn, flash, eff, math, over]  # torch 2.11's order on sm90 with cuDNN > 9.15
    torch._C._set_sdp_priority_order(hopper)
    registry.activate()
    assert _order() == [flash, cudnn, eff, math, over]
    registry.activate()  # again: torch restores the previous activation first
    assert _order() == [flash, cudnn, eff, math, over]
    restore_flash_attention_impl()
    assert _order() == hopper
    registry.activate()
    mine = [math, eff, flash, cudnn, over]
    torch._C._set_sdp_priority_order(mine)
    registry.deactivate()
    assert _order() == mine, "restoration replaced an order set after activation"


def test_registry_priority_survives_torchs_one_time_default(registry, sdpa_order, monkeypatch):
    """torch applies its default order (cuDNN first on Hopper) once, at the first backend choice
    of the process, over any order set before. Activated before CUDA is initialised, flashcute
    re-applies FLASH_ATTENTION first from torch.cuda's lazy initialisation, and restoration
    brings back torch's default."""
    from torch.nn.attention import restore_flash_attention_impl

    flash, cudnn, eff, math, over = _backends()
    hopper = [cudnn, flash, eff, math, over]

    def torch_default():  # what sdp::priority_order() does at its first call on an H100
        torch._C._set_sdp_priority_order(hopper)

    monkeypatch.setattr(registry, "_settle_torch_default", torch_default)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "_lazy_call", lambda fn, **kw: None)
    monkeypatch.setattr(registry, "_cuda_hook_queued", False)
    torch._C._set_sdp_priority_order([flash, eff, math, cudnn, over])  # Context's initial order
    registry.activate()
    assert registry._cuda_hook_queued == torch.cuda._is_compiled()
    assert _order()[0] == flash
    registry._on_cuda_init()  # as torch.cuda._lazy_init runs it
    assert _order() == [flash, cudnn, eff, math, over]
    restore_flash_attention_impl()
    assert _order() == hopper
    registry._on_cuda_init()  # after restoration: leaves torch's order alone
    assert _order() == hopper


def _profile_sdpa(q, k, v):
    """Forward and backward of a plain F.scaled_dot_product_attention call under the profiler:
    (names of CPU-side events, names of CUDA kernels)."""
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, acc_events=True) as prof:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
    events = prof.events()
    cpu = {e.name for e in events if e.device_type == torch.autograd.DeviceType.CPU}
    kernels = [e.name for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    return out, cpu, kernels


def _has_kernel(kernels, name):
    """flashcute's kernels are namespaced: flashcute::sm90::flashcute_fwd_kernel<...>, ..."""
    return any(re.search(rf"\bflashcute::(?:\w+::)*{name}\b", n) for n in kernels)


def _flashcute_kernels(kernels):
    return sorted({re.sub(r"<.*", "", n) for n in kernels if "flashcute" in n})


@gpu
def test_registry_plain_sdpa_runs_flashcute_kernels(registry):
    """A plain F.scaled_dot_product_attention call under the registration: SDPA picks its flash
    backend (also on Hopper, where torch's default order puts cuDNN first), flashcute's forward
    and backward kernels are in the profiler trace, results are flashcute.attention's."""
    from torch.nn.attention import SDPBackend

    registry.activate()
    q, k, v = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    assert _order()[0] == int(SDPBackend.FLASH_ATTENTION), _order()
    choice = torch._fused_sdp_choice(q, k, v, is_causal=True)  # SDPA's own backend choice
    assert choice == int(SDPBackend.FLASH_ATTENTION), f"SDPA would run {SDPBackend(choice).name}"
    out, cpu, kernels = _profile_sdpa(q, k, v)
    assert {"aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_flash_attention_backward",
            "flashcute::fwd", "flashcute::bwd"} <= cpu, sorted(n for n in cpu if "attention" in n or "flashcute" in n)
    assert not any("cudnn_attention" in n or "efficient_attention" in n for n in cpu)
    found = _flashcute_kernels(kernels)
    assert _has_kernel(kernels, "flashcute_fwd_kernel"), f"no flashcute forward kernel; flashcute kernels: {found}"
    assert _has_kernel(kernels, "flashcute_bwd_kernel"), f"no flashcute backward kernel; flashcute kernels: {found}"
    assert not any("pytorch_flash" in n or "cudnn" in n.lower() for n in kernels), "torch's own kernels ran"
    want = flashcute.attention(*(t.detach().transpose(1, 2) for t in (q, k, v)), causal=True).transpose(1, 2)
    torch.testing.assert_close(out.detach(), want, atol=0, rtol=0)


_FRESH_PROCESS = """
import json, sys
import torch, torch.nn.functional as F
import flashcute
from flashcute.integrations import torch_registry
activate = sys.argv[1] == "1"
assert not torch.cuda.is_initialized()
if activate:
    torch_registry.activate()  # before CUDA is initialised
torch.cuda.init()
context = torch._C._cuda_hasPrimaryContext(torch.cuda.current_device())
q = torch.randn(1, 4, 256, 128, device="cuda", dtype=torch.bfloat16)
choice = torch._fused_sdp_choice(q, q, q, is_causal=True)
order = torch._C._get_sdp_priority_order()
same = torch.equal(F.scaled_dot_product_attention(q, q, q, is_causal=True),
                   flashcute.attention(*(q.transpose(1, 2),) * 3, causal=True).transpose(1, 2))
if activate:
    torch_registry.deactivate()
print(json.dumps(dict(context=context, choice=choice, order=order, restored=torch._C._get_sdp_priority_order(),
                      same=same)))
"""


@gpu
def test_registry_activated_before_cuda_init():
    """A fresh process activating before CUDA is initialised: torch's one-time default order
    (set at the first backend choice) does not undo the activation, the first plain SDPA call
    runs flashcute, and restoration gives torch's own order. (Activation before CUDA starts makes the
    CUDA context at torch.cuda.init() rather than at the first kernel: the priority probe needs it.)"""
    from torch.nn.attention import SDPBackend

    runs = {}
    for activate in ("0", "1"):
        proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS, activate], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr
        runs[activate] = json.loads(proc.stdout.strip().splitlines()[-1])
    plain, active = runs["0"], runs["1"]
    assert active["choice"] == int(SDPBackend.FLASH_ATTENTION) and active["order"][0] == active["choice"], active
    assert active["same"], "SDPA under the registration differs from flashcute.attention"
    assert active["restored"] == plain["order"], (active, plain)


@gpu
def test_registry_varlen_attn_gpu(registry):
    from torch.nn.attention.varlen import varlen_attn

    registry.activate()
    lengths = [100, 1, 513, 64]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lengths), 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out = varlen_attn(q, k, v, cu, cu, max(lengths), max(lengths), window_size=(-1, 0))
    want = flashcute.attention_varlen(q, k, v, cu, cu, max(lengths), max(lengths), causal=True, window_size=(-1, 0))
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@gpu
def test_registry_serves_transformers_sdpa(hf, registry):
    """transformers' own "sdpa" implementation on flashcute's kernels (SDPA's flash backend, by
    the priority order activation sets: no sdpa_kernel)."""
    transformers = hf[0]
    cfg = _llama_config(transformers, num_key_value_heads=4)  # MHA, no padding: no attn_mask
    sdpa, ref = _models(transformers, cfg, [("sdpa", torch.bfloat16), ("sdpa", torch.float32)], device="cuda")
    ids = torch.randint(3, 97, (2, 128), device="cuda")
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            plain, r = sdpa(ids).logits, ref(ids).logits
            registry.activate()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
                routed = sdpa(ids).logits
                torch.cuda.synchronize()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert _has_kernel(kernels, "flashcute_fwd_kernel"), \
        f"no flashcute forward kernel; flashcute kernels: {_flashcute_kernels(kernels)}"
    assert not any("pytorch_flash" in n or "cudnn" in n.lower() for n in kernels), "torch's own kernels ran"
    _check("sdpa via registry", routed, r, plain, 1e-4)


# ---- build record, import guard, flashcute.info -----------------------------------------------
def _run(code, env_extra, **kw):
    env = dict(os.environ, **env_extra)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          timeout=120, **kw)


def _library_dir(tmp_path, info):
    lib = flashcute._ops._library_path().resolve()
    (tmp_path / lib.name).symlink_to(lib)
    if info is not None:
        (tmp_path / "flashcute_build_info.json").write_text(json.dumps(info))
    return str(tmp_path / lib.name)


def _pythonpath():
    return os.path.dirname(os.path.dirname(os.path.abspath(flashcute.__file__)))


def test_import_guard_refuses_another_torch(tmp_path):
    """End to end: import flashcute with a library recorded as built for another torch."""
    info = {"torch_version": "2.99.0+cu999", "torch_cuda_version": "99.9", "with_cuda": True}
    proc = _run("import flashcute", {"FLASHCUTE_LIBRARY": _library_dir(tmp_path, info), "PYTHONPATH": _pythonpath()})
    assert proc.returncode != 0
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("ImportError:"), proc.stderr
    for needle in ("2.99.0+cu999", "CUDA 99.9", torch.__version__, "pip install --no-build-isolation .",
                   "scripts/install.sh"):
        assert needle in err, f"{needle!r} missing from: {err}"


@pytest.mark.parametrize("record", ["matching", "missing", "malformed", "other-torch-skipped", "other-cuda"])
def test_import_guard_check(tmp_path, monkeypatch, record):
    """The check itself (python/flashcute/_ops.py, before torch.ops.load_library)."""
    info = {"torch_version": torch.__version__, "torch_cuda_version": torch.version.cuda}
    if record == "other-torch-skipped":
        info["torch_version"] = "2.99.0"
        monkeypatch.setenv("FLASHCUTE_SKIP_VERSION_CHECK", "1")
    if record == "other-cuda":
        info["torch_cuda_version"] = "11.8" if torch.version.cuda != "11.8" else "12.8"
    lib = tmp_path / "libflashcute_ops.so"
    if record != "missing":
        (tmp_path / "flashcute_build_info.json").write_text("{not json" if record == "malformed" else json.dumps(info))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an older build (no record) loads without a warning
        if record == "other-cuda":
            with pytest.raises(ImportError, match="11.8|12.8"):
                flashcute._ops._check_build_info(lib)
        else:
            got = flashcute._ops._check_build_info(lib)
            assert got == (info if record in ("matching", "other-torch-skipped") else None)


def test_info_prints_the_build(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "flashcute.info"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for needle in ("flashcute", "torch:", torch.__version__, "library families", "CPU backend"):
        assert needle in text, f"{needle!r} missing from:\n{text}"
    from flashcute import info as info_module

    info = json.loads(json.dumps(info_module.collect()))
    assert info["runtime"]["torch"] == torch.__version__
    built = info["build"]
    if built is not None:  # a build with cmake/build_info.cmake
        assert built["torch_version"] == torch.__version__
        assert {"kernel_families", "cuda_archs", "headdims", "dtypes", "torch_cuda_version"} <= built.keys()
        assert [f"sm{f}" for f in torch.ops.flashcute.kernel_families()] == info["kernel_families_built"]
        if built["with_cuda"]:
            assert set(built["kernel_families"]) == set(info["kernel_families_built"])
    if HAS_CUDA:
        assert info["gpus"]
