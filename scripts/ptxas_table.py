"""Registers, stack and spills of every kernel, from a build log made with -Xptxas=-v.

    cmake ... -DCMAKE_CUDA_FLAGS=-Xptxas=-v && ninja > build.log
    python scripts/ptxas_table.py build.log [before.log]

Prints one row per (kernel, arch) with a short name (family, kernel, traits, policy); with a
second log, the same kernels' numbers from it beside them (the restructure's before/after).
"""
from __future__ import annotations

import re
import subprocess
import sys


def _demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
        return out.splitlines()
    except (OSError, subprocess.CalledProcessError):
        return list(names)


def _short(name: str) -> str:
    """A stable short key: kernel name plus the numbers and flags of its template arguments."""
    name = name.replace("flashcute::", "").replace("cutlass::", "").replace("(anonymous namespace)::", "")
    family = ""
    for f in ("sm80::", "sm90::"):
        if f in name:
            family, name = f[:-2] + " ", name.replace(f, "")
    m = re.match(r"void (\w+)<(.*)>\(.*\)$", name)
    if not m:
        return family + re.sub(r"\(.*", "", name).replace("void ", "")
    kernel, args = m.groups()
    traits = re.search(r"(Bwd)?(?:KernelTraits|FwdTraits)<([^>]*)>", args)
    args = args.replace("PaddedCausalMask", "AttentionMask<true, false, false, false, padded>")
    mask = re.search(r"AttentionMask<(\w+), (\w+)(?:, (\w+))?(?:, (\w+))?(?:, (padded))?>(?:, (true|false))?(?:, (true|false))?",
                     args)
    t = traits.group(2).replace("bfloat16_t", "bf16").replace("half_t", "fp16").replace(" ", "") if traits else ""
    pol = ""
    if mask:
        window = "causal" if mask.group(4) == "false" else "window"  # kLeftEdge = false: CausalMask
        window += "+padded" if mask.group(5) else ""  # PaddedCausalMask
        pol = (window if mask.group(1) == "true" else "dense") + ("+sparse" if mask.group(2) == "true" else "")
        pol += "+scoremod" if mask.group(6) == "true" else ""
        pol += "+dropout" if mask.group(7) == "true" and "MainloopBwd" in args else ""
        pol += "+kvcache" if "KvCache" in args else ""
    if not traits:
        t = re.sub(r"[^0-9a-z_,]", "", args.replace("bfloat16_t", "bf16").replace("half_t", "fp16"))
    return f"{family}{kernel}<{t}>{(' ' + pol) if pol else ''}"


def parse(path):
    rows, cur = {}, None
    text = open(path, errors="replace").read()
    entries = re.findall(r"Compiling entry function '(\w+)' for '(sm_\w+)'\n(?:.*\n)*?.*?(\d+) bytes stack frame, "
                         r"(\d+) bytes spill stores, (\d+) bytes spill loads\n.*?Used (\d+) registers", text)
    names = _demangle([e[0] for e in entries])
    for (mangled, arch, stack, st, ld, regs), name in zip(entries, names):
        rows[(_short(name), arch)] = (int(regs), int(stack), int(st), int(ld))
    return rows


def main():
    after = parse(sys.argv[1])
    before = parse(sys.argv[2]) if len(sys.argv) > 2 else {}
    cols = "regs stack spill(st/ld)"
    print(f"| kernel | arch | {cols} |" + (f" before: {cols} |" if before else ""))
    print("|---|---|---|" + ("---|" if before else ""))
    for key in sorted(after):
        r, s, st, ld = after[key]
        line = f"| {key[0]} | {key[1]} | {r} {s} {st}/{ld} |"
        if before:
            # The pre-restructure kernels are the sm80 family's without its namespace.
            b = before.get(key) or before.get((key[0].removeprefix("sm80 "), key[1]))
            line += f" {b[0]} {b[1]} {b[2]}/{b[3]} |" if b else " - |"
        print(line)


if __name__ == "__main__":
    main()
