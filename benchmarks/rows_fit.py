"""How well the launcher's cost model picks between the tilings at M > 16, judged on a "rows" log.

    python benchmarks/rows_fit.py benchmarks/results/kernel_rows_nsplit_h200.log

The log (``cuda_kernel_harness rows``) times each case on the warp-specialized kernel's 16-row
tilings (the faster of V0 and V1) and on its N-split tiling (V2: 32-row blocks up to M = 32,
64-row blocks above). This script mirrors ``Launcher::plan`` in ``cpp/cuda/matmul_fused.cuh``
(column groups, chunks, the k-split search with ``item_end`` 0.5 at size 1 and 1 + size / 2
above, the resident clusters per size of ``kernel_sweep_h200.log``), prices V2's chunk at
``c4`` (MT = 4) or ``c8`` (MT = 8) V0 chunks, times ``c5`` at bits 5, and scores each
(c4, c8, c5) by the measured time of the tiling it picks against the faster of the two:
geometric-mean and worst ratio. Prints the best few and the cases the best one gets wrong.
"""

from __future__ import annotations

import argparse
import itertools
import math

# Resident clusters per cluster size on the H200 (one CTA per SM), from kernel_sweep_h200.log.
RESIDENT = {1: 132, 2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}


def plan_cost(k: int, n: int, m: int, bits: int, tiling: str) -> float:
    """The plan's critical path in the tiling's own chunks (before the chunk-cost factor)."""
    kb = k // 32
    if tiling == "v0":
        kch, cols, rows = 16, 32, 16
    elif tiling == "v1":
        kch, cols, rows = 16, 32 if bits == 5 else 64, 16
    else:  # v2: 8 warps x 16-column tiles (2 per warp, bits 5: 1), 2 k-blocks per chunk
        kch, cols, rows = 2, 16 * (1 if bits == 5 else 2) * 8, 32 if m <= 32 else 64
    items = math.ceil(n / cols) * math.ceil(m / rows)
    best = math.inf
    for ks in range(1, min(8, kb) + 1):
        kps = math.ceil(math.ceil(kb / ks) / kch) * kch
        if math.ceil(kb / kps) != ks:
            continue
        per_cluster = math.ceil(items / min(items, RESIDENT[ks]))
        item_end = 0.5 if ks == 1 else 1 + 0.5 * ks
        best = min(best, per_cluster * (kps / kch + item_end))
    return best


def parse(path: str):
    cases = []
    for line in open(path):
        if line.startswith("ROWS"):
            f = line.split()
            cases.append((f[1], int(f[2]), int(f[3]), int(f[4]), int(f[5]), float(f[6]), float(f[7])))
    return cases


def picks_nsplit(case, c4: float, c8: float, c5: float) -> bool:
    _, k, n, bits, m, _, _ = case
    v1_factor = 1.0 if bits == 5 else 1.4
    rows16 = min(plan_cost(k, n, m, bits, "v0"), plan_cost(k, n, m, bits, "v1") * v1_factor)
    nsplit = plan_cost(k, n, m, bits, "v2") * (c4 if m <= 32 else c8) * (c5 if bits == 5 else 1.0)
    return nsplit < rows16


def score(cases, c4, c8, c5):
    logs, worst = [], (1.0, "")
    for case in cases:
        name, k, n, bits, m, us16, us_ns = case
        ratio = (us_ns if picks_nsplit(case, c4, c8, c5) else us16) / min(us16, us_ns)
        logs.append(math.log(ratio))
        worst = max(worst, (ratio, f"{name} bits={bits} M={m}"))
    return math.exp(sum(logs) / len(logs)), worst


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    args = p.parse_args()
    cases = parse(args.log)
    grid = [(c4 / 10, c8 / 10, c5 / 10) for c4, c8, c5 in
            itertools.product(range(5, 31), range(5, 41), range(4, 13))]
    scored = sorted((score(cases, *c), c) for c in grid)
    print(f"{len(cases)} cases; best (c4, c8, c5) by geometric-mean ratio to the faster tiling:")
    for (mean, (worst, where)), c in scored[:6]:
        print(f"  c4={c[0]:.1f} c8={c[1]:.1f} c5={c[2]:.1f}  mean {mean:.4f}  worst {worst:.3f} ({where})")
    c = scored[0][1]
    for case in cases:
        name, k, n, bits, m, us16, us_ns = case
        ns = picks_nsplit(case, *c)
        if (us_ns if ns else us16) > 1.03 * min(us16, us_ns):
            print(f"  miss: {name} bits={bits} M={m} picks {'N-split' if ns else '16-row'}: "
                  f"16-row {us16:.1f} us, N-split {us_ns:.1f} us")


if __name__ == "__main__":
    main()
