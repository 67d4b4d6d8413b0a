"""Fit the launcher's tiling prices at M = 9..16 (one block of 16 rows) on harness "tiles" logs.

The warp-specialized kernel plans every tiling at MT = 2 (matmul_fused.cuh, launch_fused_bits):
V0 (32 columns, 16 warps), V1 (64 columns at bits 2..4), V4 (bits 5's 64 columns) and the
N-split tiling V2, each plan's cost being chunks on its critical path times the tiling's chunk
price (Config::chunk_cost, in V0 chunks). A "TILES" line holds every tiling forced, with its
plan cost and price, so the plan can be replayed offline at other prices: the cost over the price
is the plan's chunk count. V2's count also holds its cluster's item end, 1 + r ks chunks
(Launcher::plan's nsplit_rank_end = r), which is rebuilt here from the line (ks, CTAs) to fit r:
items = ceil(N / 256), clusters = CTAs / ks, chunks = ceil(ceil(K / 32 / ks) / 2).

For each bits value it grid-searches V1's price p1 (bits 2..4), V2's price pn and r, and prints
the launcher's pick against the fastest forced tiling (geometric mean and worst), with the count
of cases whose pick would get more than 3 % slower than today's pick ("worse").

    python benchmarks/tiles_price_fit.py benchmarks/results/tiles_h200_s50_old_bf16_{1,2}.log
    python benchmarks/tiles_price_fit.py --f16 benchmarks/results/tiles_h200_s50_old_f16_1.log
"""
from __future__ import annotations

import argparse
import math


def read_tiles(path):
    """{(shape, K, N, bits, M): (pick us, pick label, {"v0": (us, "ks/ctas", cost, price), ...})}"""
    cases = {}
    with open(path) as log:
        for line in log:
            if not line.startswith("TILES"):
                continue
            f = line.split()
            forced = {f[i]: (float(f[i + 1]), f[i + 2], float(f[i + 3]), float(f[i + 4])) for i in range(8, len(f), 5)}
            cases[(f[1], int(f[2]), int(f[3]), int(f[4]), int(f[5]))] = (float(f[6]), f[7], forced)
    return cases


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


class Case:
    """One shape, bits and M over several runs: each tiling's faster time and its plan's chunks."""

    def __init__(self, key, runs):
        self.key, self.bits = key, key[3]
        forced = runs[0][key][2]
        self.us = {v: min(run[key][2][v][0] for run in runs) for v in forced}
        self.chunks = {v: cost / price for v, (_, _, cost, price) in forced.items()}
        self.picked = runs[0][key][1].split("/")[0]
        _, k, n, _, _ = key
        ks, ctas = map(int, forced["v2"][1].split("/"))
        self.v2 = (math.ceil(math.ceil(n / 256) / (ctas // ks)), math.ceil(math.ceil(k / 32 / ks) / 2), ks)

    def pick(self, p1, pn, r, pw=1.72):
        """launch_fused_bits's choice at MT = 2 with these prices (V1 ties go to V1)."""
        cost = {"v0": self.chunks["v0"], "v1": self.chunks["v1"] * (p1 if self.bits != 5 else 1.0)}
        per, chunks, ks = self.v2
        cost["v2"] = per * (chunks + (0.5 if ks == 1 else 1.0 + r * ks)) * pn
        best = "v1" if cost["v1"] <= cost["v0"] else "v0"
        if "v4" in self.chunks:
            cost["v4"] = self.chunks["v4"] * pw
            best = "v4" if cost["v4"] < cost[best] else best
        return "v2" if cost["v2"] < cost[best] else best


def score(cases, p1, pn, r):
    regret = [c.us[c.pick(p1, pn, r)] / min(c.us.values()) for c in cases]
    worse = sum(c.us[c.pick(p1, pn, r)] > 1.03 * c.us[c.picked] for c in cases)
    return geomean(regret), max(regret), worse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("logs", nargs="+", help="harness 'tiles' logs of one build and dtype")
    ap.add_argument("--f16", action="store_true", help="the logs time fp16 (today's fp16 prices)")
    args = ap.parse_args()
    runs = [read_tiles(p) for p in args.logs]
    cases = [Case(key, runs) for key in runs[0]]
    today = {2: 0.61, 3: 0.8, 4: 0.61, 5: 0.95} if args.f16 else {2: 0.6, 3: 0.8, 4: 0.6, 5: 0.8}
    for bits in (2, 3, 4, 5):
        sub = [c for c in cases if c.bits == bits]
        g, m, _ = score(sub, 1.4, today[bits], 0.5)
        grid = [(score(sub, p1, pn, r), p1, pn, r)
                for r in (0.5, 0.75, 1.0, 1.5)
                for p1 in ([1.0 + 0.05 * i for i in range(11)] if bits != 5 else [1.0])
                for pn in [0.3 + 0.0125 * i for i in range(49)]]
        grid.sort(key=lambda e: (e[0][2] > 0, e[0][0]))
        (bg, bm, bw), p1, pn, r = grid[0]
        print(f"bits {bits}: session 49's prices (V1 {1.4 if bits != 5 else 1.0}, V2 {today[bits]}, r 0.5) {g:.4f}x the fastest, worst {m:.3f}x;"
              f" best (none >3 % worse): V1 {p1:.2f}, V2 {pn:.4f}, r {r:.2f}: {bg:.4f}x, worst {bm:.3f}x")


if __name__ == "__main__":
    main()
