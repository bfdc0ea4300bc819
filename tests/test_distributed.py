"""Context parallelism: ``flashcute.distributed.ring_attention`` over 2 processes.

- CPU (CI): 2 processes over gloo, float32, flashcute's CPU backend: out, lse, dq, dk, dv of the
  whole sequence (unsharded) under the SPEC criterion against the float64 reference, for
  causal (zigzag and contiguous layouts) and non-causal attention, GQA, softcap, and a
  gradient through lse; the zigzag layout helpers; the argument checks.
- GPU (marker ``gpu``, needs 2 GPUs: the nvidia-h200-x2 machine): the same over NCCL in
  bfloat16 (criterion against float32 math), and torch's own ``context_parallel`` under
  ``activate_flash_attention_impl("FLASHCUTE")``, which must run flashcute's kernels on every
  ring step and match a single-GPU flashcute.attention.

The processes are started with torch.multiprocessing (spawn) and rendezvous through a file.
"""
from __future__ import annotations

import os
import re
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import flashcute
import flashcute.distributed as fcd
from conftest import check_lse, check_precision, gpu, reference_grads

WORLD = 2

# (name, batch, seqlen, nheads, nheads_kv, headdim, causal, load_balance, softcap, with_dlse)
CPU_CASES = [
    ("causal-zigzag-gqa", 1, 64, 4, 2, 32, True, True, 0.0, False),
    ("causal-zigzag-lse", 2, 48, 2, 2, 16, True, True, 0.0, True),
    ("causal-contiguous", 1, 40, 2, 1, 32, True, False, 0.0, False),
    ("full-softcap", 2, 36, 4, 4, 16, False, False, 5.0, False),
    ("full-zigzag-layout", 1, 32, 2, 2, 32, False, True, 0.0, True),
]
GPU_CASES = [
    ("causal-zigzag", 2, 4096, 8, 8, 128, True, True, 0.0, False),
    ("causal-zigzag-gqa-lse", 1, 2048, 8, 2, 64, True, True, 0.0, True),
    ("full", 1, 3072, 4, 4, 128, False, False, 0.0, False),
]


def _spawn(worker, *args):
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.spawn(_entry, args=(worker, init) + args, nprocs=WORLD, join=True)


def _entry(rank, worker, init, *args):
    backend = "nccl" if args and args[0] == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=WORLD)
    try:
        worker(rank, *args)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        dist.destroy_process_group()


def _ring_cases(rank, device, dtype, cases):
    """Every rank builds the same full inputs, runs its shard, and checks the unsharded results."""
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
    for name, b, s, h, h_kv, d, causal, lb, softcap, with_dlse in cases:
        gen = torch.Generator().manual_seed(1234 + s)
        q, k, v, dout = (torch.randn(b, s, n, d, generator=gen).to(device=device, dtype=dtype)
                         for n in (h, h_kv, h_kv, h))
        dlse = torch.randn(b, h, s, generator=gen).to(device) if with_dlse else None
        parts = [fcd.shard(t, dim=1, load_balance=lb).requires_grad_(True) for t in (q, k, v)]
        out, lse = fcd.ring_attention(*parts, causal=causal, softcap=softcap, load_balance=lb, return_lse=True)
        local_dout = fcd.shard(dout, dim=1, load_balance=lb)
        grads = [local_dout] + ([fcd.shard(dlse, dim=2, load_balance=lb)] if with_dlse else [])
        torch.autograd.backward([out, lse][:len(grads)], grads)
        got = dict(out=fcd.unshard(out, dim=1, load_balance=lb), lse=fcd.unshard(lse, dim=2, load_balance=lb),
                   dq=fcd.unshard(parts[0].grad, load_balance=lb), dk=fcd.unshard(parts[1].grad, load_balance=lb),
                   dv=fcd.unshard(parts[2].grad, load_balance=lb))
        refs = _reference(q, k, v, dout, dlse, causal=causal, softcap=softcap)
        for i, key in enumerate(("out", "lse", "dq", "dk", "dv")):
            if key == "lse":
                check_lse(got["lse"], refs["ref"][1], name=f"{name}: lse (rank {rank})")
            else:
                check_precision(f"{name}: {key} (rank {rank})", got[key], refs["ref"][i], refs["pt"][i])


def _reference(q, k, v, dout, dlse, *, causal, softcap):
    if softcap == 0.0:
        return reference_grads(q, k, v, dout, dlse, causal=causal)
    # conftest's helper has no softcap: the same computation through reference.attention's softcap
    from conftest import ref_dtype

    def run(dtype, upcast):
        qq, kk, vv = (t.detach().to(dtype).requires_grad_(True) for t in (q, k, v))
        o, l = flashcute.reference.attention(qq, kk, vv, causal=causal, softcap=softcap, return_lse=True,
                                             upcast=upcast)
        outs, gs = [o], [dout.to(o.dtype)]
        if dlse is not None:
            outs.append(l)
            gs.append(dlse.to(l.dtype))
        return (o.detach(), l.detach().float(), *torch.autograd.grad(outs, (qq, kk, vv), gs))

    return {"ref": run(ref_dtype(q.dtype), ref_dtype(q.dtype) == torch.float32 and q.dtype != torch.float32),
            "pt": run(q.dtype, False)}


