"""Session 30, offline: the launcher's choice at M = 17..32 (N-split tiling, MT = 4, against the
16-row tilings) with a steeper item-end cost per cluster rank for the N-split tiling, scored on a
harness "rows" log by benchmarks/rows_fit.py's replica of Launcher::plan (resident clusters from
the H200 sweep log). Run from benchmarks/:
    awk '$1=="ROWS" && $6==32' results/item_end_shared_h100_s30_rows_new.log > /tmp/rows32.log
    python3 results/v2_rows32_cost_s30_fit.py /tmp/rows32.log
Prints the best (slope, c4, bits-5 multiple) by geometric-mean ratio to the faster tiling, then
per case the cluster size and pick at slope 0.5 (now) and 1.25 (the patch)."""
import sys, math, itertools
sys.path.insert(0, '.')
import rows_fit as R, ksplit_fit
cases = R.parse(sys.argv[1])
resident = ksplit_fit.parse(R.SWEEP_LOG)[1]
def plan_v2(k, n, m, bits, slope):
    kch, cols, rows = 2, 16 * (1 if bits == 5 else 2) * 8, 8 * R.m_tiles(m)
    items = math.ceil(n / cols) * math.ceil(m / rows)
    end = lambda ks: 0.5 if ks == 1 else 1 + slope * ks
    return ksplit_fit.split_plan(k // 32, kch, items, resident, end)
res = []
for slope in [0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0]:
    for c4 in [0.8, 0.9, 1.0, 1.1, 1.2]:
        for b5 in [0.5, 0.6, 0.7]:
            logs = []; worst = (1, '')
            for c in cases:
                name, k, n, bits, m, us16, usn = c
                v1 = R.plan_cost(k, n, m, bits, "v1", resident)
                r16 = min(R.plan_cost(k, n, m, bits, "v0", resident), v1 * (1.0 if bits == 5 else 1.4))
                cost2 = plan_v2(k, n, m, bits, slope)[0] * c4 * (b5 if bits == 5 else 1.0)
                t = usn if cost2 < r16 else us16
                r = t / min(us16, usn); logs.append(math.log(r)); worst = max(worst, (r, f"{name} b{bits}"))
            res.append((math.exp(sum(logs)/len(logs)), worst, slope, c4, b5))
res.sort()
for r in res[:8]: print(f"mean {r[0]:.4f} worst {r[1][0]:.3f} {r[1][1]}  slope {r[2]} c4 {r[3]} b5 {r[4]}")
print("current:", [f"{r[0]:.4f} {r[1][0]:.3f}" for r in res if r[2]==0.5 and r[3]==1.0 and r[4]==0.6])
print("cluster-size changes at slope 1.25 vs 0.5:")
seen=set()
for c in cases:
    name, k, n, bits, m, us16, usn = c
    if (name,bits) in seen: continue
    seen.add((name,bits))
    a=plan_v2(k,n,m,bits,0.5); b=plan_v2(k,n,m,bits,1.25)
    v1 = R.plan_cost(k, n, m, bits, "v1", resident)
    r16 = min(R.plan_cost(k, n, m, bits, "v0", resident), v1 * (1.0 if bits == 5 else 1.4))
    old = a[0]*1.0*(0.6 if bits==5 else 1); new=b[0]*0.9*(0.7 if bits==5 else 1)
    print(f"  {name:18s} b{bits} ks {a[1]}->{b[1]}  pick {'v2' if old<r16 else '16'} -> {'v2' if new<r16 else '16'}  16-row {us16:.1f} v2 {usn:.1f}")
