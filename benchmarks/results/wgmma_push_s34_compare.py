"""Session 34's A/B tables (benchmarks/results/wgmma_push_h200_s34.md) from its harness logs.

Three builds timed in one call on an H200, alternately, two rounds each: `base` (HEAD before the
session), `pin` (+ the decode's lane constants pinned in registers), `new` (+ the cluster sum by
push). `rows` logs: the harness's "rows" mode at M = 33..128, bits 2-5 (its "default" column, the
launcher's own choice); `split` logs: "split" at M = 192..1024, bits 2, 4, 5 (its default column).
Each case's median over the rounds, then ratios; geometric means by M and by shape.

    python3 benchmarks/results/wgmma_push_s34_compare.py
"""

import collections
import math
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))


def load(mode, build):
    col = 8 if mode == "rows" else 7  # ROWS ... <default us> is field 8; SPLIT ... <default us> field 7
    tag = "ROWS" if mode == "rows" else "SPLIT"
    d = collections.defaultdict(list)
    for line in open(os.path.join(HERE, f"wgmma_push_h200_s34_{mode}_{build}.log")):
        p = line.split()
        if p and p[0] == tag:
            d[(p[1], int(p[4]), int(p[5]))].append(float(p[col]))
    return {k: statistics.median(v) for k, v in d.items()}


def geo(v):
    return math.exp(sum(map(math.log, v)) / len(v))


def compare(mode, num, den):
    a, b = load(mode, num), load(mode, den)
    ratios = {k: a[k] / b[k] for k in b if k in a}
    by_m, by_shape = collections.defaultdict(list), collections.defaultdict(list)
    for (shape, _, m), r in ratios.items():
        by_m[m].append(r)
        by_shape[shape].append(r)
    print(f"{mode}: {num} / {den}, {len(ratios)} cases, geometric mean {geo(list(ratios.values())):.3f}")
    for m, v in sorted(by_m.items()):
        print(f"  M = {m:4d}: {geo(v):.3f} ({min(v):.3f}-{max(v):.3f})")
    for s, v in sorted(by_shape.items()):
        print(f"  {s:20s} {geo(v):.3f} ({min(v):.3f}-{max(v):.3f})")


if __name__ == "__main__":
    for mode in ("rows", "split"):
        for num, den in (("pin", "base"), ("new", "pin"), ("new", "base")):
            compare(mode, num, den)
