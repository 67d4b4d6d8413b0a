"""Session 50: the launcher plans bits 5's 64-column tiling (V4) against V1 where V4's ring has 3
stages (M <= 3). Harness "wide5" logs at M = 1, 2, 3 summarized: per case the faster of the runs
of the launcher's pick and of V1 and V4 forced, by M, then every case.

    python benchmarks/results/wide5_m123_s50_summary.py
"""
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def columns(name):
    """{(shape, K, N, M): (pick time, pick label, {tiling: forced time})} of one log. A WIDE5 line
    is: name K N M, the pick's time and label, then per forced tiling: label, time and 3 plan
    fields (items/ncl, cost, price)."""
    cases = {}
    with open(os.path.join(HERE, name)) as log:
        for line in log:
            if line.startswith("WIDE5"):
                f = line.split()
                forced = dict(zip(f[7::5], map(float, f[8::5])))
                cases[(f[1], int(f[2]), int(f[3]), int(f[4]))] = (float(f[5]), f[6], forced)
    return cases


def geomean(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


for dtype, runs in (("bf16", (1, 2)), ("f16", (1,))):
    logs = [columns(f"wide5_m123_h200_s50_{dtype}_{i}.log") for i in runs]
    rows = []
    for case, (_, label, _) in logs[0].items():
        pick = min(log[case][0] for log in logs)
        v1 = min(log[case][2]["v1"] for log in logs)
        v4 = min(log[case][2]["v4"] for log in logs)
        rows.append((case, label.split("/")[0], pick, v1, v4))
    for m in (1, 2, 3):
        at = [r for r in rows if r[0][3] == m]
        wide = sum(r[1] == "v4" for r in at)
        print(f"{dtype} M = {m}: V4 on {wide} of {len(at)}; pick {geomean([p / v1 for *_, p, v1, _ in at]):.3f}x V1, "
              f"{geomean([p / min(v1, v4) for *_, p, v1, v4 in at]):.3f}x the faster tiling "
              f"(worst {max(p / min(v1, v4) for *_, p, v1, v4 in at):.3f}x)")
    for (name, k, n, m), label, pick, v1, v4 in rows:
        print(f"  {name:<18} K {k:5d} N {n:5d} M {m}: {label} {pick:6.2f} us (V1 {v1:6.2f}, V4 {v4:6.2f}) "
              f"{pick / v1:.3f}x V1, {pick / min(v1, v4):.3f}x the faster")
