"""Session 46, offline: the chunk price of bits 5's 64-column 16-row tiling (variant 4,
kWideBits5Price in matmul_fused.cuh), fitted on the harness's "wide5" logs (H200, graph-timed,
every tiling the launcher plans at M = 9..16 forced, each with its plan's cost).

Each WIDE5 line holds, per forced variant, the time, the plan's cost and the chunk price that
cost includes. A candidate price p re-makes the launcher's choice (launch_fused_bits at MT = 2):
V1 where its cost is at most V0's, V4 where its cost in V0 chunks times p is lower still, and the
N-split tiling (V2) where its cost is lower than that. Per price it prints the geometric mean of
(picked tiling's time / fastest tiling's time) and the worst case; then, at the price taken,
each case whose pick changed against the launcher without V4.

Run from the repository root:
    python3 benchmarks/results/wide5_s46_fit.py benchmarks/results/wide5_h200_s46_bf16.log \
        benchmarks/results/wide5_h200_s46_f16.log
"""
import math
import sys

PRICES = (None, 1.4, 1.6, 1.65, 1.70, 1.72, 1.74, 1.76, 1.8, 2.0)  # None: no V4 (before session 46)
TAKEN = 1.72


def load(path):
    """(shape, M, {variant: (us, plan cost, chunk price)}) per WIDE5 line."""
    rows = []
    for line in open(path):
        if not line.startswith("WIDE5"):
            continue
        f = line.split()
        shape, m, rest = f[1], int(f[4]), f[7:]
        res = {}
        for i in range(0, len(rest), 5):  # v<variant> <us> <ks>/<ctas> <cost> <price>
            res[int(rest[i][1:])] = (float(rest[i + 1]), float(rest[i + 3]), float(rest[i + 4]))
        rows.append((shape, m, res))
    return rows


def pick(res, price):
    cost = {v: res[v][1] for v in (0, 1, 2)}
    v = 1 if cost[1] <= cost[0] else 0
    best = cost[v]
    if price is not None:
        wide = res[4][1] / res[4][2] * price  # V4's plan in V0 chunks, at the candidate price
        if wide < best:
            v, best = 4, wide
    return 2 if cost[2] < best else v


def main(paths):
    for path in paths:
        rows = load(path)
        print(path)
        for price in PRICES:
            logs, worst = [], (0.0, None)
            for shape, m, res in rows:
                fastest = min(r[0] for r in res.values())
                v = pick(res, price)
                ratio = res[v][0] / fastest
                logs.append(math.log(ratio))
                worst = max(worst, (ratio, f"{shape} M={m} v{v}"))
            label = "no V4" if price is None else f"{price:.2f}"
            print(f"  price {label:>5}: picks {math.exp(sum(logs) / len(logs)):.4f}x the fastest (geometric "
                  f"mean), worst {worst[0]:.3f}x ({worst[1]})")
        print(f"  changed picks at {TAKEN}:")
        for shape, m, res in rows:
            old, new = pick(res, None), pick(res, TAKEN)
            if old != new:
                print(f"    {shape:<18} M={m:2d}  v{old} {res[old][0]:6.2f} -> v{new} {res[new][0]:6.2f} us"
                      f"  ({res[new][0] / res[old][0]:.3f}x)")


if __name__ == "__main__":
    main(sys.argv[1:])
