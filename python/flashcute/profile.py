"""Profile one configuration per stage: ``python -m flashcute.profile``.

Runs flashcute's forward and backward once (after a warm-up) under Nsight Compute
(``ncu --clock-control none``, filtered to flashcute's kernels) and prints one row per
stage (forward; backward preprocess, main, dQ convert): duration, achieved TFLOP/s, DRAM
throughput, tensor-pipe and SM utilisation, registers, shared memory, occupancy and
shared-memory bank conflicts. ``--torch-trace FILE`` writes a chrome trace from the torch
profiler instead, where the NVTX ranges ``flashcute::fwd``, ``flashcute::bwd_preprocess``,
``flashcute::bwd``, ``flashcute::bwd_convert_dq`` show the stages. On sm90 GPUs the main
backward kernel and the dQ conversion are chained launches (common/utils.h): their kernel spans
in such a trace begin when their CTAs become resident and include the wait for the kernel before
(``FLASHCUTE_CHAINED_LAUNCH=0`` launches them one after the other); ncu runs kernels one by one.

``--block-sparse DENSITY`` profiles a call with a random block mask of that density
(``flashcute.masks.random_blocks``), built inside the profiled region so that its stage
``block_mask_transpose`` (range ``flashcute::block_mask_transpose``, kernels
``flashcute_block_mask_scatter_kernel`` and ``flashcute_block_mask_compact_kernel``) shows
too; TFLOP/s count only the scores the mask keeps.
"""
from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys

import torch

METRICS = [
    "gpu__time_duration.sum",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "launch__registers_per_thread",
    "launch__shared_mem_per_block_dynamic",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum",
    "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum",
]
# Where ncu has them (checked with --query-metrics): Hopper's warpgroup-MMA pipe (the sm90
# family's wgmma; the hmma metric above counts mma.sync only), and local-memory requests (the
# registers that ptxas spilled, as executed).
OPTIONAL_METRICS = [
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum",
    "l1tex__t_requests_pipe_lsu_mem_local_op_st.sum",
]
STAGES = [  # kernel-name fragment, stage name, FLOPs as a multiple of the forward's
    ("flashcute_fwd_kernel", "fwd", 1.0),
    ("flashcute_bwd_preprocess_kernel", "bwd_preprocess", 0.0),
    ("flashcute_bwd_kernel", "bwd", 2.5),
    ("flashcute_bwd_convert_dq_kernel", "bwd_convert_dq", 0.0),
    ("flashcute_block_mask_scatter_kernel", "block_mask_transpose", 0.0),
    ("flashcute_block_mask_compact_kernel", "block_mask_transpose", 0.0),
]


def _inputs(args):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = getattr(torch, args.dtype)
    q = torch.randn(args.batch, args.seqlen, args.nheads, args.headdim, device="cuda", dtype=dtype, generator=gen)
    k = torch.randn(args.batch, args.seqlen, args.nheads_kv or args.nheads, args.headdim, device="cuda",
                    dtype=dtype, generator=gen)
    v = torch.randn_like(k)
    return [t.requires_grad_(not args.fwd_only) for t in (q, k, v)]


def _block_mask(args, device="cuda"):
    """The random block mask of --block-sparse (None without it); on CUDA, building it runs
    the block_mask_transpose stage."""
    if args.block_sparse is None:
        return None
    from flashcute import masks

    return masks.random_blocks(args.seqlen, density=args.block_sparse, device=device)


def _call(args, q, k, v):
    """The profiled call: the block mask built, one forward (+ backward)."""
    import flashcute

    out = flashcute.attention(q, k, v, causal=args.causal, block_mask=_block_mask(args))
    if not args.fwd_only:
        out.backward(torch.randn_like(out))


def run_once(args):
    """The profiled program: warm-up, then one call between sync points."""
    q, k, v = _inputs(args)
    for _ in range(2):
        _call(args, q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    _call(args, q, k, v)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def torch_trace(args):
    q, k, v = _inputs(args)
    _call(args, q, k, v)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        _call(args, q, k, v)
        torch.cuda.synchronize()
    prof.export_chrome_trace(args.torch_trace)
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12))
    print(f"chrome trace written to {args.torch_trace}")


def forward_flops(args):
    """The forward's FLOPs; with --block-sparse only those of the scores the mask keeps."""
    flops = 4.0 * args.batch * args.nheads * args.seqlen * args.seqlen * args.headdim
    if args.block_sparse is not None:
        from .bench import flop_fraction

        flops *= flop_fraction(_block_mask(args, "cpu"), args.seqlen, args.seqlen, args.causal)
    return flops / 2 if args.causal else flops


def stage_of(kernel_name):
    for fragment, stage, factor in STAGES:
        if fragment + "<" in kernel_name or kernel_name.startswith(fragment) or fragment + "(" in kernel_name:
            return stage, factor
    return kernel_name[:40], 0.0


