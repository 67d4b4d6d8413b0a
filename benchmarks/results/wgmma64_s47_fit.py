"""Session 47 (H100): WgLauncher::cost's constants for the 64-column tile (kQuadFixed64 F,
kQuadKBlock64 s), fitted on harness `wgplans` at M = 17..64 (every column tile with its plan).

An offline replica of the choice among the 64-row tiles: cost = per_kblock (fixed + share kps)
waves (+ a pull's 2 + ks), per_kblock 0.8 at 128 and 64 columns and 1.0 at 256, with the
plan's cluster size from the log (kps = ceil(KB / ks), waves = ceil(CTAs / 132)). For each
(F, s) on a grid it prints the geometric mean and the worst of (the replica's pick's time /
the fastest tile's), and the same for the committed constants and without the 64-column tile.

    python3 benchmarks/results/wgmma64_s47_fit.py [LOG ...]   (default: this session's new logs)
"""

import collections
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
LOGS = [os.path.join(HERE, f"wgmma64_h100_s47_wgplans_{n}.log") for n in ("call1", "new1", "new2")]


def load(paths):
    """{(log, shape, bits, M): {columns: (us, ks, CTAs, sum)}} and {case: K}, 64-row tiles only."""
    cases, ks = collections.defaultdict(dict), {}
    for i, path in enumerate(paths):
        for line in open(path):
            f = line.split()
            if not f or f[0] != "WGPLAN" or int(f[6]) != 64:
                continue
            case = (i, f[1], int(f[4]), int(f[5]))
            ks[case] = int(f[2])
            cases[case][int(f[7])] = (float(f[-1]), int(f[8]), int(f[9]), f[11])
    return cases, ks


def cost(cols, ks, ctas, how, kb, fixed, share):
    kps, waves = math.ceil(kb / ks), math.ceil(ctas / 132)
    if cols == 256:
        return (35 + kps) * waves + (2 + ks if how == "pull" else 0)
    if cols == 128:
        return 0.8 * (35 + 0.65 * kps) * waves
    return 0.8 * (fixed + share * kps) * waves


def score(cases, ks, fixed, share):
    logs, worst = [], (1.0, None)
    for case, tiles in cases.items():
        best = min(t[0] for t in tiles.values())
        pick = min(tiles, key=lambda c: (cost(c, tiles[c][1], tiles[c][2], tiles[c][3], ks[case] // 32, fixed, share), -c))
        r = tiles[pick][0] / best
        logs.append(math.log(r))
        worst = max(worst, (r, case[1:]))
    return math.exp(sum(logs) / len(logs)), worst


def main(paths):
    cases, ks = load(paths)
    grid = sorted((score(cases, ks, f / 2, s / 100) + (f / 2, s / 100))
                  for f in range(50, 90) for s in range(20, 60))
    for g, (w, case), f, s in grid[:8]:
        print(f"fixed {f:.1f} share {s:.2f}: pick / fastest {g:.4f} on average, {w:.3f} at worst {case}")
    g, (w, case) = score(cases, ks, 35.0, 0.35)
    print(f"committed (35, 0.35): {g:.4f} on average, {w:.3f} at worst {case}")
    g, (w, case) = score(cases, ks, 1e9, 1.0)
    print(f"without the 64-column tile: {g:.4f} on average, {w:.3f} at worst {case}")


if __name__ == "__main__":
    main(sys.argv[1:] or LOGS)
