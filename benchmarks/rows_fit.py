"""How well the launcher's cost model picks between the tilings at M > 16, judged on a "rows" log.

    python benchmarks/rows_fit.py benchmarks/results/kernel_rows_nsplit_h200.log

The log (``cuda_kernel_harness rows``) times each case on the warp-specialized kernel's 16-row
tilings (the faster of V0 and V1) and on its N-split tiling (V2: 32-row blocks up to M = 32,
64-row blocks above). This script mirrors ``Launcher::plan`` in ``cpp/cuda/matmul_fused.cuh``
(column groups, chunks, and ``ksplit_fit.split_plan``'s k-split search with ``item_end`` 0.5 at
size 1 and 1 + size / 2 above, the resident clusters per size of ``kernel_sweep_h200.log``),
prices V2's chunk at ``c4`` (MT = 4) or ``c8`` (MT = 8) V0 chunks, times ``c5`` at bits 5, and
scores each (c4, c8, c5) by the measured time of the tiling it picks against the faster of the
two: geometric-mean and worst ratio. Prints the best few and the cases the best one gets wrong.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os

import ksplit_fit

SWEEP_LOG = os.path.join(os.path.dirname(__file__), "results", "kernel_sweep_h200.log")


def item_end(ks: int) -> float:  # Launcher::plan, warp-specialized kernel
    return 0.5 if ks == 1 else 1 + 0.5 * ks


def plan_cost(k: int, n: int, m: int, bits: int, tiling: str, resident) -> float:
    """The plan's critical path in the tiling's own chunks (before the chunk-cost factor)."""
    if tiling == "v0":
        kch, cols, rows = 16, 32, 16
    elif tiling == "v1":
        kch, cols, rows = 16, 32 if bits == 5 else 64, 16
    else:  # v2: 8 warps x 16-column tiles (2 per warp, bits 5: 1), 2 k-blocks per chunk
        kch, cols, rows = 2, 16 * (1 if bits == 5 else 2) * 8, 32 if m <= 32 else 64
    items = math.ceil(n / cols) * math.ceil(m / rows)
    return ksplit_fit.split_plan(k // 32, kch, items, resident, item_end)[0]


def parse(path: str):
    cases = []
    for line in open(path):
        if line.startswith("ROWS"):
            f = line.split()
            cases.append((f[1], int(f[2]), int(f[3]), int(f[4]), int(f[5]), float(f[6]), float(f[7])))
    return cases


def plan_costs(cases, resident):
    """Per case: the 16-row tilings' cost (the launcher's V0/V1 choice) and V2's before its factor."""
    costs = []
    for _, k, n, bits, m, _, _ in cases:
        v1_factor = 1.0 if bits == 5 else 1.4
        rows16 = min(plan_cost(k, n, m, bits, "v0", resident), plan_cost(k, n, m, bits, "v1", resident) * v1_factor)
        costs.append((rows16, plan_cost(k, n, m, bits, "v2", resident)))
    return costs


def picks_nsplit(case, cost, c4: float, c8: float, c5: float) -> bool:
    _, _, _, bits, m, _, _ = case
    rows16, nsplit = cost
    return nsplit * (c4 if m <= 32 else c8) * (c5 if bits == 5 else 1.0) < rows16


def score(cases, costs, c4, c8, c5):
    logs, worst = [], (1.0, "")
    for case, cost in zip(cases, costs):
        name, k, n, bits, m, us16, us_ns = case
        ratio = (us_ns if picks_nsplit(case, cost, c4, c8, c5) else us16) / min(us16, us_ns)
        logs.append(math.log(ratio))
        worst = max(worst, (ratio, f"{name} bits={bits} M={m}"))
    return math.exp(sum(logs) / len(logs)), worst


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    args = p.parse_args()
    cases = parse(args.log)
    costs = plan_costs(cases, ksplit_fit.parse(SWEEP_LOG)[1])
    grid = [(c4 / 10, c8 / 10, c5 / 10) for c4, c8, c5 in
            itertools.product(range(5, 31), range(5, 41), range(4, 13))]
    scored = sorted((score(cases, costs, *c), c) for c in grid)
    print(f"{len(cases)} cases; best (c4, c8, c5) by geometric-mean ratio to the faster tiling:")
    for (mean, (worst, where)), c in scored[:6]:
        print(f"  c4={c[0]:.1f} c8={c[1]:.1f} c5={c[2]:.1f}  mean {mean:.4f}  worst {worst:.3f} ({where})")
    c = scored[0][1]
    for case, cost in zip(cases, costs):
        name, k, n, bits, m, us16, us_ns = case
        ns = picks_nsplit(case, cost, *c)
        if (us_ns if ns else us16) > 1.03 * min(us16, us_ns):
            print(f"  miss: {name} bits={bits} M={m} picks {'N-split' if ns else '16-row'}: "
                  f"16-row {us16:.1f} us, N-split {us_ns:.1f} us")


if __name__ == "__main__":
    main()
