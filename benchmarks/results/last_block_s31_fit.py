"""Session 31, offline: the launcher's choice between the 16-row tilings and the N-split tiling
(blocks of 32 rows) at M = 17..32, scored on harness "rows" logs by benchmarks/rows_fit.py's
replica of Launcher::plan (resident clusters from the H200 sweep log), for
  HEAD            the N-split tiling's item end 1 + 0.5 chunks per rank, chunk price 1.0 (bits 5: 0.6)
  patch           1 + 1.25 chunks per rank, chunk price 0.9 (bits 5: 0.63; the replica's 0.7 x 0.9)
  patch+pen P     and the 16-row tilings' cost x P where their last block of M has one row (M = 17)
Prints, per M, the geometric mean of (picked tiling's time / faster tiling's time) and the worst
case. Only M = 17..32 (the N-split tiling in blocks of 32 rows) is scored.
Run from benchmarks/ (each log holds several rounds; medians per case):
    python3 results/last_block_s31_fit.py results/last_block_h100_s31_v2cost_rows_new.log
"""
import collections
import math
import statistics
import sys

sys.path.insert(0, '.')
import ksplit_fit  # noqa: E402
import rows_fit as R  # noqa: E402

resident = ksplit_fit.parse(R.SWEEP_LOG)[1]
times = collections.defaultdict(list)
for line in open(sys.argv[1]):
    if line.startswith("ROWS "):
        p = line.split()
        times[(p[1], int(p[2]), int(p[3]), int(p[4]), int(p[5]))].append((float(p[6]), float(p[7])))
cases = [(*key, statistics.median(t[0] for t in v), statistics.median(t[1] for t in v))
         for key, v in times.items() if 16 < key[4] <= 32]


def plan_v2(k, n, m, bits, slope):
    kch, cols, rows = 2, 16 * (1 if bits == 5 else 2) * 8, 8 * R.m_tiles(m)
    items = math.ceil(n / cols) * math.ceil(m / rows)
    end = lambda ks: 0.5 if ks == 1 else 1 + slope * ks  # noqa: E731
    return ksplit_fit.split_plan(k // 32, kch, items, resident, end)


for label, slope, c4, b5, pen in [("HEAD", 0.5, 1.0, 0.6, 1.0), ("patch", 1.25, 0.9, 0.7, 1.0),
                                   ("patch+pen 1.2", 1.25, 0.9, 0.7, 1.2), ("patch+pen 1.5", 1.25, 0.9, 0.7, 1.5)]:
    by_m, worst = collections.defaultdict(list), (0.0, "")
    for name, k, n, bits, m, us16, usn in cases:
        v1 = R.plan_cost(k, n, m, bits, "v1", resident)
        r16 = min(R.plan_cost(k, n, m, bits, "v0", resident), v1 * (1.0 if bits == 5 else 1.4))
        if m % 16 == 1:
            r16 *= pen
        cost2 = plan_v2(k, n, m, bits, slope)[0] * c4 * (b5 if bits == 5 else 1.0)
        ratio = (usn if cost2 < r16 else us16) / min(us16, usn)
        by_m[m].append(math.log(ratio))
        worst = max(worst, (ratio, f"{name} bits {bits} M {m}"))
    means = {m: round(math.exp(sum(v) / len(v)), 4) for m, v in sorted(by_m.items())}
    print(f"{label:14s} {means}  worst {worst[0]:.3f} ({worst[1]})")
