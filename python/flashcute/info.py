"""``python -m flashcute.info``: how this flashcute was built and what it can run here.

Prints the build configuration recorded next to the library (flashcute_build_info.json,
written by cmake/build_info.cmake: the torch and CUDA versions it was built against, kernel
families, CUDA archs, head dims, dtypes, compilers), the torch it runs under, the GPUs and which
kernels serve them, and the integrations. ``--json`` prints the same as one JSON object.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys

import torch

import flashcute
from flashcute import _ops

_HEADDIMS = (32, 64, 96, 128, 192, 256)
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def build_info() -> dict | None:
    """The recorded build configuration, or None for a library built without it."""
    path = _ops._library_path().with_name("flashcute_build_info.json")
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def collect() -> dict:
    lib = _ops._library_path()
    info = {
        "flashcute": {"version": flashcute.__version__, "package": str(flashcute.__path__[0]), "library": str(lib)},
        "build": build_info(),
        "runtime": {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": sys.version.split()[0]},
        "kernel_families_built": [f"sm{f}" for f in torch.ops.flashcute.kernel_families()],
        "cuda_kernels": {},
        "gpus": [],
        "integrations": {},
    }
    if info["kernel_families_built"]:
        info["cuda_kernels"] = {name: [d for d in _HEADDIMS if torch.ops.flashcute.has_cuda_kernel(d, dtype)]
                                for name, dtype in _DTYPES.items()}
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            cap = torch.cuda.get_device_capability(i)
            families = [f"sm{f}" for f in torch.ops.flashcute.kernel_families(10 * cap[0] + cap[1])]
            info["gpus"].append({"index": i, "name": torch.cuda.get_device_name(i), "capability": f"{cap[0]}.{cap[1]}",
                                 "families": families or "none (CPU backend only)"})
    try:
        from torch.nn.attention import current_flash_attention_impl

        info["integrations"]["torch_flash_attention_impl_active"] = current_flash_attention_impl()
    except ImportError:  # a torch without the registry
        info["integrations"]["torch_flash_attention_impl_active"] = "n/a"
    try:
        info["integrations"]["transformers"] = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        info["integrations"]["transformers"] = None
    return info


def _fmt(value):
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value) if value else "none"
    return str(value)


def _fmt_flag(value, yes, no):
    """A build option's line: "-" where the build info lacks it."""
    if value is None:
        return "-"
    return f"yes ({yes})" if value else f"no ({no})"


def _fmt_dense(value, calls="calls"):
    # Calls with dropout, softcap or ALiBi run the windowed kernels in every build (dispatch.h).
    return _fmt_flag(value, "plain calls; with dropout, softcap or ALiBi the windowed kernels",
                     f"{calls} without a window or causal mask run the windowed kernels")


def format_text(info: dict) -> str:
    b = info["build"]
    rt = info["runtime"]
    lines = [f"flashcute {info['flashcute']['version']}",
             f"  package:            {info['flashcute']['package']}",
             f"  library:            {info['flashcute']['library']}"]
    lines.append("build")
    if b is None:
        lines.append("  (no flashcute_build_info.json next to the library: a build older than the build record)")
    else:
        causal = _fmt_flag(b.get("causal_kernels"), "the forward of plain causal calls, and the sm80 backward of those on "
                           "padded batches; other backwards run the windowed kernels",
                           "causal calls run the windowed kernels")
        built_torch = f"{b.get('torch_version')} (CUDA {b.get('torch_cuda_version') or 'none: CPU-only torch'})"
        lines += [f"  built for torch:    {built_torch}",
                  f"  CUDA kernels:       {'yes' if b.get('with_cuda') else 'no (CPU backend only)'}",
                  f"  kernel families:    {_fmt(b.get('kernel_families'))}",
                  f"  CUDA archs:         {_fmt(b.get('cuda_archs'))}",
                  f"  head dims:          {_fmt(b.get('headdims'))}",
                  f"  dtypes:             {_fmt(b.get('dtypes'))}",
                  f"  dense kernels:      {_fmt_dense(b.get('dense_kernels'))}",
                  f"  causal kernels:     {causal}",
                  f"  unwindowed sparse:  {_fmt_dense(b.get('unwindowed_sparse_kernels'), 'block-sparse calls')}",
                  f"  C++ compiler:       {_fmt(b.get('cxx_compiler'))}",
                  f"  CUDA compiler:      {_fmt(b.get('cuda_compiler'))}",
                  f"  build type:         {_fmt(b.get('build_type'))}"]
    lines += ["runtime",
              f"  torch:              {rt['torch']} (CUDA {rt['torch_cuda'] or 'none'})",
              f"  python:             {rt['python']}",
              f"  library families:   {_fmt(info['kernel_families_built'])}"]
    for name, dims in info["cuda_kernels"].items():
        lines.append(f"  {name} kernels:       head dims {_fmt(dims)} (other multiples of 8 run on the next one up)")
    lines.append("  CPU backend:        float32, float16, bfloat16; every head dim")
    if info["gpus"]:
        for g in info["gpus"]:
            lines.append(f"  GPU {g['index']}:              {g['name']} (sm {g['capability']}): {_fmt(g['families'])}")
    else:
        lines.append("  GPU:                none visible")
    lines += ["integrations",
              f"  torch flash-attention impl active: {_fmt(info['integrations']['torch_flash_attention_impl_active'])}"
              " (flashcute.integrations.torch_registry: 'FLASHCUTE')",
              f"  transformers:       {_fmt(info['integrations']['transformers'])}"
              " (flashcute.integrations.transformers.register())"]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flashcute.info", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_text(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
