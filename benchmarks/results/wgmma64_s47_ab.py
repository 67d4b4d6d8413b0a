"""Session 47: the wgmma kernel's 64-column tile, harness `wgplans` of this tree against the
session's start (9b642d0), two runs each, alternating, on an H100 and on an H200
(wgmma64_{h100,h200}_s47_wgplans_{base,new}{1,2}.log).

Prints, per row tile x column tile, the new tree's time over the base's for the same forced
configuration (the 128- and 256-column tiles: their epilogue changed too, each warpgroup pair
now stages its own tile), the spread between the base's two runs, and per shape the launcher's
pick (WGPICK) new over base.

    python3 benchmarks/results/wgmma64_s47_ab.py [CARD] [DIR]   (CARD h100 or h200, default both;
                                                                 DIR: where the logs are, default here)
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


def main(card, d):
    print(f"== {card}")
    base = [load(os.path.join(d, f"wgmma64_{card}_s47_wgplans_base{i}.log")) for i in (1, 2)]
    new = [load(os.path.join(d, f"wgmma64_{card}_s47_wgplans_new{i}.log")) for i in (1, 2)]
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
    cards = [sys.argv[1]] if len(sys.argv) > 1 else ["h100", "h200"]
    for c in cards:
        main(c, sys.argv[2] if len(sys.argv) > 2 else os.path.dirname(os.path.abspath(__file__)))
