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


def test_bench_kernels_option(tmp_path):
    """--kernels sets the process-wide family of the "flashcute" rows (gpu_check's compare: the sm80
    family beside the same peers as the pre-restructure build's bench); a family that cannot run
    here is a usage error naming the option."""
    argv = [sys.executable, "-m", "flashcute.bench", "--kernels", "sm80", "--families", "none", "--seqlens", "128",
            "--headdims", "64", "--modes", "fwd", "--causal", "true", "--no-peers", "--out", str(tmp_path)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if "sm80" not in flashcute.kernels.runnable():
        assert proc.returncode == 2 and "--kernels sm80" in proc.stderr, proc.stderr
        return
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert {r["impl"] for r in rows} == {"flashcute"}


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


def test_profile_table_reads_either_tensor_pipe_and_local_memory():
    """The table's tensor% is the mma.sync (hmma) or the wgmma (gmma) pipe, whichever ran, and
    it shows the local-memory (spill) requests; a metric ncu did not give prints as nan."""
    import argparse

    from flashcute.profile import format_rows

    args = argparse.Namespace(batch=1, seqlen=1024, nheads=1, headdim=64, causal=False, block_sparse=None)
    rows = [{"Kernel Name": "void flashcute::sm90::flashcute_fwd_kernel<X>(Params)", "gpu__time_duration.sum": "1000",
             "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "0",
             "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "71.5",
             "l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum": "12", "l1tex__t_requests_pipe_lsu_mem_local_op_st.sum": "3",
             "_units": {}},
            {"Kernel Name": "void flashcute::sm80::flashcute_bwd_kernel<X>(Params)", "gpu__time_duration.sum": "2000",
             "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "40.0", "_units": {}}]
    fwd, bwd = format_rows(rows, args).splitlines()[2:]
    assert fwd.split()[:1] == ["fwd"] and "71.5" in fwd.split() and fwd.rstrip().endswith("12/3")
    assert "40.0" in bwd.split() and bwd.rstrip().endswith("nan/nan")


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


# Issue 14's sweeps (--window, --varlen, --score-mods), in process at tiny sizes on the CPU backend.

def _bench(tmp_path, *argv):
    from flashcute.bench import main

    assert main([*argv, "--cpu", "--headdims", "32", "--hidden", "64", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    return rows, (tmp_path / "bench.txt").read_text(), (tmp_path / "bench.md").read_text()


def test_bench_window_cpu(tmp_path, capsys):
    from flashcute.bench import window_fraction

    rows, txt, md = _bench(tmp_path, "--window", "32", "64", "--seqlens", "128", "--tokens", "256",
                           "--causal", "true", "false")
    assert "FlexAttention skipped" in capsys.readouterr().out
    assert {r["impl"] for r in rows} == {"dense", "flashcute"}
    cases = {(r["impl"], r["mode"], r["causal"], r["window"], r["window_size"]) for r in rows}
    assert cases == {(i, m, c, w, s) for m in ("fwd", "fwdbwd") for c in (True, False)
                     for i, w, s in [("dense", None, "(-1, -1)"),
                                     ("flashcute", 32, "(31, 0)" if c else "(16, 16)"),
                                     ("flashcute", 64, "(63, 0)" if c else "(32, 32)")]}
    dense = {(r["mode"], r["causal"]): r["ms"] for r in rows if r["impl"] == "dense"}
    for r in rows:
        assert r["ms"] > 0 and r["tflops"] > 0 and (r["batch"], r["nheads"]) == (2, 2)
        if r["impl"] == "flashcute":
            size = (r["window"] - 1, 0) if r["causal"] else (r["window"] // 2,) * 2
            assert r["kept_fraction"] == window_fraction(128, 128, size, r["causal"])
            assert r["dense_ms"] == dense[r["mode"], r["causal"]]
            assert r["bound_ms"] == pytest.approx(1.15 * r["kept_fraction"] * r["dense_ms"] + 0.020)
            assert r["meets_bound"] == (r["ms"] <= r["bound_ms"])
    header = (tmp_path / "bench.csv").read_text().splitlines()[0].split(",")
    assert {"window", "window_size", "kept_fraction", "dense_ms", "bound_ms", "meets_bound", "flex_ms",
            "flex_over_flashcute"} <= set(header)
    assert "| window | window_size | kept fraction |" in md
    assert txt.rstrip().splitlines()[-1].startswith("window rows within the bound: ")
    assert "/8" in txt.rstrip().splitlines()[-1]


def test_window_fraction_and_mask_mod_count_kept_scores():
    from flashcute.bench import window_fraction, window_mask_mod, window_size_of

    for sq, sk in [(200, 200), (150, 230), (230, 150)]:
        i = torch.arange(sq)[:, None] + sk - sq  # bottom-right aligned key position of each query
        j = torch.arange(sk)[None, :]
        for window_size in [(31, 0), (16, 16), (-1, 40), (50, -1), (0, 0), (-1, -1)]:
            for causal in (False, True):
                left, right = window_size[0], 0 if causal else window_size[1]
                keep = ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0)) & (j < sk)
                dense = (j <= i) if causal else torch.ones(sq, sk, dtype=torch.bool)
                assert window_fraction(sq, sk, window_size, causal) == pytest.approx(
                    keep.sum().item() / dense.sum().item(), abs=1e-12)
                if sq == sk:
                    assert torch.equal(torch.broadcast_to(window_mask_mod(window_size, causal)(0, 0, i, j), keep.shape),
                                       keep)
    assert window_size_of(1024, True) == (1023, 0) and window_size_of(1024, False) == (512, 512)
    # causal W-token window (HF/Mistral): W keys for every query past the first W
    assert window_fraction(4096, 4096, (1023, 0), True) == pytest.approx(
        (1024 * 1025 / 2 + (4096 - 1024) * 1024) / (4096 * 4097 / 2))


def test_bench_varlen_cpu(tmp_path, capsys):
    from flashcute.bench import varlen_flops, varlen_lengths

    rows, txt, md = _bench(tmp_path, "--varlen", "--num-seqs", "3", "--lengths", "8", "64", "--tokens", "96")
    assert "varlen_attn and cuDNN skipped" in capsys.readouterr().out
    lengths = varlen_lengths(3, 8, 64, 96)
    assert {r["impl"] for r in rows} == {"flashcute", "sdpa_cpu_padded"}
    assert {(r["impl"], r["mode"], r["causal"]) for r in rows} == {
        (i, m, c) for i in ("flashcute", "sdpa_cpu_padded") for m in ("fwd", "fwdbwd") for c in (False, True)}
    for r in rows:
        assert (r["num_seqs"], r["total_tokens"], r["seqlen"], r["min_len"]) == (3, 96, max(lengths), min(lengths))
        assert r["tflops"] * r["ms"] * 1e9 == pytest.approx(varlen_flops(lengths, 2, 32, r["causal"], r["mode"]))
        assert r["padding"] == (None if r["impl"] == "flashcute" else
                                "causal, no mask needed" if r["causal"] else "key-padding mask")
        ours = next(o for o in rows if (o["impl"], o["mode"], o["causal"]) == ("flashcute", r["mode"], r["causal"]))
        assert r["peer_over_flashcute"] == pytest.approx(r["ms"] / ours["ms"])
    assert "| padded SDPA's key padding |" in md and "x sdpa_cpu_padded" in txt
    assert txt.rstrip().splitlines()[-1].startswith("varlen rows faster than sdpa_cpu_padded: ")


def test_varlen_lengths_and_padded_peer():
    from flashcute.bench import _pad, _padded_sdpa_variants, varlen_lengths

    lengths = varlen_lengths(64, 64, 4096, 131072, seed=0)
    assert len(lengths) == 64 and sum(lengths) == 131072 and all(64 <= n <= 4096 for n in lengths)
    assert lengths == varlen_lengths(64, 64, 4096, 131072, seed=0) != varlen_lengths(64, 64, 4096, 131072, seed=1)
    with pytest.raises(ValueError):
        varlen_lengths(4, 16, 32, 200)
    # the padded peer computes what attention_varlen does on the real rows
    lengths = [5, 17, 1, 12]
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lengths), 2, 16) for _ in range(3))
    for causal in (False, True):
        ref = flashcute.attention_varlen(q, k, v, cu, cu, 17, 17, causal=causal)
        keep = torch.arange(17) < torch.tensor(lengths)[:, None]
        for _, fwd in _padded_sdpa_variants("cpu", lengths, 17, causal)[:1]:
            out = fwd(*(_pad(t, lengths, 17) for t in (q, k, v)))
            torch.testing.assert_close(out[keep], ref, atol=1e-5, rtol=1e-5)


def test_bench_score_mods_cpu(tmp_path, capsys):
    from flashcute.bench import alibi_slopes

    rows, txt, md = _bench(tmp_path, "--score-mods", "--seqlens", "64", "--tokens", "128", "--causal", "true")
    assert "softcap and ALiBi" in capsys.readouterr().out
    assert {(r["impl"], r["score_mod"], r["mode"]) for r in rows} == {
        (i, s, m) for i, s in [("flashcute", "none"), ("softcap", "softcap"), ("alibi", "alibi"),
                               ("dropout", "dropout")]
        for m in ("fwd", "fwdbwd")}
    for r in rows:
        plain = next(p for p in rows if (p["impl"], p["mode"]) == ("flashcute", r["mode"]))
        assert r["plain_ms"] == plain["ms"] and r["softcap"] == (30.0 if r["impl"] == "softcap" else 0.0)
        assert r["dropout_p"] == (0.1 if r["impl"] == "dropout" else 0.0)
        assert r["vs_sdpa_flash"] is None  # the SDPA-flash peer runs on CUDA only
        assert r["overhead_pct"] == pytest.approx(100 * (r["ms"] / plain["ms"] - 1))
        assert r["within_bar"] == (None if r["impl"] == "flashcute" else r["overhead_pct"] <= 10)
    assert "| softcap ms | softcap overhead |" in md
    assert txt.rstrip().splitlines()[-1].startswith("score-mod rows within 10% of plain flashcute: softcap ")
    assert torch.allclose(alibi_slopes(8, "cpu"), 2.0 ** (-torch.arange(1, 9, dtype=torch.float32)))


def test_bench_tables_with_families_and_peers(tmp_path):
    """The GPU-only rows (forced families, flex) in the new tables, from CPU rows relabelled."""
    from flashcute.bench import format_table, markdown_report

    env = dict(device="test", date="today", torch=torch.__version__)
    rows, _, _ = _bench(tmp_path / "w", "--window", "32", "--seqlens", "64", "--tokens", "64", "--modes", "fwd")
    rows += [dict(r, impl=r["impl"] + "[sm80]") for r in rows]
    flex = dict(next(r for r in rows if r["impl"] == "flashcute"), impl="flex", ms=1.0, dense_ms=None,
                bound_ms=None, meets_bound=None)
    for r in rows:
        if r["impl"] == "flashcute":
            r.update(flex_ms=1.0, flex_over_flashcute=1.0 / r["ms"])
    table = format_table(rows + [flex])
    assert "flashcute[sm80]" in table and "; flashcute[sm80] within the bound: " in table
    assert "| flashcute[sm80] |" in markdown_report(env, rows + [flex], "cmd")
    rows, _, _ = _bench(tmp_path / "s", "--score-mods", "--seqlens", "64", "--tokens", "64", "--modes", "fwd",
                        "--causal", "false")
    rows += [dict(r, impl=r["impl"] + "[sm90]") for r in rows]
    table = format_table(rows)
    assert " sm90 " in table and "; [sm90]: softcap " in table
    assert "| sm90 |" in markdown_report(env, rows, "cmd")


@pytest.mark.parametrize("argv", [["--window", "--varlen"], ["--varlen", "--score-mods"], ["--window", "--score-mods"],
                                  ["--block-sparse", "--varlen"], ["--block-sparse", "--score-mods"],
                                  ["--block-sparse", "--window", "64", "128"]])
def test_bench_sweeps_exclude_each_other(argv, tmp_path, capsys):
    from flashcute.bench import main

    with pytest.raises(SystemExit) as exc:
        main([*argv, "--cpu", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--" in capsys.readouterr().err


def test_time_all_rounds_rotate_the_order_and_report_medians(monkeypatch):
    """--rounds: each impl timed once per round, the order rotated by one each round, the median
    reported; an impl that fails is dropped with a message, the others still reported."""
    from flashcute import bench

    calls, results = [], {"a": [5.0, 1.0, 3.0], "b": [2.0, 9.0, 4.0]}

    def timer(runner):
        name = runner()
        calls.append(name)
        return results[name].pop(0)

    def broken(q, k, v):
        raise RuntimeError("cannot run this point")

    monkeypatch.setattr(bench, "_ROUNDS", 3)
    impls = {"a": lambda q, k, v: "a", "b": lambda q, k, v: "b", "c": broken}
    q = torch.zeros(1)
    times = bench._time_all(timer, impls, q, q, q, "fwd", "test point")
    assert calls == ["a", "b", "b", "a", "a", "b"]  # round 0: a b (c fails, dropped); 1: b a; 2: a b
    assert times == {"a": 3.0, "b": 4.0}


def test_families_none_adds_no_family_columns():
    import argparse

    from flashcute import bench

    args = argparse.Namespace(families=["none"])
    assert bench._family_impls(args, "cuda", lambda q, k, v: q) == {}


def test_integration_speedup_is_the_median_of_paired_ratios_with_its_interval():
    """scripts/bench_integrations.py: the speedup is the median of the turns' ratios base / route
    (paired by turn, not by sorted times), with the order statistics n/2 -+ 1.96 sqrt(n)/2 as its
    95% interval and the share of turns at or above 1."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "bench_integrations.py"
    spec = importlib.util.spec_from_file_location("bench_integrations", path)
    bi = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bi)
    base = [10.0, 20.0, 10.0, 30.0]
    route = [5.0, 40.0, 10.0, 15.0]  # ratios 2.0, 0.5, 1.0, 2.0; sorted times would give 1.0 / 1.33 ...
    sp = bi._speedup(base, route)
    assert sp["speedup"] == 1.5
    assert sp["turns_ge_1"] == 0.75
    assert sp["ci95"] == (0.5, 2.0)  # n = 4: ranks floor(2 - 1.96) = 0 and ceil(2 + 1.96) -> 3
    ratios = [1.0 + 0.001 * i for i in range(400)]  # n = 400: ranks floor(200 - 19.6) = 180, ceil(219.6) = 220
    sp = bi._speedup(ratios, [1.0] * 400)
    assert sp["ci95"] == (ratios[180], ratios[220])
    assert sp["speedup"] == pytest.approx(1.1995)
