"""Before/after comparison of two builds' benchmark CSVs (python -m flashcute.bench --out ...).

    python scripts/compare_bench.py --old base_1.csv base_2.csv --new new_1.csv new_2.csv \
        [--new-impl "flashcute[sm80]"] [--peer sdpa_flash]

Per grid point (mode, headdim, seqlen, causal; for --decode rows: kind:layout, headdim, cache,
batch and heads, the peers' ratios only on contiguous caches): the old and new kernel times (median over the
runs of each build), new/old - 1 in percent (positive = the new build is slower), and the change
of the ratio to the peer timed in the same process. Then per (mode, causal): the median change
and how many points lie within +-2%. The spread between runs of one build is printed as the
noise floor.
"""
import argparse
import csv
import statistics
from collections import defaultdict

KEY = ("mode", "headdim", "seqlen", "causal")


def load(paths):
    """One dict per run: (mode, headdim, seqlen, causal, impl) -> ms; a block-sparse sweep's
    points (--block-sparse) carry their pattern and density in the seqlen field ("8192 random 0.250")."""
    runs = []
    for p in paths:
        with open(p) as f:
            rows = list(csv.DictReader(f))
        runs.append({key(r) + (r["impl"],): float(r["ms"]) for r in rows if r.get("ms")})
    return runs


def key(row):
    if row.get("kv_bytes"):  # a --decode row: (kind:layout, headdim, cache, "b<batch> h/h_kv")
        return (f"{row['kind']}:{row['layout']}", row["headdim"], row["cache"],
                f"b{row['batch']} {row['nheads']}/{row['nheads_kv']}")
    k = [row[f] for f in KEY]
    if row.get("pattern"):
        k[2] = f"{k[2]} {row['pattern']} {float(row['density']):.3f}"
    return tuple(k)


def per_point(runs, impl, peer):
    """{point: [impl's ms per run]} and {point: [impl's ms / peer's ms per run]}."""
    t, rel = defaultdict(list), defaultdict(list)
    for run in runs:
        for key, ms in run.items():
            if key[-1] != impl:
                continue
            point = key[:-1]
            t[point].append(ms)
            peer_ms = run.get(point + (peer,))
            if peer_ms:
                rel[point].append(ms / peer_ms)  # our time in units of the peer's
    return t, rel


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", nargs="+", required=True)
    ap.add_argument("--new", nargs="+", required=True)
    ap.add_argument("--old-impl", default="flashcute")
    ap.add_argument("--new-impl", default="flashcute[sm80]")
    ap.add_argument("--peer", default="sdpa_flash")
    args = ap.parse_args()
    old_t, old_rel = per_point(load(args.old), args.old_impl, args.peer)
    new_t, new_rel = per_point(load(args.new), args.new_impl, args.peer)
    points = sorted(set(old_t) & set(new_t), key=lambda p: (p[0], p[3], int(p[1]), int(p[2].split()[0]), p[2]))
    med = statistics.median
    print(f"{'mode':7} {'d':>4} {'seqlen':>6} {'causal':6} {'old ms':>8} {'new ms':>8} "
          f"{'time %':>7} {'vs ' + args.peer + ' %':>16} {'spread %':>8}")
    groups = defaultdict(lambda: ([], []))
    spreads = []
    for p in points:
        o, n = med(old_t[p]), med(new_t[p])
        dt = (n / o - 1) * 100
        dr = (med(new_rel[p]) / med(old_rel[p]) - 1) * 100 if old_rel[p] and new_rel[p] else float("nan")
        sp = max((max(v) / min(v) - 1) * 100 for v in (old_t[p], new_t[p]))
        spreads.append(sp)
        groups[(p[0], p[3])][0].append(dt)
        groups[(p[0], p[3])][1].append(dr)
        print(f"{p[0]:7} {p[1]:>4} {p[2]:>6} {p[3]:6} {o:8.3f} {n:8.3f} {dt:+7.1f} {dr:+16.1f} {sp:8.1f}")
    print(f"\n{'mode':7} {'causal':6} {'points':>6} {'time: median':>13} {'range':>15} {'within 2%':>9} "
          f"{'ratio: median':>14} {'within 2%':>9}")
    for (mode, causal), (dts, drs) in sorted(groups.items()):
        within = lambda xs: sum(abs(x) <= 2 for x in xs)
        print(f"{mode:7} {causal:6} {len(dts):6} {med(dts):+12.1f}% {min(dts):+6.1f}..{max(dts):+6.1f}% "
              f"{within(dts):>5}/{len(dts):<3} {med(drs):+13.1f}% {within(drs):>5}/{len(drs):<3}")
    print(f"\nspread between runs of one build (max/min - 1 of a point's times): median "
          f"{med(spreads):.1f}%, max {max(spreads):.1f}% ({len(args.old)} old, {len(args.new)} new runs)")


if __name__ == "__main__":
    main()
