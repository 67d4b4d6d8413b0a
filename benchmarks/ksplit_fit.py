"""How well a k-split cost model picks cluster sizes, judged on the harness's "sweep" log.

    python benchmarks/ksplit_fit.py benchmarks/results/kernel_sweep_h200.log [--a 1 --b 0.5]

The log (``cuda_kernel_harness sweep``) times every case at its default cluster size and at
each forced size 1..8. This script mirrors the warp-specialized kernel's launcher
(``Launcher::plan`` in ``cpp/cuda/matmul_fused.cuh``: column groups of 16 * TN columns, chunks
of 16 k-blocks, ranks given whole chunks, a size that would leave a rank empty skipped, the
resident clusters per size as the log's CTA counts show) and scores the model
``cost = items per cluster * (chunks per item + item_end)``, with ``item_end`` 0.5 at size 1 and
``a + b * size`` above: the measured time of the size it picks against the case's fastest size.
It also prints the grid of (a, b) by mean regret, and the cases whose pick changes against the
log's default (the launcher that ran), with both measured times. The committed log's M = 16
lines ran the 32-column tiling (V0), which the mirror models; since session 6 the launcher may
take the 64-column one there (see ``Config::chunk_cost``).
"""

from __future__ import annotations

import argparse
import math
from collections import defaultdict


#: The rows of the warp-specialized kernel's M <= 16 tilings, the launcher this script mirrors;
#: a sweep at larger M (KBIT_HARNESS_SWEEP_M) times other launchers (N-split tiling, wgmma).
MAX_M = 16


def parse(path: str):
    """Cases (K, N, bits, M, name, default k_split, {size: us}) with M <= MAX_M, and the resident
    clusters per size."""
    cases, resident = [], defaultdict(int)
    for line in open(path):
        if not line.startswith("SWEEP"):
            continue
        f = line.split()
        name, k, n, bits, m, default_ks = f[1], int(f[2]), int(f[3]), int(f[4]), int(f[5]), int(f[7])
        if m > MAX_M:
            continue
        times = {}
        for forced, tok in enumerate(f[9:17], start=1):
            us, ks, ctas = tok.split("/")
            resident[int(ks)] = max(resident[int(ks)], int(ctas) // int(ks))
            if int(ks) == forced:  # a size the launcher rejected ran as another one
                times[forced] = float(us)
        cases.append((k, n, bits, m, name, default_ks, times))
    return cases, dict(resident)


def split_plan(kb, kch, items, resident, item_end):
    """(cost, cluster size) of the launcher's k-split search: kb k-blocks in chunks of kch,
    ranks given whole chunks, a size that would leave a rank empty skipped, cost = items per
    cluster * (chunks per rank + item_end(size)), the first of equal costs."""
    best = None
    for ks in range(1, min(8, kb) + 1):
        kps = math.ceil(math.ceil(kb / ks) / kch) * kch
        if math.ceil(kb / kps) != ks:
            continue
        per_cluster = math.ceil(items / min(items, resident[ks]))
        cost = per_cluster * (kps // kch + item_end(ks))
        if best is None or cost < best[0] - 1e-9:
            best = (cost, ks)
    return best


def choose(k, n, bits, m, resident, item_end) -> int:
    """The cluster size the launcher's cost model picks (warp-specialized kernel, M <= 16)."""
    mt = 1 if m <= 8 else 2
    tn = (2 if bits == 5 else 4) if mt == 1 else 2
    items = math.ceil(n / (16 * tn)) * math.ceil(m / (8 * mt))
    return split_plan(k // 32, 16, items, resident, item_end)[1]


def score(cases, resident, item_end):
    """(geometric-mean regret, worst regret, the worst case) of the model's picks."""
    logs, worst = [], (1.0, None)
    for k, n, bits, m, name, _, times in cases:
        ratio = times[choose(k, n, bits, m, resident, item_end)] / min(times.values())
        logs.append(math.log(ratio))
        worst = max(worst, (ratio, f"{name} K={k} N={n} bits={bits} M={m}"), key=lambda w: w[0])
    return math.exp(sum(logs) / len(logs)), worst[0], worst[1]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    p.add_argument("--a", type=float, default=1.0)
    p.add_argument("--b", type=float, default=0.5)
    args = p.parse_args()
    cases, resident = parse(args.log)
    print(f"{len(cases)} cases; resident clusters per size: {resident}")
    if not cases:  # e.g. a sweep of KBIT_HARNESS_SWEEP_M above MAX_M only: nothing to score
        print(f"no SWEEP rows with M <= {MAX_M} in {args.log}")
        return
    grid = []
    for a in (0.5, 1.0, 1.5, 2.0, 3.0):
        for b in (0.0, 0.25, 0.5, 0.75, 1.0, 1.5):
            grid.append((*score(cases, resident, lambda ks, a=a, b=b: 0.5 if ks == 1 else a + b * ks), a, b))
    print("best (a, b) by mean regret:")
    for mean, worst, where, a, b in sorted(grid)[:8]:
        print(f"  a={a:<4} b={b:<5} mean {mean:.4f}  worst {worst:.3f} ({where})")
    model = lambda ks: 0.5 if ks == 1 else args.a + args.b * ks  # noqa: E731
    mean, worst, where = score(cases, resident, model)
    print(f"a={args.a} b={args.b}: mean regret {mean:.4f}, worst {worst:.3f} ({where})")
    print("cases whose pick differs from the log's default (measured us):")
    for k, n, bits, m, name, default_ks, times in cases:
        ks = choose(k, n, bits, m, resident, model)
        if ks != default_ks:
            print(f"  {name:18s} K={k:5d} N={n:5d} bits={bits} M={m:2d}: size {default_ks} -> {ks}: "
                  f"{times[default_ks]:7.2f} -> {times[ks]:7.2f} ({times[ks] / times[default_ks]:.3f}x)")


if __name__ == "__main__":
    main()
