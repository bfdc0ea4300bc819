"""The benchmark and profiling tools: `python -m flashcute.bench`, `python -m flashcute.profile`,
and the stage names that Nsight and the torch profiler show."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

import flashcute
from conftest import HAS_CUDA, gpu

STAGES = ["flashcute::block_mask_transpose", "flashcute::fwd", "flashcute::bwd_preprocess", "flashcute::bwd",
          "flashcute::bwd_convert_dq"]
KERNELS = ["flashcute_block_mask_scatter_kernel", "flashcute_block_mask_compact_kernel", "flashcute_fwd_kernel",
           "flashcute_bwd_preprocess_kernel", "flashcute_bwd_kernel", "flashcute_bwd_convert_dq_kernel"]


@pytest.mark.skipif(HAS_CUDA, reason="the CPU comparison runs only without a GPU")
def test_bench_cpu_comparison(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "flashcute.bench", "--seqlens", "64", "--headdims", "32", "--modes", "fwd", "fwdbwd",
         "--causal", "false", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "GPU peers skipped" in proc.stdout
    data = json.loads((tmp_path / "bench.json").read_text())
    impls = {r["impl"] for r in data["rows"]}
    assert impls == {"flashcute", "sdpa_cpu"}
    assert all(r["ms"] > 0 for r in data["rows"])
    for name in ("bench.csv", "bench.md", "bench.txt"):
        assert (tmp_path / name).stat().st_size > 0
    assert "fwdbwd" in (tmp_path / "bench.md").read_text()


def test_bench_block_sparse_cpu(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "flashcute.bench", "--block-sparse", "--cpu", "--seqlens", "256", "--headdims", "32",
         "--modes", "fwd", "fwdbwd", "--densities", "0.5", "--window", "128", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "FlexAttention skipped" in proc.stdout
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {"flashcute"}
    cases = {(r["mode"], r["causal"], r["pattern"], r["density"]) for r in rows}
    assert cases == {(m, c, p, d) for m in ("fwd", "fwdbwd") for c in (False, True)
                     for p, d in [("dense", 1.0), ("random", 0.5)] + [("sliding", 1.0)] * c}
    for r in rows:
        assert r["ms"] > 0 and r["tflops"] > 0
        assert r["bound_ms"] > 0 and isinstance(r["meets_bound"], bool)
    half = [r for r in rows if r["pattern"] == "random" and not r["causal"]]
    assert all(r["flop_fraction"] == 0.5 for r in half)
    header = (tmp_path / "bench.csv").read_text().splitlines()[0].split(",")
    assert {"pattern", "density", "flop_fraction", "bound_ms", "meets_bound", "peer_over_flashcute"} <= set(header)
    assert "| pattern | density |" in (tmp_path / "bench.md").read_text()
    assert "within the bound" in (tmp_path / "bench.txt").read_text()


def test_flop_fraction_counts_kept_scores():
    from flashcute import masks
    from flashcute.bench import flop_fraction

    for sq, sk in [(512, 512), (300, 450), (450, 300)]:
        for mask in (masks.random_blocks(sq, sk, density=0.5, heads=2, seed=1),
                     masks.sliding_window(sq, sk, window=100)):
            for causal in (False, True):
                scores = torch.ones(sq, sk, dtype=torch.bool)
                if causal:
                    scores = scores.tril(sk - sq)
                kept = (mask.to_dense(sq, sk) & scores).sum((-2, -1)).double().mean() / scores.sum()
                assert flop_fraction(mask, sq, sk, causal) == pytest.approx(kept.item(), abs=1e-12)


def test_profile_stage_of_kernel_names():
    from flashcute.profile import stage_of

    assert stage_of("void flashcute_block_mask_scatter_kernel<int>(int const*, int*)")[0] == "block_mask_transpose"
    assert stage_of("flashcute_block_mask_compact_kernel(BlockMaskParams)")[0] == "block_mask_transpose"
    stages = ["block_mask_transpose", "block_mask_transpose", "fwd", "bwd_preprocess", "bwd", "bwd_convert_dq"]
    for kernel, stage in zip(KERNELS, stages):
        assert stage_of(f"void {kernel}<KernelTraits<128, 128, 64, 4, bf16>, AttentionMask<true, false>>(Params)")[0] \
            == stage
    assert stage_of("some_other_kernel")[1] == 0.0


@pytest.mark.skipif(HAS_CUDA, reason="checks the message for machines without a GPU")
def test_profile_says_it_needs_a_gpu():
    proc = subprocess.run([sys.executable, "-m", "flashcute.profile"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stderr


@gpu
def test_stage_and_kernel_names_in_torch_trace(tmp_path):
    q, k, v = (torch.randn(1, 300, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        mask = flashcute.masks.random_blocks(300, density=0.5, device="cuda")  # runs the transpose stage
        out = flashcute.attention(q, k, v, causal=True, block_mask=mask)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if "name" in e}
    for stage in STAGES:
        assert stage in names, f"stage range {stage} missing from the trace"
    for kernel in KERNELS:
        assert any(kernel + "<" in n or kernel + "(" in n or n.startswith(kernel) for n in names), \
            f"kernel {kernel} missing from the trace"


def test_stage_names_in_cpu_profile():
    q, k, v = (torch.randn(1, 40, 2, 32, requires_grad=True) for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flashcute.attention(q, k, v).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"flashcute::attention", "flashcute::fwd", "flashcute::bwd"} <= names
