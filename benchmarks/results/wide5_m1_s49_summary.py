"""Session 49: bits 5's 64-column tiling (V4) at M <= 8, harness "wide5" logs summarized.

Per case (shape, K, N, M) each column's faster run: the launcher's pick ("dflt", with the rule
wide5_one_round of matmul_fused.cuh), V1 and V4 forced. Prints where the rule took V4 and what the
pick costs against the faster of the two tilings elsewhere; for call 3's logs ("rule": V4's ring 2
stages) and call 7's ("ring3": one receive slot, 3 stages at M <= 3, the final code).

    python benchmarks/results/wide5_m1_s49_summary.py
"""
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    rows = {}
    for line in open(os.path.join(HERE, name)):
        if not line.startswith("WIDE5"):
            continue
        t = line.split()
        key = (t[1], int(t[2]), int(t[3]), int(t[4]))
        rest = t[7:]
        forced = {rest[i]: float(rest[i + 1]) for i in range(0, len(rest), 5)}
        rows[key] = (float(t[5]), t[6], forced)
    return rows


def gm(xs):
    return math.exp(sum(map(math.log, xs)) / len(xs))


for logs, dtype, runs_of in (("rule", "bf16", (1, 2)), ("rule", "f16", (1, 2)), ("ring3", "bf16", (1, 2)),
                             ("ring3", "f16", (1,))):
    runs = [load(f"wide5_m1_h200_s49_{logs}_{dtype}_{i}.log") for i in runs_of]
    picked, kept = [], []
    for key in runs[0]:
        dflt = min(r[key][0] for r in runs)
        v1 = min(r[key][2]["v1"] for r in runs)
        v4 = min(r[key][2]["v4"] for r in runs)
        (picked if runs[0][key][1].startswith("v4") else kept).append((key, dflt, v1, v4))
    print(f"{logs}, {dtype}: the rule took V4 on {len(picked)} of {len(picked) + len(kept)} cases, "
          f"{gm([d / v1 for _, d, v1, _ in picked]):.3f}x V1's time there:")
    for (name, k, n, m), d, v1, v4 in picked:
        print(f"  {name:<18} K {k:5d} N {n:5d} M {m}: {d:6.2f} us (V1 {v1:6.2f}, V4 forced {v4:6.2f}) {d / v1:.3f}x")
    regret = [d / min(v1, v4) for _, d, v1, v4 in kept]
    worst = max(kept, key=lambda c: c[1] / min(c[2], c[3]))
    print(f"  elsewhere (V1): {gm([d / v1 for _, d, v1, _ in kept]):.3f}x V1 forced, {gm(regret):.3f}x the faster "
          f"tiling (worst {max(regret):.3f}x: {worst[0][0]} M {worst[0][3]}, V4 {worst[3]:.2f} against {worst[2]:.2f} us)")

# Not taken (a next step): at M = 1, where V4's ring has 3 stages, the plans' costs as printed (V1's
# chunk 1.0, V4's kWideBits5Price = 1.72) against the forced times of both tilings.
print("ring3, bf16, M = 1: V4 planned against V1 at its price (plan costs from the log):")
costs = {}
for line in open(os.path.join(HERE, "wide5_m1_h200_s49_ring3_bf16_1.log")):
    t = line.split()
    if line.startswith("WIDE5") and int(t[4]) == 1:
        rest = t[7:]
        costs[(t[1], int(t[2]), int(t[3]), 1)] = {rest[i]: float(rest[i + 3]) for i in range(0, len(rest), 5)}
runs = [load(f"wide5_m1_h200_s49_ring3_bf16_{i}.log") for i in (1, 2)]
regrets = []
for key, c in costs.items():
    v1 = min(r[key][2]["v1"] for r in runs)
    v4 = min(r[key][2]["v4"] for r in runs)
    pick = v4 if c["v4"] < c["v1"] else v1
    regrets.append(pick / min(v1, v4))
    print(f"  {key[0]:<18} K {key[1]:5d} N {key[2]:5d}: plan V1 {c['v1']:6.2f} V4 {c['v4']:6.2f} -> "
          f"{'V4' if c['v4'] < c['v1'] else 'V1'}; V4 / V1 time {v4 / v1:.3f}, pick / faster {pick / min(v1, v4):.3f}")
print(f"  the pick within {100 * (gm(regrets) - 1):.2f} % of the faster tiling on average, "
      f"{sum(r < 1.001 for r in regrets)} of {len(regrets)} the faster one, worst {max(regrets):.3f}x")
