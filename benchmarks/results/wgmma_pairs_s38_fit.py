"""Session 38 (H200): the numbers of wgmma_pairs_h200_s38.md from its logs.

1. WgLauncher::kPairKBlock: an offline replica of the 64-row tile's choice between 128 columns
   (J = 1, on two warpgroup pairs) and 256 (J = 2), scored on harness "wgplans" (both tiles timed
   with their plans): the chosen tile's time over the faster one's.
2. cpp/cuda/matmul.cu's wgmma_min_rows: rules scored on harness "rows" without PDL, every case
   timed with the wgmma kernel from 17 rows (KBIT_JAX_WGMMA_MIN_M=17) and with matmul_fused.cuh
   only (=0): a rule's time over the faster kernel's.
3. The final tree against session 37's (d2eae28), harness "rows" without PDL, two rounds each.

    python3 wgmma_pairs_s38_fit.py       (in benchmarks/results)
"""
import collections
import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))
MI = 1 << 20


def geo(xs):
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def wgplans(name):
    """{(shape, bits, M, J): (us, K, ks, CTAs)} from WGPLAN lines."""
    out = {}
    for line in open(os.path.join(HERE, name)):
        f = line.split()
        if f and f[0] == "WGPLAN":
            out[(f[1], int(f[4]), int(f[5]), int(f[7]))] = (float(f[-1]), int(f[2]), int(f[8]), int(f[9]))
    return out


def rows(*names):
    """{(shape, K, N, bits, M): the launcher's time, minimum over the rounds} from ROWS lines."""
    d = collections.defaultdict(list)
    for name in names:
        for line in open(os.path.join(HERE, name)):
            f = line.split()
            if f and f[0] == "ROWS":
                d[(f[1], int(f[2]), int(f[3]), int(f[4]), int(f[5]))].append(float(f[8]))
    return {k: min(v) for k, v in d.items()}


# 1. the pair k-block's price: cost = c_J (35 + share kps) waves, c_1 = 0.8 at 64 rows, c_2 = 1
plans = wgplans("wgmma_pairs_h200_s38_wgplans_new.log")
cases = sorted({k[:3] for k in plans})


def cost(k, j, share):
    _, kk, ks, ctas = plans[k + (j,)]
    kps = -(-(kk // 32) // ks)
    return (0.8 * (35 + share * kps) if j == 1 else 35 + kps) * -(-ctas // 132)


print("1. kPairKBlock (wgplans, %d cases): picked tile / faster tile" % len(cases))
for share in (0.5, 0.6, 0.65, 0.7, 0.8, 0.9, 1.0):
    r = []
    for k in cases:
        pick = 1 if cost(k, 1, share) < cost(k, 2, share) else 2
        r.append((plans[k + (pick,)][0] / min(plans[k + (1,)][0], plans[k + (2,)][0]), k))
    print("   %.2f: %.4f on average, worst %.3f %s" % (share, geo([x for x, _ in r]), *max(r)))

# 2. the dispatch at M = 17..64
wg = rows("wgmma_pairs_h200_s38_rows_wgmma.log")
fu = rows("wgmma_pairs_h200_s38_rows_fused.log")
RULES = {
    "session 37: 33; 17 at bits 5 (N >= 2560) or N >= 5120 with K N <= 48 Mi":
        lambda K, N, b: (b >= 5 and N >= 2560) or (N >= 5120 and K * N <= 48 * MI),
    "wgmma from 17 everywhere": lambda K, N, b: True,
    "33; 17 at bits 5, N of 2560..8192, wider N with K N <= 48 Mi":
        lambda K, N, b: b >= 5 or 2560 <= N <= 8192 or (N > 8192 and K * N <= 48 * MI),
    "session 38: 33; 17 at bits 5, N >= 2560 with K N <= 48 Mi or N of 5120..8192":
        lambda K, N, b: b >= 5 or (N >= 2560 and (K * N <= 48 * MI or 5120 <= N <= 8192)),
}
print("\n2. wgmma_min_rows (rows, %d cases): the rule's kernel / the faster one" % len(wg))
for name, early in RULES.items():
    r = [((wg[k] if k[4] >= 33 or early(k[1], k[2], k[3]) else fu[k]) / min(wg[k], fu[k]), k) for k in wg]
    print("   %s: %.4f on average, worst %.3f %s" % (name, geo([x for x, _ in r]), *max(r)))

# 3. the final tree against d2eae28
new = rows("wgmma_pairs_h200_s38_rows_new.log")
base = rows("wgmma_pairs_h200_s38_rows_base.log")
print("\n3. this session's tree / session 37's (rows, no PDL, %d cases)" % len(new))
groups = collections.defaultdict(list)
for k in new:
    groups["M = %d" % k[4]].append(new[k] / base[k])
    groups["%s (K %d, N %d)" % k[:3]].append(new[k] / base[k])
print("   all: %.3f (%.3f-%.3f)" % (geo([new[k] / base[k] for k in new]), min(new[k] / base[k] for k in new),
                                   max(new[k] / base[k] for k in new)))
for g, r in sorted(groups.items()):
    print("   %-32s %.3f (%.3f-%.3f)" % (g, geo(r), min(r), max(r)))
