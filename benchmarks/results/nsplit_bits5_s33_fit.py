"""Session 33, offline: the N-split tiling's chunk price at bits 5 now that it has two 16-column
tiles per warp (Config::Path, the 16-copy table), scored on the H200's harness "rows" log by
benchmarks/rows_fit.py's replica of Launcher::plan (resident clusters from the H200 sweep log):
256-column groups, item end 1 + 0.5 chunks per rank at 16 rows and 1 + 1.25 at 32, the 16-row
tilings at their own cost (bits 5's V1 keeps 32 columns: price 1.0). For each price, per block
of rows, the geometric mean of (picked tiling's time / faster tiling's time) and the worst case;
then, at the prices taken (0.8 at 16 rows, 0.9 at 32), each case's pick against the base
build's default time (the second log).
Run from benchmarks/:
    python3 results/nsplit_bits5_s33_fit.py results/nsplit_bits5_h200_s33_rows_new.log \
        results/nsplit_bits5_h200_s33_rows_base.log
"""
import collections
import math
import statistics
import sys

sys.path.insert(0, '.')
import ksplit_fit  # noqa: E402
import rows_fit as R  # noqa: E402

resident = ksplit_fit.parse(R.SWEEP_LOG)[1]


def medians(path, columns):
    times = collections.defaultdict(list)
    for line in open(path):
        if line.startswith("ROWS "):
            p = line.split()
            times[(p[1], int(p[2]), int(p[3]), int(p[4]), int(p[5]))].append([float(p[c]) for c in columns])
    return {k: [statistics.median(t[i] for t in v) for i in range(len(columns))] for k, v in times.items()}


def plan_v2(k, n, m):
    rows = 8 * R.m_tiles(m)
    items = math.ceil(n / 256) * math.ceil(m / rows)
    slope = 1.25 if rows == 32 else 0.5
    return ksplit_fit.split_plan(k // 32, 2, items, resident, lambda ks: 0.5 if ks == 1 else 1 + slope * ks)[0]


def plan_16_rows(k, n, m, bits):
    return min(R.plan_cost(k, n, m, bits, "v0", resident), R.plan_cost(k, n, m, bits, "v1", resident))


new = medians(sys.argv[1], (6, 7))  # 16-row us, N-split us
base = medians(sys.argv[2], (8,))   # the base build's default us
cases = sorted((key, *t) for key, t in new.items() if 8 < key[4] <= 32)
for lo, hi in [(9, 16), (17, 32)]:
    print(f"M {lo}..{hi}")
    for c10 in range(4, 21):
        c, logs, worst = c10 / 10, [], (1.0, "")
        for (name, k, n, bits, m), us16, usn in cases:
            if not lo <= m <= hi:
                continue
            r = (usn if plan_v2(k, n, m) * c < plan_16_rows(k, n, m, bits) else us16) / min(us16, usn)
            logs.append(math.log(r))
            worst = max(worst, (r, f"{name} M{m}"))
        print(f"  price {c:.1f}: mean {math.exp(sum(logs) / len(logs)):.4f}, worst {worst[0]:.3f} ({worst[1]})")
print("picks at 0.8 (16 rows) and 0.9 (32 rows), against the base build's default time")
by_m = collections.defaultdict(list)
for (name, k, n, bits, m), us16, usn in cases:
    nsplit = plan_v2(k, n, m) * (0.8 if m <= 16 else 0.9) < plan_16_rows(k, n, m, bits)
    t, b = (usn if nsplit else us16), base[(name, k, n, bits, m)][0]
    by_m[m].append(t / b)
    print(f"  {name:18s} M {m:2d} {'N-split' if nsplit else '16-row '} {t:7.2f} us, base {b:7.2f}: {t / b:.3f}")
for m, v in sorted(by_m.items()):
    print(f"M = {m}: geometric mean {math.exp(sum(map(math.log, v)) / len(v)):.3f}, {min(v):.3f}-{max(v):.3f}")
