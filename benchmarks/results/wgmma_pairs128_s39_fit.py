"""Session 39 (H100): the numbers of wgmma_pairs128_h100_s39.md from its wgplans log.

WgLauncher::kPairKBlock128, the share of a k-block's time of the 128 x 128 tile on two warpgroup
pairs: an offline replica of the launcher's tile choice (WgLauncher::plan / cost, launch_wgmma_bits:
128 x 128 or 128 x 256 up to 128 rows; those or 256 x 128 above), scored on harness "wgplans"
(every tile timed with its plan): the chosen tile's time over the fastest one's. Then the
launcher's own picks (WGPICK, built with 0.75) against the tiles that did not change.

    python3 wgmma_pairs128_s39_fit.py       (in benchmarks/results)
"""
import collections
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
TILES = ((128, 1), (128, 2), (256, 1))  # (rows, J): J = 1 is 128 columns, 2 is 256


def geo(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


plans, picks = {}, {}
for line in open(os.path.join(HERE, "wgmma_pairs128_h100_s39_wgplans.log")):
    f = line.split()
    case = tuple(f[1:2]) + tuple(int(x) for x in f[2:6]) if f and f[0] in ("WGPLAN", "WGPICK") else None
    if f and f[0] == "WGPLAN":  # shape K N bits M rows J ks CTAs whole-tile-CTAs sum us
        plans[case + (int(f[6]), int(f[7]))] = dict(ks=int(f[8]), ctas=int(f[9]), whole=int(f[10]),
                                                    pull=f[11] == "pull", us=float(f[12]))
    elif f and f[0] == "WGPICK":
        picks[case] = (int(f[6]), int(f[7]))
cases = sorted({k[:5] for k in plans})


def tiles(case):
    return [t for t in TILES if case + t in plans]


def cost(case, rows, j, share):
    """WgLauncher::cost on the logged plan (132 SMs; 1 CTA per SM: 132 resident, 66 2-CTA clusters)."""
    p, kb = plans[case + (rows, j)], case[1] // 32
    per_kblock = 1.0 if j == 2 else 0.9 if rows == 256 else 0.7
    k_share = share if (rows, j) == (128, 1) and case[3] <= 4 else 1.0
    if p["whole"]:  # last round split over 2-CTA clusters after whole rounds
        kps, waves, whole_waves = -(-kb // 2), 1, p["whole"] // 132
    else:
        kps, waves, whole_waves = -(-kb // p["ks"]), (-(-p["ctas"] // 132) if p["ks"] == 1 else 1), 0
    pull = 2.0 + p["ks"] if p["pull"] else 0.0
    return per_kblock * ((35 + k_share * kps) * waves + (35 + k_share * kb) * whole_waves) + pull


def pick(case, share):
    return min(tiles(case), key=lambda t: cost(case, *t, share))


print("kPairKBlock128 (wgplans, %d cases): picked tile / fastest tile" % len(cases))
for label, keep in (("M <= 128", lambda c: c[4] <= 128), ("M > 128", lambda c: c[4] > 128), ("all", None)):
    sel = [c for c in cases if keep is None or keep(c)]
    print("  %s (%d cases)" % (label, len(sel)))
    for share in (0.6, 0.65, 0.7, 0.75, 0.8, 0.85, 0.9, 1.0):
        r = [(plans[c + pick(c, share)]["us"] / min(plans[c + t]["us"] for t in tiles(c)), c, pick(c, share))
             for c in sel]
        print("    %.2f: %.4f on average, worst %.3f %s picked %s, %d over 5 %%"
              % (share, geo([x for x, _, _ in r]), *max(r), sum(x > 1.05 for x, _, _ in r)))
print("the replica at 0.75 against the launcher's picks: %d of %d differ"
      % (sum(picks[c] != pick(c, 0.75) for c in cases), len(cases)))

print("\nthe launcher's picks (built with 0.75):", dict(collections.Counter(
    ("M <= 128" if c[4] <= 128 else "M > 128", "%d x %d" % (t[0], 128 * t[1])) for c, t in picks.items())))
print("where it picks 128 x 128 (pairs): its time over the faster unchanged tile (128 x 256, 256 x 128)")
groups = collections.defaultdict(list)
for c, t in picks.items():
    if t == (128, 1):
        r = plans[c + t]["us"] / min(plans[c + u]["us"] for u in tiles(c) if u != t)
        groups["M <= 128" if c[4] <= 128 else "M > 128"].append(r)
        groups["M = %d" % c[4]].append(r)
        groups["bits %d" % c[3]].append(r)
for g, r in sorted(groups.items()):
    print("  %-9s %3d cases: %.3f (%.3f-%.3f)" % (g, len(r), geo(r), min(r), max(r)))