def _num(value):
    try:
        return float(str(value).replace(",", ""))
    except ValueError:
        return float("nan")


def _tensor_pct(r):
    """Tensor-pipe utilisation: mma.sync (hmma) or warpgroup MMA (gmma), whichever ran."""
    vals = [_num(r.get(m)) for m in ("sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
                                      "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active")]
    vals = [v for v in vals if v == v]  # not NaN
    return max(vals) if vals else float("nan")


def available_metrics(ncu):
    """The OPTIONAL_METRICS this ncu knows for the GPU here."""
    try:
        out = subprocess.run([ncu, "--query-metrics"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    known = {line.split()[0] for line in out.splitlines() if line.strip()}
    return [m for m in OPTIONAL_METRICS if m.split(".")[0] in known]


def format_rows(rows, args):
    head = (f"{'stage':30}{'us':>9}{'TFLOP/s':>9}{'DRAM%':>7}{'tensor%':>8}{'SM%':>6}{'regs':>6}"
            f"{'smem KB':>9}{'occup%':>8}{'bank confl ld/st':>18}{'local ld/st':>16}")
    out = [head, "-" * len(head)]
    fwd = forward_flops(args)
    for r in rows:
        stage, factor = stage_of(r.get("Kernel Name", ""))
        if stage == "block_mask_transpose":  # two kernels
            stage += "/scatter" if "scatter" in r["Kernel Name"] else "/compact"
        dur_ns = _num(r.get("gpu__time_duration.sum"))
        unit = r.get("_units", {}).get("gpu__time_duration.sum", "ns")
        dur_us = dur_ns / 1e3 if unit == "ns" else dur_ns * (1e3 if unit == "ms" else 1)
        tflops = fwd * factor / (dur_us * 1e-6) / 1e12 if factor and dur_us > 0 else float("nan")
        out.append(
            f"{stage:30}{dur_us:9.1f}{tflops:9.1f}{_num(r.get('dram__throughput.avg.pct_of_peak_sustained_elapsed')):7.1f}"
            f"{_tensor_pct(r):8.1f}"
            f"{_num(r.get('sm__throughput.avg.pct_of_peak_sustained_elapsed')):6.1f}"
            f"{_num(r.get('launch__registers_per_thread')):6.0f}"
            f"{_num(r.get('launch__shared_mem_per_block_dynamic')) / 1024:9.1f}"
            f"{_num(r.get('sm__warps_active.avg.pct_of_peak_sustained_active')):8.1f}"
            f"{_num(r.get('l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum')):>10.0f}/"
            f"{_num(r.get('l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum')):<7.0f}"
            f"{_num(r.get('l1tex__t_requests_pipe_lsu_mem_local_op_ld.sum')):>8.0f}/"
            f"{_num(r.get('l1tex__t_requests_pipe_lsu_mem_local_op_st.sum')):<7.0f}")
    return "\n".join(out)


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashcute.profile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seqlen", type=int, default=4096)
    p.add_argument("--nheads", type=int, default=16)
    p.add_argument("--nheads-kv", type=int, default=None)
    p.add_argument("--headdim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--causal", action="store_true")
    p.add_argument("--fwd-only", action="store_true")
    p.add_argument("--block-sparse", type=float, metavar="DENSITY",
                   help="profile a call with a random block mask of this density (built in the profiled region)")
    p.add_argument("--torch-trace", metavar="FILE", help="write a torch-profiler chrome trace instead of running ncu")
    p.add_argument("--ncu", default=os.environ.get("NCU", "ncu"), help="the ncu executable")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("flashcute.profile needs a CUDA GPU; none is available here", file=sys.stderr)
        return 2
    if args.worker:
        run_once(args)
        return 0
    if args.torch_trace:
        torch_trace(args)
        return 0
    ncu = shutil.which(args.ncu)
    if ncu is None:
        print(f"flashcute.profile: '{args.ncu}' (Nsight Compute) not found; install it or pass --ncu", file=sys.stderr)
        return 2
    worker_args = [a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--ncu")]
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--kernel-name", "regex:flashcute",
           "--metrics", ",".join(METRICS + available_metrics(ncu)), "--csv", "--page", "raw",
           sys.executable, "-m", "flashcute.profile", "--worker", *worker_args]
    print("$ " + " ".join(cmd), file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", file=sys.stderr)
        return proc.returncode
    text = proc.stdout
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    units = rows[0] if rows and not rows[0].get("ID", "x").strip().isdigit() else {}
    rows = [r for r in rows if r is not units]
    for r in rows:
        r["_units"] = units
    desc = (f"b={args.batch} s={args.seqlen} h={args.nheads}/{args.nheads_kv or args.nheads} d={args.headdim} "
            f"{args.dtype} causal={args.causal}"
            f"{'' if args.block_sparse is None else f' block-sparse density {args.block_sparse}'}"
            f" on {torch.cuda.get_device_name()}")
    print(desc)
    print(format_rows(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
