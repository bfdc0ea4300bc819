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

STAGES = ["flashcute::fwd", "flashcute::bwd_preprocess", "flashcute::bwd", "flashcute::bwd_convert_dq"]
KERNELS = ["flashcute_fwd_kernel", "flashcute_bwd_preprocess_kernel", "flashcute_bwd_kernel",
           "flashcute_bwd_convert_dq_kernel"]


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
        out = flashcute.attention(q, k, v, causal=True)
        out.backward(torch.randn_like(out))
        torch.cuda.synchronize()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    names = {e["name"] for e in json.loads(trace.read_text())["traceEvents"] if "name" in e}
    for stage in STAGES:
        assert stage in names, f"stage range {stage} missing from the trace"
    for kernel in KERNELS:
        assert any(kernel + "<" in n or n.startswith(kernel) or f" {kernel}<" in n for n in names), \
            f"kernel {kernel} missing from the trace"


def test_stage_names_in_cpu_profile():
    q, k, v = (torch.randn(1, 40, 2, 32, requires_grad=True) for _ in range(3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        flashcute.attention(q, k, v).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"flashcute::attention", "flashcute::fwd", "flashcute::bwd"} <= names
