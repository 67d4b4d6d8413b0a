"""The N-split tiling's chunk price per block of rows and bits value, fitted on a "rows" log that
carries the launcher's own plan costs.

    python benchmarks/nsplit_price_fit.py LOG [--prices "2:0.61,3:0.8,... 4:... 8:..."]

Since session 42 every ROWS line of the harness's "rows" mode ends in "plan <16-row cost>
<N-split cost> <its price>" (MatmulTuning::planned_*: the costs matmul_fused.cuh's launcher
computed for that product, from one more launch with its own choice). The N-split plan's cost
divided by the price it was made with (Config::chunk_cost) is the plan's length in its own
chunks, so any other price scales it exactly; the launcher takes the N-split tiling where that
cost is below the 16-row plan's (at M > 8). Unlike `rows_fit.py`, whose replica of the plan
mirrors the launcher of the logs it was fitted on, this scores today's launcher as it ran, for
either dtype (the log's header line names the activations; fp16 has prices of its own,
Config::nsplit_price_f16).

Each case depends on one price only (its block of rows, its bits value), so every price is
fitted on its own cases: the grid value whose picks take the least geometric-mean time against
the faster tiling (the middle one of equally good values: the widest margin). Prints, per price,
the chosen value and the best two, then the whole fit's score and the cases it still misses by
more than 3 %. With --prices, scores those prices instead ("<n8 tiles>:<bits>=<price>,...", or
"<n8 tiles>:<price>" for every bits value; a price left out means the N-split is never taken).
"""

from __future__ import annotations

import argparse
import math

from rows_fit import m_tiles  # n8 tiles of the N-split tiling's block of rows

GRID = [g / 100 for g in range(30, 401)]  # prices tried: 0.30 .. 4.00


def parse(path: str):
    """The log's cases at M > 8 with plan costs: (shape, K, N, bits, M, 16-row us, N-split us,
    16-row cost, N-split plan length in its own chunks)."""
    cases = []
    for line in open(path):
        f = line.split()
        if not f or f[0] != "ROWS" or int(f[5]) <= 8:
            continue
        if "plan" not in f:
            raise SystemExit(f"{path}: a ROWS line without the launcher's plan costs (harness before "
                             f"session 42?): {line.strip()}")
        p = f.index("plan")
        rows16, nsplit, price = (float(v) for v in f[p + 1:p + 4])
        if rows16 <= 0 or nsplit <= 0 or price <= 0:
            continue  # (no plan of one tiling: nothing to choose)
        cases.append((f[1], int(f[2]), int(f[3]), int(f[4]), int(f[5]), float(f[6]), float(f[7]),
                       rows16, nsplit / price))
    return cases


def ratio(case, price: float | None) -> float:
    """The picked tiling's time over the faster one's, at this price (None: never the N-split)."""
    *_, us16, us_ns, rows16, length = case
    picked = us_ns if price is not None and length * price < rows16 else us16
    return picked / min(us16, us_ns)


def score(cases, prices: dict):
    """(geometric-mean ratio, (worst ratio, where)) at prices {(n8 tiles, bits): price}."""
    logs, worst = [], (1.0, "")
    for c in cases:
        r = ratio(c, prices.get((m_tiles(c[4]), c[3])))
        logs.append(math.log(r))
        worst = max(worst, (r, f"{c[0]} bits={c[3]} M={c[4]}"))
    return math.exp(sum(logs) / len(logs)), worst


def fit(cases):
    """{(n8 tiles, bits): price} and, per price, the chosen value and the best two with scores."""
    prices, report = {}, {}
    for key in sorted({(m_tiles(c[4]), c[3]) for c in cases}):
        sub = [c for c in cases if (m_tiles(c[4]), c[3]) == key]
        scored = [(score(sub, {key: g}), g) for g in GRID]
        best = min(s[0][0] for s in scored)
        tied = [s for s in scored if s[0][0] <= best + 1e-12]
        prices[key] = tied[len(tied) // 2][1]
        report[key] = [tied[len(tied) // 2]] + sorted(scored, key=lambda s: s[0][0])[:2]
    return prices, report


def parse_prices(spec: str) -> dict:
    out = {}
    for item in spec.replace(" ", ",").split(","):
        if not item:
            continue
        tiles, rest = item.split(":")
        if "=" in rest:
            bits, price = rest.split("=")
            out[(int(tiles), int(bits))] = float(price)
        else:
            out.update({(int(tiles), b): float(rest) for b in (2, 3, 4, 5)})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    p.add_argument("--prices", help="score these prices instead of fitting")
    args = p.parse_args(argv)
    cases = parse(args.log)
    if args.prices:
        prices = parse_prices(args.prices)
    else:
        prices, report = fit(cases)
        print(f"{len(cases)} cases at M > 8; per block of rows (n8 tiles) and bits, the chosen price, then "
              "the best two (geometric-mean ratio of the picked tiling's time to the faster one's, worst):")
        for (tiles, bits), best in report.items():
            print(f"  {tiles} n8 tiles, bits {bits}: " +
                  "; ".join(f"{g:.2f} {m:.4f} (worst {w:.3f} {where})" for (m, (w, where)), g in best))
    mean, (worst, where) = score(cases, prices)
    print(f"all {len(cases)} cases: mean {mean:.4f}, worst {worst:.3f} ({where})")
    for c in cases:
        price = prices.get((m_tiles(c[4]), c[3]))
        if ratio(c, price) > 1.03:
            taken = price is not None and c[8] * price < c[7]
            print(f"  miss: {c[0]} bits={c[3]} M={c[4]} picks {'N-split' if taken else '16-row'}: "
                  f"16-row {c[5]:.1f} us, N-split {c[6]:.1f} us")
    return prices


if __name__ == "__main__":
    main()
