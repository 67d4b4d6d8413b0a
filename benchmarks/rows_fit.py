"""How well the launcher's cost model picks between the tilings, judged on a "rows" log.

    python benchmarks/rows_fit.py benchmarks/results/kernel_rows_nsplit_h200.log

The log (``cuda_kernel_harness rows``) times each case on the warp-specialized kernel's 16-row
tilings (the faster of V0 and V1) and on its N-split tiling (V2: 16-row blocks up to M = 16,
32-row blocks up to M = 32, 64-row blocks above; session 28's log at M <= 8 ran 8-row blocks,
since dropped). This script mirrors ``Launcher::plan`` and ``launch_fused_bits`` in
``cpp/cuda/matmul_fused.cuh`` (column groups, chunks, and ``ksplit_fit.split_plan``'s k-split
search with ``item_end`` 0.5 at size 1 and 1 + size / 2 above, the resident clusters per size of
``kernel_sweep_h200.log``; no V2 at M <= 8), prices V2's chunk at ``c2``, ``c4`` or ``c8`` V0
chunks of the same block of rows (MT = 2, 4, 8), times a multiple for the bits the launcher
prices apart (bits 3 at MT = 2, bits 5 at MT = 4 and 8), and scores each choice of the prices
that the log's M need by the measured time of the tiling it picks against the faster of the two:
geometric-mean and worst ratio. Prints the best few and the cases the best one gets wrong.

It mirrors the launcher of the logs it was fitted on, not today's: since session 31 the N-split
tiling at 32 rows ends an item in 1 + 1.25 chunks per rank (results/last_block_s31_fit.py), and
since session 33 it has two tiles per warp at bits 5 too, priced like the other bits
(results/nsplit_bits5_s33_fit.py scores that on the H200's rows). Logs from session 42 on carry
the launcher's own plan costs; `nsplit_price_fit.py` fits the prices on those exactly.
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


def m_tiles(m: int) -> int:
    """n8 tiles of the N-split tiling's block of rows (matmul_fused.cuh: with_nsplit)."""
    return 2 if m <= 16 else 4 if m <= 32 else 8


def plan_cost(k: int, n: int, m: int, bits: int, tiling: str, resident) -> float:
    """The plan's critical path in the tiling's own chunks (before the chunk-cost factor)."""
    if tiling in ("v0", "v1"):  # 16 k-blocks per chunk; 64 columns at 8 rows, and V1's at 16
        wide = m <= 8 or tiling == "v1"
        kch, cols, rows = 16, 32 if bits == 5 or not wide else 64, 8 if m <= 8 else 16
    else:  # v2: 8 warps x 16-column tiles (2 per warp, bits 5: 1), 2 k-blocks per chunk
        kch, cols, rows = 2, 16 * (1 if bits == 5 else 2) * 8, 8 * m_tiles(m)
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
    """Per case: the 16-row tilings' cost (the launcher's V0/V1 choice; V1 alone at M <= 8) and
    V2's before its factor."""
    costs = []
    for _, k, n, bits, m, _, _ in cases:
        v1 = plan_cost(k, n, m, bits, "v1", resident)
        if m <= 8:
            rows16 = v1
        else:
            # (V1's chunk at 1.4 V0 chunks; at 16 rows the launcher prices bits 2 and 4 at 1.0 since
            # session 50, with V2's price refitted with it: tiles_price_fit.py)
            rows16 = min(plan_cost(k, n, m, bits, "v0", resident), v1 * (1.0 if bits == 5 else 1.4))
        costs.append((rows16, plan_cost(k, n, m, bits, "v2", resident)))
    return costs


#: The factors a fit may vary, by the n8 tiles of V2's block of rows, with their grids (tenths).
FACTOR_GRID = {2: range(4, 31), 4: range(5, 31), 8: range(5, 41)}
#: The bits whose chunk the launcher prices apart at each block of rows (Config::chunk_cost: bits 3
#: at 16 rows, bits 5 at 32 and 64), as a multiple of the block's factor; its grid (tenths).
MODIFIED_BITS = {2: 3, 4: 5, 8: 5}
MODIFIER_GRID = range(4, 21)


def price(bits: int, m: int, factors: dict, modifiers: dict) -> float:
    """V2's chunk price in V0 chunks. factors: {n8 tiles (2, 4, 8): price}; modifiers: {bits:
    multiple} for the bits MODIFIED_BITS names at that block (a missing one is 1)."""
    t = m_tiles(m)
    return factors[t] * (modifiers.get(bits, 1.0) if bits == MODIFIED_BITS[t] else 1.0)


def picks_nsplit(case, cost, factors: dict, modifiers: dict) -> bool:
    """Whether the launcher's plans take V2 (never at M <= 8, where it keeps V1)."""
    _, _, _, bits, m, _, _ = case
    rows16, nsplit = cost
    return m > 8 and nsplit * price(bits, m, factors, modifiers) < rows16


def score(cases, costs, factors, modifiers):
    logs, worst = [], (1.0, "")
    for case, cost in zip(cases, costs):
        name, k, n, bits, m, us16, us_ns = case
        ratio = (us_ns if picks_nsplit(case, cost, factors, modifiers) else us16) / min(us16, us_ns)
        logs.append(math.log(ratio))
        worst = max(worst, (ratio, f"{name} bits={bits} M={m}"))
    return math.exp(sum(logs) / len(logs)), worst


def fit(cases, costs):
    """Every combination of the factors and modifiers the cases need, best first (the smallest
    values first among equal scores): [((mean, (worst, where)), factors, modifiers)]."""
    tiles = sorted({m_tiles(c[4]) for c in cases})
    mod_bits = sorted({MODIFIED_BITS[t] for t in tiles})
    grids = [[g / 10 for g in FACTOR_GRID[t]] for t in tiles] + [[g / 10 for g in MODIFIER_GRID]] * len(mod_bits)
    scored = []
    for combo in itertools.product(*grids):
        factors = dict(zip(tiles, combo[:len(tiles)]))
        modifiers = dict(zip(mod_bits, combo[len(tiles):]))
        scored.append((score(cases, costs, factors, modifiers), factors, modifiers))
    scored.sort(key=lambda s: (s[0], sorted(s[1].items()), sorted(s[2].items())))
    return scored


def label(factors: dict, modifiers: dict) -> str:
    return " ".join([f"c{t}={v:.1f}" for t, v in sorted(factors.items())] +
                    [f"bits{b}x{v:.1f}" for b, v in sorted(modifiers.items())])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    args = p.parse_args()
    cases = parse(args.log)
    costs = plan_costs(cases, ksplit_fit.parse(SWEEP_LOG)[1])
    scored = fit(cases, costs)
    print(f"{len(cases)} cases; best prices (c<n8 tiles>, bits<b>x<multiple>) by geometric-mean ratio "
          "to the faster tiling:")
    for (mean, (worst, where)), factors, modifiers in scored[:6]:
        print(f"  {label(factors, modifiers)}  mean {mean:.4f}  worst {worst:.3f} ({where})")
    _, factors, modifiers = scored[0]
    for case, cost in zip(cases, costs):
        name, k, n, bits, m, us16, us_ns = case
        ns = picks_nsplit(case, cost, factors, modifiers)
        if (us_ns if ns else us16) > 1.03 * min(us16, us_ns):
            print(f"  miss: {name} bits={bits} M={m} picks {'N-split' if ns else '16-row'}: "
                  f"16-row {us16:.1f} us, N-split {us_ns:.1f} us")


if __name__ == "__main__":
    main()
