#!/usr/bin/env python3
"""Session 40's before/after figures, recomputed from the committed harness `wgplans` logs.

    python3 benchmarks/results/wgmma_tails_s40_compare.py BEFORE.log AFTER.log [--rows]

Each log holds the WGPLAN / WGPICK lines of one build (two rounds, concatenated). A case (layer,
bits, M) is timed by its WGPICK line (the launcher's own choice) and by the WGPLAN line of the same
tile; its time is the smallest of those over the rounds (the clocks drift within a run, and an
occasional launch reads 2x slow). Prints, per bits and M, the geometric mean of AFTER / BEFORE
over the 13 layers, with the range; the same over the cases whose picked tile is one this session
did not change in either build (128 x 256 and 256 x 128 at a full last row tile: the control for
drift between the builds' runs); and how far each build's pick is from its fastest tile.
`--rows` lists the cases that moved most.

The session's logs (benchmarks/results/wgmma_tails_s40.md):
    wgmma_tails_s40_h100_wgplans_start.log   wgmma_tails_s40_h100_wgplans_end.log     (H100)
    wgmma_tails_s40_h200_wgplans_start.log   wgmma_tails_s40_h200_wgplans_end.log     (H200)
    wgmma_tails_s40_h100_b5pairs_wgplans_base.log  ..._b5pairs_wgplans_pairs.log  (bits 5 only)
    wgmma_tails_s40_h100_wgplans_padded_x_base.log ..._wgplans_padded_x.log       (x's map padded)
"""

from __future__ import annotations

import argparse
import collections
import math


def load(path: str):
    """(layer, bits, M) -> (the pick's time, its tile (rows, J)), and -> the fastest tile's time."""
    pick_tile, pick_us, plan_us = {}, collections.defaultdict(list), collections.defaultdict(list)
    for line in open(path):
        f = line.split()
        if not f or f[0] not in ("WGPICK", "WGPLAN"):
            continue
        case = (f[1], int(f[4]), int(f[5]))
        if f[0] == "WGPICK":
            pick_tile[case] = (int(f[6]), int(f[7]))
            pick_us[case].append(float(f[8]))
        else:
            plan_us[(case, int(f[6]), int(f[7]))].append(float(f[12]))
    pick = {c: (min(pick_us[c] + plan_us.get((c,) + t, [])), t) for c, t in pick_tile.items()}
    fastest = collections.defaultdict(lambda: math.inf)
    for (c, _rows, _j), us in plan_us.items():
        fastest[c] = min(fastest[c], min(us))
    for c, (us, _tile) in pick.items():
        fastest[c] = min(fastest[c], us)
    return pick, fastest


def geomean(values: list[float]) -> float:
    return math.exp(sum(map(math.log, values)) / len(values))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--rows", action="store_true", help="list the cases that moved most")
    args = ap.parse_args(argv)
    (a, fast_a), (b, fast_b) = load(args.before), load(args.after)
    cases = sorted(set(a) & set(b))
    ratio = {c: b[c][0] / a[c][0] for c in cases}
    by = collections.defaultdict(list)
    for c in cases:
        by[(c[1], c[2])].append(ratio[c])
    for (bits, m), v in sorted(by.items()):
        print(f"bits {bits} M {m:4d}: {geomean(v):.3f}x  ({min(v):.3f}-{max(v):.3f}, {len(v)} layers)")
    print(f"all {len(cases)} cases: {geomean(list(ratio.values())):.3f}x")
    # The control: tiles without pairs (J = 2, or 256 rows) whose last row tile is full in both.
    full = [c for c in cases if a[c][1] == b[c][1] and (a[c][1][0] == 256 or a[c][1][1] == 2)
            and c[2] % a[c][1][0] == 0]
    if full:
        v = [ratio[c] for c in full]
        print(f"control ({len(full)} cases, unchanged tile, full row tiles): {geomean(v):.3f}x "
              f"({min(v):.3f}-{max(v):.3f})")
    for name, pick, fast in (("before", a, fast_a), ("after", b, fast_b)):
        off = {c: pick[c][0] / fast[c] for c in cases}
        worst = max(off, key=off.get)
        print(f"{name}: the pick {100 * (geomean(list(off.values())) - 1):.2f} % off the fastest tile on "
              f"(geometric) average, {100 * (off[worst] - 1):.1f} % at worst {worst}")
    if args.rows:
        moved = sorted(cases, key=lambda c: ratio[c])
        for c in moved[:8] + moved[-8:]:
            print(f"  {ratio[c]:.3f}  {c[0]:18s} bits {c[1]} M {c[2]:4d}: {a[c][0]:7.2f} us {a[c][1]} -> "
                  f"{b[c][0]:7.2f} us {b[c][1]}")


if __name__ == "__main__":
    main()
