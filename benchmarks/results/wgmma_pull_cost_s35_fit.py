"""Session 35, offline: WgLauncher::cost's term for a k-split sum by pull, scored on harness
"wgplans" logs (every row x column tile of the wgmma kernel timed with its own plan).

The session's first call ran "wgplans" on two builds that differed only in the pull: every rank's
loads of an item before the first add (`_plans_batched.log`, session 34's code) and rank by rank
(`_plans_by_rank.log`). Those builds could also force the pull where the push fits (the last
column of their WGPLAN lines); that switch cost registers and was taken out again. Each case's
time per tile is taken as the kernel now runs it: a pull over more than 3 ranks from the by-rank
build, a pull over 2-3 ranks from the batched one, anything else the mean of both.

The launcher's pick is replicated from the logged plans (cluster size, whole-tile CTAs, push or
pull): cost = per_kblock x ((35 + kps) x waves + (35 + kb) x whole_waves) + pull term, the tile
of least cost wins. Printed: the pull's extra time over the push (forced), then for each pull
term a + b (ks - 1) the geometric mean of picked / fastest time, the worst case and the cases
more than 3 % off; then the picks at the final term (a = 3, b = 1: 2 + ks) that differ from no
term, and the same score of the final code's own picks (`_plans_final.log`, WGPICK lines).
Run from benchmarks/results:
    python3 wgmma_pull_cost_s35_fit.py
"""
import collections
import math

PREFIX = "wgmma_pull_cost_h200_s35_plans_"


def load(path):
    """WGPLAN lines -> {(shape, K, N, bits, M, rows, J): [run, ...]}; WGPICK -> {case: [(rows, J)]}."""
    plans, picks = collections.defaultdict(list), collections.defaultdict(list)
    for line in open(path):
        p = line.split()
        if not p:
            continue
        if p[0] == "WGPLAN":
            key = (p[1], int(p[2]), int(p[3]), int(p[4]), int(p[5]), int(p[6]), int(p[7]))
            forced_pull = None if len(p) < 14 or p[13] == "-" else float(p[13])
            plans[key].append(dict(ks=int(p[8]), whole=int(p[10]), sum=p[11], us=float(p[12]), pull=forced_pull))
        elif p[0] == "WGPICK":
            picks[(p[1], int(p[2]), int(p[3]), int(p[4]), int(p[5]))].append((int(p[6]), int(p[7])))
    return plans, picks


def mean(xs):
    return sum(xs) / len(xs)


def geo(xs):
    return math.exp(mean([math.log(x) for x in xs]))


def cost(c, k, n, m, pull_term):
    """WgLauncher::plan's cost of one logged plan (H200: 132 SMs, 66 resident 2-CTA clusters)."""
    tiles = math.ceil(n / (128 * c["J"])) * math.ceil(m / c["rows"])
    kb, ks = k // 32, c["ks"]
    kps = math.ceil(kb / ks)
    whole_waves = c["whole"] // 132
    waves = 1 if ks > 1 or c["whole"] else math.ceil(tiles / 132)
    per_kblock = 1.0 if c["J"] == 2 else {64: 0.8, 128: 0.7, 256: 0.9}[c["rows"]]
    pull = pull_term(ks) if ks > 1 and c["sum"] == "pull" else 0.0
    return per_kblock * ((35 + kps) * waves + (35 + kb) * whole_waves) + pull


def cases_from(batched, by_rank):
    cases = collections.defaultdict(list)
    for key, runs in batched.items():
        name, k, n, bits, m, rows, j = key
        ks, whole, how = runs[0]["ks"], runs[0]["whole"], runs[0]["sum"]
        if how == "pull":
            us = mean([r["us"] for r in (by_rank[key] if ks > 3 else runs)])
        else:
            us = mean([r["us"] for r in runs + by_rank[key]])
        cases[(name, k, n, bits, m)].append(dict(rows=rows, J=j, ks=ks, whole=whole, sum=how, us=us))
    return cases


def score(cases, pull_term):
    ratios, off = [], []
    for (name, k, n, bits, m), tiles in cases.items():
        best = min(c["us"] for c in tiles)
        pick = min(tiles, key=lambda c: cost(c, k, n, m, pull_term))
        ratios.append(pick["us"] / best)
        if pick["us"] / best > 1.03:
            off.append((pick["us"] / best, name, bits, m))
    return geo(ratios), max(ratios), sorted(off, reverse=True)


def main():
    batched, _ = load(PREFIX + "batched.log")
    by_rank, _ = load(PREFIX + "by_rank.log")
    print("pull - push (the pull forced where the push fits), us, by (rows, J, ranks):")
    for name, plans in (("batched", batched), ("by rank", by_rank)):
        extra = collections.defaultdict(list)
        for key, runs in plans.items():
            for r in runs:
                if r["pull"] is not None:
                    extra[(key[5], key[6], r["ks"])].append(r["pull"] - r["us"])
        print(f"  {name}: " + ", ".join(f"{k}: {sorted(v)[len(v) // 2]:.2f}" for k, v in sorted(extra.items())))
    cases = cases_from(batched, by_rank)
    print(f"{len(cases)} cases")
    for a, b in [(0, 0), (0, 1), (0, 2), (1, 1), (2, 1), (3, 1), (2, 1.5), (4, 1), (6, 1)]:
        g, worst, off = score(cases, lambda ks, a=a, b=b: a + b * (ks - 1))
        print(f"pull term {a} + {b} (ks - 1): mean {g:.4f}, worst {worst:.3f}, {len(off)} cases > 3 % off")
    final = lambda ks: 2.0 + ks  # noqa: E731 (WgLauncher::cost)
    none = lambda ks: 0.0  # noqa: E731
    print("picks that the term changes (rows, J, ranks, sum, us):")
    for (name, k, n, bits, m), tiles in sorted(cases.items()):
        old = min(tiles, key=lambda c: cost(c, k, n, m, none))
        new = min(tiles, key=lambda c: cost(c, k, n, m, final))
        if old is not new:
            desc = lambda c: f"{c['rows']}/{c['J']}/{c['ks']}/{c['sum']} {c['us']:.1f}"  # noqa: E731
            print(f"  {name} bits {bits} M {m}: {desc(old)} -> {desc(new)} ({new['us'] / old['us']:.3f})")
    plans, picks = load(PREFIX + "final.log")
    ratios = []
    for case, chosen in picks.items():
        times = {key[5:]: mean([r["us"] for r in runs]) for key, runs in plans.items() if key[:5] == case}
        ratios.append(times[chosen[0]] / min(times.values()))
    print(f"final code's own picks ({len(ratios)} cases): mean {geo(ratios):.4f}, worst {max(ratios):.3f}")


if __name__ == "__main__":
    main()
