"""Session 47, harness `wgplans` A/Bs, two runs of each tree, alternating in one call: the wgmma
kernel's 64-column tile against the session's start (9b642d0) on an H100 and on an H200
(wgmma64_{h100,h200}_s47_wgplans_{base,new}{1,2}.log), and its divisions by launch constants
(FastDiv) against the tree before them (fastdiv_h200_s47_wgplans_{base,new}{1,2}.log).

Prints, per row tile x column tile, the new tree's time over the base's for the same forced
configuration (the 128- and 256-column tiles: their epilogue changed too, each warpgroup pair
now stages its own tile), the spread between the base's two runs, and per shape the launcher's
pick (WGPICK) new over base.

    python3 benchmarks/results/wgmma64_s47_ab.py [PREFIX ...]   (default: wgmma64_h100_s47
                                                                 wgmma64_h200_s47 fastdiv_h200_s47)
"""

import collections
import math
import os
import sys


def load(path):
    """WGPLAN times by (shape, bits, M, rows, columns) and WGPICK (rows, columns, us) by case;
    the base harness prints J (1 or 2 m64 tiles per warpgroup) where the new one prints columns."""
    plan, pick = {}, {}
    for line in open(path):
        f = line.split()
        if not f or f[0] not in ("WGPLAN", "WGPICK"):
            continue
        cols = int(f[7])
        cols = 128 * cols if cols in (1, 2) else cols
        case = (f[1], int(f[4]), int(f[5]))
        if f[0] == "WGPLAN":
            plan[case + (int(f[6]), cols)] = float(f[-1])
        else:
            pick[case] = (int(f[6]), cols, float(f[-1]))
    return plan, pick


def gmean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


def main(prefix, d):
    print(f"== {prefix}")
    base = [load(os.path.join(d, f"{prefix}_wgplans_base{i}.log")) for i in (1, 2)]
    new = [load(os.path.join(d, f"{prefix}_wgplans_new{i}.log")) for i in (1, 2)]
    same = collections.defaultdict(list)
    for k in base[0][0]:
        if all(k in r[0] for r in base + new):
            b = sum(r[0][k] for r in base) / 2
            n = sum(r[0][k] for r in new) / 2
            same[(k[3], k[4], "M <= 64" if k[2] <= 64 else "M > 64")].append(n / b)
    for (rows, cols, band), r in sorted(same.items()):
        print(f"same tile {rows} x {cols} {band}: {len(r)} cases, new / base {gmean(r):.3f} "
              f"({min(r):.3f}..{max(r):.3f})")
    spread = [base[1][0][k] / base[0][0][k] for k in base[0][0] if k in base[1][0]]
    print(f"base run 2 / run 1: {gmean(spread):.3f} ({min(spread):.3f}..{max(spread):.3f})")
    picks = collections.defaultdict(list)
    for k in base[0][1]:
        b = sum(r[1][k][2] for r in base) / 2
        n = sum(r[1][k][2] for r in new) / 2
        picks[(k[0], "M <= 64" if k[2] <= 64 else "M > 64")].append(n / b)
    for (shape, band), r in sorted(picks.items()):
        print(f"pick {shape:20s} {band}: new / base {gmean(r):.3f} ({min(r):.3f}..{max(r):.3f})")
    every = [x for r in picks.values() for x in r]
    print(f"every pick: {len(every)} cases, new / base {gmean(every):.3f}")


if __name__ == "__main__":
    for prefix in sys.argv[1:] or ["wgmma64_h100_s47", "wgmma64_h200_s47", "fastdiv_h200_s47"]:
        main(prefix, os.path.dirname(os.path.abspath(__file__)))
