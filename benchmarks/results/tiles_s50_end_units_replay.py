"""Session 50, a rejected idea replayed offline: price the plans' item ends in V0 chunks instead of
each tiling's own chunks (Launcher::plan multiplies chunks and ends alike by the chunk price).

Each forced plan of the final build's harness "tiles" log (tiles_h200_s50_new_bf16.log) is split
into its chunks and its ends, rebuilt from the line: uniform k-split per_cluster x (chunks + end),
or a chunk-balanced cluster's per_rank + 0.5 pieces + 0.5 senders (the launcher's formulas). The
choice is replayed with ends at E V0 chunks, the prices refitted per bits; the cluster sizes stay
as planned (a real change would re-plan them). Prints the best point per bits against today's
model (ends at the tiling's price).

    python benchmarks/results/tiles_s50_end_units_replay.py
"""
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
from tiles_price_fit import geomean, read_tiles  # noqa: E402

COLS = {"v0": 32, "v1": 64, "v4": 64, "v2": 256}  # column groups (V1: 32 at bits 5)
KCH = {"v0": 16, "v1": 16, "v4": 16, "v2": 2}  # k-blocks per chunk
TODAY = {2: (1.0, 0.4), 3: (1.4, 0.8), 4: (1.0, 0.4), 5: (1.0, 0.8)}  # V1's and V2's prices at 16 rows


def chunks_and_ends(v, key, ks_ctas, units):
    """(chunks, ends) of a plan whose cost / price is `units`, or None if neither formula fits."""
    _, k, n, bits, _ = key
    ks, ctas = map(int, ks_ctas.split("/"))
    items, ncl, kb, kch = math.ceil(n / (32 if v == "v1" and bits == 5 else COLS[v])), ctas // ks, k // 32, KCH[v]
    per, chunks = math.ceil(items / ncl), math.ceil(math.ceil(kb / ks) / kch)
    end = 0.5 if ks == 1 else 1 + (1.0 if v == "v2" else 0.5) * ks
    if abs(per * (chunks + end) - units) < 0.02:
        return per * chunks, per * end
    nchi = math.ceil(kb / kch)  # chunk-balanced clusters
    per_rank, fewest = math.ceil(math.ceil(items / ncl) * nchi / ks), items // ncl * nchi // ks
    ends = 0.5 * ((per_rank + nchi - 1) // nchi + 1) + 0.5 * ((nchi - 1 + fewest - 1) // fewest if fewest else 0)
    return (per_rank, ends) if abs(per_rank + ends - units) < 0.02 else None


def pick(plans, bits, p1, pn, pw, end_price):
    """launch_fused_bits's choice at MT = 2; end_price None: ends at each tiling's own price."""
    def cost(v, price):
        chunks, ends = plans[v]
        return chunks * price + ends * (price if end_price is None else end_price)
    c0, c1 = cost("v0", 1.0), cost("v1", p1 if bits != 5 else 1.0)
    best, choice = (c1, "v1") if c1 <= c0 else (c0, "v0")
    if "v4" in plans and cost("v4", pw) < best:
        best, choice = cost("v4", pw), "v4"
    return "v2" if cost("v2", pn) < best else choice


def main():
    log = read_tiles(os.path.join(HERE, "tiles_h200_s50_new_bf16.log"))
    cases = []
    for key, (_, _, forced) in log.items():
        plans = {v: chunks_and_ends(v, key, ks_ctas, cost / price) for v, (_, ks_ctas, cost, price) in forced.items()}
        assert all(plans.values()), key
        cases.append((key[3], {v: f[0] for v, f in forced.items()}, plans))
    for bits in (2, 3, 4, 5):
        sub = [(us, plans) for b, us, plans in cases if b == bits]

        def regret(p1, pn, pw, e):
            return geomean([us[pick(plans, bits, p1, pn, pw, e)] / min(us.values()) for us, plans in sub])
        today = regret(*TODAY[bits], 1.72, None)
        best = min((regret(p1, pn, pw, e), e, p1, pn, pw)
                   for e in (0.0, 0.25, 0.5, 1.0, 1.5)
                   for p1 in ([1.0 + 0.1 * i for i in range(6)] if bits != 5 else [1.0])
                   for pn in [0.3 + 0.05 * i for i in range(14)]
                   for pw in ([1.72] if bits != 5 else [1.5 + 0.05 * i for i in range(8)]))
        print(f"bits {bits}: today's model {today:.4f}x the fastest; ends in V0 chunks at best {best[0]:.4f}x "
              f"(E {best[1]}, V1 {best[2]:.2f}, V2 {best[3]:.2f}, V4 {best[4]:.2f})")


if __name__ == "__main__":
    main()