def _layout_worker(rank):
    x = torch.arange(2 * 8 * 3, dtype=torch.float32).view(2, 8, 3)
    for lb in (True, False):
        part = fcd.shard(x, dim=1, load_balance=lb)
        assert part.shape == (2, 4, 3)
        assert torch.equal(fcd.unshard(part, dim=1, load_balance=lb), x)
    # zigzag: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2 (of 4 chunks of 2)
    chunks = {0: (0, 3), 1: (1, 2)}[rank]
    expect = torch.cat([x[:, 2 * c:2 * c + 2] for c in chunks], 1)
    assert torch.equal(fcd.shard(x, dim=1), expect)
    q = torch.randn(1, 5, 2, 16)
    with pytest.raises(ValueError, match="must be even"):
        fcd.ring_attention(q, q, q, causal=True)
    with pytest.raises(ValueError, match="divisible by 4"):
        fcd.shard(torch.randn(1, 6, 2, 16))
    with pytest.raises(ValueError, match="same part of the sequence"):
        fcd.ring_attention(q, q[:, :4], q[:, :4])


def _cpu_worker(rank):
    _ring_cases(rank, "cpu", torch.float32, CPU_CASES)
    _layout_worker(rank)


def test_ring_attention_two_processes_gloo():
    _spawn(_cpu_worker)


def test_ring_attention_needs_an_initialized_group():
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(RuntimeError, match="not initialized"):
        fcd.ring_attention(q, q, q)


# ---- 2 GPUs ---------------------------------------------------------------------------------
_two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")


def _cuda_worker(rank, device):
    _ring_cases(rank, device, torch.bfloat16, GPU_CASES)


@gpu
@_two_gpus
def test_ring_attention_two_gpus_nccl():
    _spawn(_cuda_worker, "cuda")


def _torch_cp_worker(rank, device):
    """torch's context_parallel (its own ring, load-balanced) over flashcute's aten overrides."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import context_parallel_unshard
    from torch.nn.attention import SDPBackend, restore_flash_attention_impl

    from flashcute.integrations import torch_registry

    mesh = init_device_mesh("cuda", (WORLD,))
    b, h, s, d = 2, 8, 4096, 128
    gen = torch.Generator().manual_seed(7)
    q, k, v, dout = (torch.randn(b, h, s, d, generator=gen).to(device="cuda", dtype=torch.bfloat16) for _ in range(4))
    # the single-GPU flashcute result (BSHD)
    qs, ks, vs = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
    ref = flashcute.attention(qs, ks, vs, causal=True)
    ref.backward(dout.transpose(1, 2))
    ref_out, ref_grads = ref.transpose(1, 2), [t.grad.transpose(1, 2) for t in (qs, ks, vs)]

    torch_registry.activate()  # also puts SDPA's flash backend first (Hopper's default is cuDNN): no sdpa_kernel
    try:
        assert torch._fused_sdp_choice(q, k, v, is_causal=True) == int(SDPBackend.FLASH_ATTENTION)
        cp_q, cp_k, cp_v, cp_dout = (t.clone() for t in (q, k, v, dout))
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
            with context_parallel(mesh, buffers=[cp_q, cp_k, cp_v, cp_dout], buffer_seq_dims=[2, 2, 2, 2]):
                for t in (cp_q, cp_k, cp_v):
                    t.requires_grad_(True)
                cp_out = F.scaled_dot_product_attention(cp_q, cp_k, cp_v, is_causal=True)
                cp_out.backward(cp_dout)
                grads = [t.grad for t in (cp_q, cp_k, cp_v)]
                for t in (cp_q, cp_k, cp_v):
                    t.requires_grad_(False)
            torch.cuda.synchronize()
        out, dq, dk, dv = context_parallel_unshard(mesh, [cp_out, *grads], [2, 2, 2, 2])
    finally:
        restore_flash_attention_impl()
    kernels = {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}
    found = sorted({re.sub(r"<.*", "", n) for n in kernels if "flashcute" in n})
    for name in ("flashcute_fwd_kernel", "flashcute_bwd_kernel"):
        assert any(re.search(rf"\bflashcute::(?:\w+::)*{name}\b", n) for n in kernels), \
            f"no {name} in the trace; flashcute kernels: {found}"
    assert not any("pytorch_flash" in n or "cudnn" in n.lower() for n in kernels), "torch's own kernels ran"
    # torch's own test tolerances for CP (test/distributed/tensor/test_attention.py), bf16
    torch.testing.assert_close(out, ref_out, atol=1e-3 * WORLD * 8, rtol=1e-2)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        torch.testing.assert_close(got, want, atol=8e-3 * WORLD * 4, rtol=1e-2, msg=lambda m: f"{name}: {m}")


@gpu
@_two_gpus
def test_torch_context_parallel_runs_flashcute_kernels():
    _spawn(_torch_cp_worker, "cuda")
