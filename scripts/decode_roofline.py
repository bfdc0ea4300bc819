"""How fast can one kernel read a decode call's K/V bytes, and what does merging the splits inside
a thread-block cluster cost? (issue 13; BENCHMARKS.md, Decoding, "Session 47").

Builds scripts/decode_roofline.cu (nvcc -O3 -arch=sm_90a -shared, into the temp directory) and
times its kernels as `python -m flashcute.bench --decode` times decoding (CUDA graphs of calls
rotating through buffer copies of at least 4x L2, do_bench medians), next to flashcute's decode
and SDPA-cuDNN's of the same shapes (b, 32 query heads of 128, bf16, contiguous caches) in the
same process. Needs an sm90 GPU and nvcc: `python scripts/decode_roofline.py`."""
import ctypes
import math
import os
import subprocess
import tempfile

import torch
import torch.nn.functional as F
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashcute
from flashcute import bench

SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_roofline.cu")
POINTS = [(1, 8, 32768), (1, 1, 131072), (1, 8, 131072), (1, 8, 8192)]  # (batch, KV heads, cache)
READS = [(0, 8, 0, 0), (0, 16, 0, 0), (1, 1, 6, 32768), (1, 1, 12, 16384), (1, 2, 6, 16384), (1, 2, 3, 32768),
         (1, 4, 4, 8192)]  # (kind: 0 ldg / 1 bulk, CTAs per SM, ring stages, chunk bytes)
BULK64 = [(6, 32768), (3, 32768)]  # the bulk read from 64 CTAs
CLUSTERS = [(128, 16, 6, 32768), (256, 16, 3, 32768), (128, 16, 2, 32768), (128, 16, 4, 16384), (256, 16, 2, 16384),
            (64, 8, 6, 32768), (128, 8, 6, 32768), (128, 8, 2, 32768), (128, 8, 4, 16384), (256, 8, 3, 32768),
            (256, 8, 2, 16384), (264, 8, 2, 16384), (128, 1, 6, 32768)]  # (CTAs, cluster, stages, chunk)
PAYLOAD = 512  # floats per split's partial: 4 packed rows of d128


def load_library():
    so = os.path.join(tempfile.gettempdir(), "flashcute_decode_roofline.so")
    if not os.path.exists(so) or os.path.getmtime(so) < os.path.getmtime(SRC):
        nvcc = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
        subprocess.run([nvcc, "-O3", "-arch=sm_90a", "-shared", "-Xcompiler", "-fPIC", "-o", so, SRC], check=True)
    lib = ctypes.CDLL(so)
    lib.roof_launch.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int,
                                ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
    lib.roof_cluster.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                 ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def main():
    lib = load_library()
    timer = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
    out = torch.zeros(64 * 1024, dtype=torch.float32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    stream = lambda: torch.cuda.current_stream().cuda_stream  # noqa: E731

    def check(rc):
        if rc != 0:
            raise RuntimeError(f"decode_roofline: CUDA error {rc}")

    def read_calls(bufs, kind, ctas, stages, chunk):
        return [lambda b=b: check(lib.roof_launch(kind, b.data_ptr(), b.numel() * b.element_size(), out.data_ptr(),
                                                  ctas, stages, chunk, stream())) for b in bufs]

    def cluster_calls(bufs, ctas, cluster, stages, chunk):
        most = ctypes.c_int(0)
        b = bufs[0]
        check(lib.roof_cluster(b.data_ptr(), b.numel() * b.element_size(), out.data_ptr(), ctas, cluster, stages, chunk,
                               PAYLOAD, stream(), ctypes.byref(most)))
        return [lambda b=b: check(lib.roof_cluster(b.data_ptr(), b.numel() * b.element_size(), out.data_ptr(), ctas,
                                                   cluster, stages, chunk, PAYLOAD, stream(), None))
                for b in bufs], most.value

    print(f"# {torch.cuda.get_device_name()}, {sms} SMs; graph replays rotating buffer copies, do_bench medians")
    for batch, hk, sk in POINTS:
        h, d = 32, 128
        kvb = bench.decode_kv_bytes(batch, sk, hk, d, 2)
        n = bench.decode_copies(kvb, bench._l2_bytes("cuda"))
        n_calls = max(n, min(20, max(2, math.ceil(2e9 / kvb))))
        bufs = [torch.randn(kvb // 2, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
        res = []
        for kind, per_sm, stages, chunk in READS:
            ms = bench._graph_time(timer, read_calls(bufs, kind, per_sm * sms, stages, chunk), n_calls)
            res.append((f"{'ldg' if kind == 0 else 'bulk'} ctas {per_sm * sms} st {stages} ch {chunk}", ms))
        for stages, chunk in BULK64:
            res.append((f"bulk ctas 64 st {stages} ch {chunk}",
                        bench._graph_time(timer, read_calls(bufs, 1, 64, stages, chunk), n_calls)))
        for ctas, cluster, stages, chunk in CLUSTERS:
            calls, most = cluster_calls(bufs, ctas, cluster, stages, chunk)
            res.append((f"cluster ctas {ctas} x{cluster} st {stages} ch {chunk} (max {most})",
                        bench._graph_time(timer, calls, n_calls)))
        del bufs
        qs = [torch.randn(batch, 1, h, d, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
        ks = [torch.randn(batch, sk, hk, d, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
        vs = [torch.randn(batch, sk, hk, d, dtype=torch.bfloat16, device="cuda") for _ in range(n)]
        res.append(("flashcute decode", bench._graph_time(
            timer, [lambda i=i: flashcute.attention_with_kvcache(qs[i], ks[i], vs[i]) for i in range(n)], n_calls)))
        kt = [k.transpose(1, 2).contiguous() for k in ks]
        vt = [v.transpose(1, 2).contiguous() for v in vs]
        qt = [q.transpose(1, 2) for q in qs]
        del ks, vs

        def cudnn(i):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt[i], kt[i], vt[i], enable_gqa=hk != h)
        res.append(("sdpa cudnn decode", bench._graph_time(timer, [lambda i=i: cudnn(i) for i in range(n)], n_calls)))
        del qs, qt, kt, vt
        print(f"== b {batch} h_k {hk} cache {sk}: {kvb / 1e6:.1f} MB, {n} copies, {n_calls} calls per graph")
        for name, ms in res:
            print(f"  {name:44s} {ms * 1e3:8.2f} us  {kvb / ms / 1e6:7.0f} GB/s")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
