"""``python -m flashcute.demo``: a quick check that flashcute works on this machine.

Runs ``flashcute.attention`` forward and backward on a small random problem (GQA, causal)
on the GPU when there is one and flashcute's CUDA kernels work, else on the CPU backend,
and checks out, lse, dq, dk, dv against ``flashcute.reference`` with the SPEC's criterion:

    max|ours - ref32| <= 2 * max|pt - ref32| + 1e-5     (out, dq, dk, dv)
    max|lse - lse32|  <= 1e-3

where ref32 is the math on float32 copies and pt the same math in the inputs' dtype.
Prints a short report and exits with status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

import flashcute
from flashcute import reference

# Errors that mean "this build or GPU has no CUDA kernel for it" rather than a failure.
_UNAVAILABLE = ("only the CPU backend", "no kernel in this build", "need sm80")


def _maxabs(x: torch.Tensor) -> float:
    return x.abs().max().item() if x.numel() else 0.0


def _criterion(ours, ref32, pt):
    err = _maxabs(ours.double() - ref32.double())
    return err, 2.0 * _maxabs(pt.double() - ref32.double()) + 1e-5


def _lse_error(ours, ref):
    empty = torch.isneginf(ref)
    if not torch.equal(torch.isneginf(ours), empty):
        return float("inf")
    return _maxabs(ours[~empty] - ref[~empty])


def _reference(q, k, v, dout, *, causal, upcast, backward):
    """out, lse (and dq, dk, dv) of the reference: float32 (upcast) or the inputs' dtype."""
    dt = torch.float32 if upcast else q.dtype
    q, k, v = (t.detach().to(dt).requires_grad_(backward) for t in (q, k, v))
    with torch.set_grad_enabled(backward):
        out, lse = reference.attention(q, k, v, causal=causal, return_lse=True, upcast=upcast)
        grads = torch.autograd.grad(out, (q, k, v), dout.to(dt)) if backward else ()
    return (out.detach(), lse.detach(), *grads)


class Report:
    def __init__(self):
        self.failed = False

    def line(self, text=""):
        print(text, flush=True)

    def check(self, name, err, bound):
        ok = err <= bound
        self.failed |= not ok
        self.line(f"    {name:<4} max|ours - ref32| = {err:.3e}   bound {bound:.3e}   "
                  f"{'PASS' if ok else 'FAIL'}")
        return ok


def run_case(rep: Report, device: str, dtype: torch.dtype, *, backward: bool, shape, causal=True):
    """Runs and checks one problem on device; returns None, or the exception it raised."""
    b, sq, sk, h, hkv, d = shape
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(b, s, n, d, generator=gen).to(device=device, dtype=dtype)
               for s, n in ((sq, h), (sk, hkv), (sk, hkv)))
    dout = torch.randn(b, sq, h, d, generator=gen).to(device=device, dtype=dtype)
    q, k, v = (t.requires_grad_(backward) for t in (q, k, v))

    name = device
    if device == "cuda":
        name = f"cuda ({torch.cuda.get_device_name()})"
    rep.line(f"  device {name}, {str(dtype).replace('torch.', '')}, "
             f"{'forward + backward' if backward else 'forward only'}")

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    try:
        t0 = time.perf_counter()
        out, lse = flashcute.attention(q, k, v, causal=causal, return_lse=True)
        sync()
        t1 = time.perf_counter()
        grads = torch.autograd.grad(out, (q, k, v), dout) if backward else ()
        sync()
        t2 = time.perf_counter()
    except RuntimeError as e:  # ValueError is a bad input: a bug of the demo, let it raise
        return e

    ref32 = _reference(q, k, v, dout, causal=causal, upcast=True, backward=backward)
    pt = _reference(q, k, v, dout, causal=causal, upcast=False, backward=backward)
    rep.check("out", *_criterion(out, ref32[0], pt[0]))
    rep.check("lse", _lse_error(lse, ref32[1]), 1e-3)
    for i, g in enumerate(grads):
        rep.check(("dq", "dk", "dv")[i], *_criterion(g, ref32[2 + i], pt[2 + i]))
    rep.line(f"    time: forward {1e3 * (t1 - t0):.1f} ms"
             + (f", backward {1e3 * (t2 - t1):.1f} ms" if backward else "")
             + " (first call, includes warm-up)")
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashcute.demo", description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="run the CPU backend only")
    args = ap.parse_args(argv)

    shape = (2, 200, 256, 8, 2, 64)  # batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim
    b, sq, sk, h, hkv, d = shape
    rep = Report()
    rep.line(f"flashcute {flashcute.__version__} demo (torch {torch.__version__})")
    rep.line(f"  q ({b}, {sq}, {h}, {d}), k/v ({b}, {sk}, {hkv}, {d}): GQA {h // hkv}:1, "
             "causal (bottom-right aligned)")
    rep.line("  criterion: max|ours - ref32| <= 2 max|pt - ref32| + 1e-5; lse within 1e-3")

    run_cpu = True
    if args.cpu:
        rep.line("  --cpu: skipping the GPU")
    elif not torch.cuda.is_available():
        rep.line("  no CUDA GPU visible to torch: running the CPU backend")
    else:
        err = run_case(rep, "cuda", torch.bfloat16, backward=True, shape=shape)
        if err is None:
            run_cpu = False
        else:
            msg = str(err).splitlines()[0]
            if any(s in msg for s in _UNAVAILABLE):
                rep.line(f"    no usable CUDA kernel: {msg}")
                rep.line("    running the CPU backend instead")
            else:
                rep.line(f"    FAIL: the CUDA kernel raised {type(err).__name__}: {msg}")
                rep.failed = True
    if run_cpu:
        err = run_case(rep, "cpu", torch.bfloat16, backward=True, shape=shape)
        if err is not None:
            rep.line(f"    FAIL: the CPU backend raised {type(err).__name__}: {str(err).splitlines()[0]}")
            rep.failed = True

    rep.line("FAIL" if rep.failed else "PASS")
    return 1 if rep.failed else 0


if __name__ == "__main__":
    sys.exit(main())
