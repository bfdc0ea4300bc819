"""examples/generate.py (greedy generation on flashcute.attention_with_kvcache, checked against
recomputing every step from scratch) and the pure-Python parts of ``python -m flashcute.bench
--decode`` (grid, byte and FLOP counts, buffer rotation, page layouts, the table)."""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest
import torch

from conftest import gpu, or_skip

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "generate.py"


def _example():
    spec = importlib.util.spec_from_file_location("flashcute_example_generate", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- examples/generate.py ----------------------------------------------------------------------
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_generate_cpu(paged, capsys):
    argv = ["--device", "cpu", "--steps", "12"] + (["--paged"] if paged else [])
    result = _example().main(argv)
    assert result["same"] and result["tokens_cache"] == result["tokens_scratch"]
    assert len(result["tokens_cache"]) == 3 and all(len(t) == 12 for t in result["tokens_cache"])
    assert result["max_logit_diff"] < 1e-3
    out = capsys.readouterr().out
    assert "same tokens: True" in out and ("paged" in out) == paged


def test_generate_cpu_sdpa_reference_free_running_and_prompt_lengths():
    # Prompts of 1, 16 and 17 tokens: a page boundary right at and just past the prompt.
    result = _example().main(["--device", "cpu", "--steps", "5", "--prompt-lens", "1", "16", "17", "--paged",
                              "--reference", "sdpa", "--free-running"])
    assert result["same"] and not result["near_ties"]


def test_generate_detects_a_wrong_cache():
    """The check is not vacuous: a KV-cache call that attends to one token too few fails it."""
    example = _example()
    real = example.attention_with_kvcache

    def forgetful(q, k_cache, v_cache, k, v, *, cache_seqlens, **kw):
        return real(q, k_cache, v_cache, k, v, cache_seqlens=(cache_seqlens - 1).clamp(min=0), **kw)

    example.attention_with_kvcache = forgetful
    with pytest.raises(AssertionError, match="disagrees with recomputing from scratch"):
        example.main(["--device", "cpu", "--steps", "6"])


@gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype,head_dim", [("float16", 32), ("bfloat16", 128)])
def test_generate_cuda(paged, dtype, head_dim):
    argv = ["--device", "cuda", "--steps", "16", "--attn-dtype", dtype, "--head-dim", str(head_dim)]
    result = or_skip(lambda: _example().main(argv + (["--paged"] if paged else [])))
    # 16-bit attention: a step may differ only where the reference's top-2 logits tie (main raises otherwise).
    assert result["ok"] and len(result["near_ties"]) <= 2


# ---- flashcute.bench --decode: the parts that need no GPU --------------------------------------
def test_decode_byte_and_flop_counts():
    from flashcute.bench import decode_copies, decode_flops, decode_kv_bytes

    # The b=32 x 128k x 32 heads x d=128 in bf16: 64 GiB of K/V.
    assert decode_kv_bytes(32, 131072, 32, 128, 2) == 64 * 2**30
    assert decode_kv_bytes(1, 8192, 8, 128, 2) == 2 * 8192 * 8 * 128 * 2
    assert decode_kv_bytes(3, [10, 20, 30], 2, 64, 2) == 2 * 60 * 2 * 64 * 2
    with pytest.raises(ValueError):
        decode_kv_bytes(2, [10, 20, 30], 2, 64, 2)
    assert decode_flops(2, 1, 100, 4, 8, causal=False) == 4.0 * 2 * 4 * 8 * 100
    # Bottom-right causal: query i of 3 against 10 keys sees 8, 9, 10 of them.
    assert decode_flops(1, 3, 10, 1, 1, causal=True) == 4.0 * (8 + 9 + 10)
    assert decode_flops(1, 512, 32768, 32, 128, causal=True) == pytest.approx(
        4.0 * 32 * 128 * 512 * (32768 - 255.5))
    l2 = 60 * 2**20
    assert decode_copies(4 * 2**20, l2) == 60  # 4 MiB: 60 copies exceed 4 x L2 = 240 MiB
    assert decode_copies(1 * 2**30, l2) == 1
    assert decode_copies(150 * 10**6, 0) == 2  # under 200 MB even without an L2 figure
    assert all(decode_copies(n, l2) * n >= 4 * l2 for n in (10**5, 10**6, 10**7, 10**8))


def test_decode_page_layouts():
    from flashcute.bench import _to_paged, decode_page_size

    assert decode_page_size("contig") is None
    assert decode_page_size("paged16") == 16 and decode_page_size("paged128") == 128
    for bad in ("paged8", "paged", "pagedx", "blocked16", "paged0"):
        with pytest.raises(ValueError):
            decode_page_size(bad)
    for cap, page in [(64, 16), (40, 16)]:  # whole pages, and a last partial page
        cache = torch.randn(3, cap, 2, 8)
        pages = -(-cap // page)
        table = torch.randperm(3 * pages).view(3, pages).to(torch.int32)
        paged = _to_paged(cache, page, table)
        assert paged.shape == (3 * pages, page, 2, 8)
        for b in range(3):
            for t in range(cap):
                assert torch.equal(paged[table[b, t // page], t % page], cache[b, t])
        assert torch.isfinite(paged).all()  # slots past the capacity: random, never NaN


def _decode_args(*argv):
    """The parsed and defaulted arguments of `python -m flashcute.bench --decode ...` (CPU defaults)."""
    from flashcute import bench

    captured = {}

    def fake_sweep(args):
        captured["args"] = args
        raise SystemExit(0)

    saved = bench.SWEEPS["decode"]
    bench.SWEEPS["decode"] = fake_sweep
    try:
        with pytest.raises(SystemExit):
            bench.main(["--decode", "--cpu", *argv])
    finally:
        bench.SWEEPS["decode"] = saved
    return captured["args"]


def test_decode_arguments_and_grid():
    from flashcute.bench import _decode_defaults, decode_grid

    args = _decode_args("--batches", "1", "4", "--caches", "64", "--nheads", "8", "--kv-heads", "8", "2",
                        "--layouts", "paged32", "--chunk", "16", "--chunk-cache", "128", "--append-cache", "64")
    assert args.sweep == "decode" and args.layouts == ["contig", "paged32"]
    points = decode_grid(args)
    decode = [p for p in points if p["kind"] == "decode"]
    assert [(p["batch"], p["cache"], p["nheads_kv"]) for p in decode] == [(1, 64, 8), (1, 64, 2), (4, 64, 8),
                                                                          (4, 64, 2)]
    assert all(p["seqlen_q"] == 1 and p["nheads"] == 8 and p["layouts"] == ["contig", "paged32"] for p in decode)
    append = [p for p in points if p["kind"] == "append"]
    assert [(p["batch"], p["cache"], p["layouts"]) for p in append] == [(1, 64, ["contig"])] * 2
    chunked = [p for p in points if p["kind"] == "chunked"]
    assert [(p["seqlen_q"], p["cache"], p["nheads_kv"]) for p in chunked] == [(16, 128, 8), (16, 128, 2)]

    # The GPU grid of the issue, and the quick one.
    full = argparse.Namespace(**{**vars(args), **{k: None for k in (
        "batches", "caches", "nheads", "kv_heads", "headdims", "append_cache", "chunk", "chunk_cache",
        "chunk_kv_heads", "layouts")}, "decode_quick": False})
    _decode_defaults(full, on_gpu=True)
    points = decode_grid(full)
    decode = [p for p in points if p["kind"] == "decode"]
    assert len(decode) == 27 and {p["batch"] for p in decode} == {1, 8, 32}
    assert {p["cache"] for p in decode} == {8192, 32768, 131072} and {p["nheads_kv"] for p in decode} == {32, 8, 1}
    assert all(p["nheads"] == 32 and p["headdim"] == 128 for p in points)
    assert full.layouts == ["contig", "paged16", "paged128"]
    assert [(p["seqlen_q"], p["cache"], p["nheads_kv"]) for p in points if p["kind"] == "chunked"] == [
        (512, 32768, 32), (512, 32768, 8)]
    assert [(p["batch"], p["cache"]) for p in points if p["kind"] == "append"] == [(1, 32768)] * 3
    quick = argparse.Namespace(**{**vars(full), **{k: None for k in (
        "batches", "caches", "kv_heads", "chunk_kv_heads", "layouts")}, "decode_quick": True})
    _decode_defaults(quick, on_gpu=True)
    assert len([p for p in decode_grid(quick) if p["kind"] == "decode"]) < len(decode)


@pytest.mark.parametrize("argv", [["--layouts", "paged10"], ["--nheads", "6", "--kv-heads", "4"],
                                  ["--chunk", "64", "--chunk-cache", "32"], ["--mem-fraction", "0"],
                                  ["--varlen"], ["--score-mods"]])
def test_decode_bad_arguments(argv, tmp_path, capsys):
    from flashcute.bench import main

    with pytest.raises(SystemExit) as exc:
        main(["--decode", "--cpu", "--out", str(tmp_path), *argv])
    assert exc.value.code == 2 and "--" in capsys.readouterr().err


def test_decode_table_from_rows():
    """format_decode_table / the markdown report on hand-made rows: ratios, n/a peers, skipped points."""
    from flashcute.bench import _decode_row, format_table, markdown_report

    point = dict(kind="decode", batch=1, cache=8192, seqlen_q=1, nheads=32, nheads_kv=8, headdim=128)
    kv = 2 * 8192 * 8 * 128 * 2
    kw = dict(kv_bytes=kv, flops=4.0 * 32 * 128 * 8192, copies=8)
    rows = [_decode_row(point, torch.bfloat16, "flashcute", "contig", 0.010, timing="graph", **kw),
            _decode_row(point, torch.bfloat16, "flashcute", "paged16", 0.020, timing="graph", contig_ms=0.010,
                        rel_err=0.0, **kw),
            _decode_row(point, torch.bfloat16, "sdpa_flash", "contig", 0.015, timing="graph", flashcute_ms=0.010,
                        rel_err=3e-3, **kw),
            _decode_row(point, torch.bfloat16, "sdpa_cudnn", "contig", None, note="RuntimeError: No available kernel",
                        **kw)]
    big = dict(point, batch=32, cache=131072, nheads_kv=32)
    rows += [_decode_row(big, torch.bfloat16, "flashcute", "contig", None, note="skipped: 64.0 GiB", kv_bytes=2**36,
                         flops=0.0, copies=1)]
    assert rows[0]["gbps"] == pytest.approx(kv / 0.010 / 1e6) and rows[0]["us"] == pytest.approx(10.0)
    assert rows[1]["contig_over_this"] == pytest.approx(0.5)
    assert rows[2]["peer_over_flashcute"] == pytest.approx(1.5)
    table = format_table(rows)
    head = next(line for line in table.splitlines() if line.lstrip().startswith("b "))
    for column in ("cache", "h/h_k", "layout", "flashcute µs", "GB/s", "x SDPA-flash", "x SDPA-cuDNN", "x contig"):
        assert column in head
    line = next(line for line in table.splitlines() if " contig " in line and "32/8" in line)
    assert "8k" in line and "1.50" in line and "n/a" in line and f"{kv / 0.010 / 1e6:.0f}" in line
    assert any("paged16" in line and "0.50" in line for line in table.splitlines())
    assert "skipped: 64.0 GiB" in table and "SDPA-cuDNN n/a at b=1 cache=8k h=32/8" in table
    env = dict(device="test", date="today", torch="x")
    md = markdown_report(env, rows, "python -m flashcute.bench --decode")
    assert "| b | cache | h/h_k | layout | flashcute µs | GB/s | x SDPA-flash | x SDPA-cuDNN |" in md
    rows[2]["rel_err"] = 0.5
    assert "MISMATCH vs SDPA-flash" in format_table(rows)
    # One head dim: no column d; several: a column d, and each line names its own.
    assert not head.lstrip().startswith("d ")
    rows.append(_decode_row(dict(point, headdim=256), torch.bfloat16, "flashcute", "contig", 0.040, timing="graph",
                            **dict(kw, kv_bytes=2 * kv)))
    table = format_table(rows)
    head = next(line for line in table.splitlines() if line.lstrip().startswith("d "))
    assert head.split()[:3] == ["d", "b", "cache"] and "d=128/256" in table
    assert any(line.split()[:2] == ["256", "1"] and f"{2 * kv / 0.040 / 1e6:.0f}" in line for line in table.splitlines())
    assert "| d | b | cache | h/h_k |" in markdown_report(env, rows, "python -m flashcute.bench --decode")


def test_decode_cpu_run(tmp_path):
    """The whole --decode path on the CPU backend at tiny sizes (the CPU peer: torch's SDPA)."""
    from flashcute.bench import main

    argv = ["--decode-quick", "--cpu", "--caches", "64", "--kv-heads", "4", "1", "--append-cache", "48", "--chunk",
            "8", "--chunk-cache", "64", "--layouts", "contig", "paged16", "--out", str(tmp_path)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny calls: threads only add synchronisation (seconds on a loaded machine)
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    ours = [r for r in rows if r["impl"] == "flashcute"]
    assert {(r["kind"], r["layout"]) for r in ours} == {("decode", "contig"), ("decode", "paged16"),
                                                         ("append", "contig"), ("chunked", "contig")}
    assert all(r["ms"] and r["gbps"] > 0 for r in ours), [r["note"] for r in ours]
    # Paged against contiguous, the CPU SDPA against flashcute: the same K/V, the same outputs.
    checked = [r for r in rows if r["rel_err"] is not None]
    assert checked and all(r["rel_err"] < 2e-2 for r in checked), [(r["impl"], r["rel_err"]) for r in checked]
    assert {r["impl"] for r in rows} == {"flashcute", "sdpa_cpu"}
    txt = (tmp_path / "bench.txt").read_text()
    assert "decode: one query per sequence" in txt and "chunked prefill" in txt and "x SDPA-CPU" in txt
    assert "MISMATCH" not in txt
