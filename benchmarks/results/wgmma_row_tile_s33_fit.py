"""Session 33, offline: WgLauncher::cost's price of the wgmma kernel's 256-row tile, scored on
harness "split" logs' SPLITR lines (each case timed with the 256- and the 128-row tile forced).
A replica of WgLauncher::plan (cluster size, rounds of CTAs, split last round) and of the
launcher's choice of the column tile at 128 rows prices both; the 256-row tile is taken where
c256 x its plan costs no more than the 128-row choice. Prints, per c256, the geometric mean of
(picked tile's time / faster tile's time), the worst case and the cases more than 3 % off, then
the misses at C (default 0.9).
Resident clusters per size as on the H200 at one CTA per SM: 132, 66, 44 and 30 CTAs' clusters
for sizes 1-4 (the plan's logs); 24, 20, 16, 15 for 5-8 are guesses (rarely reached here).
Run from benchmarks/results:
    python3 wgmma_row_tile_s33_fit.py wgmma_bits5_tall_h200_s33_split.log wgmma_rows_h200_s32_split.log \\
        wgmma_rows_h200_s33_split_m320-640.log
"""
import math
import os
import sys

MAX_CLUSTERS = {1: 132, 2: 66, 3: 44, 4: 30, 5: 24, 6: 20, 7: 16, 8: 15}
SMS = 132


def plan_cost(tiles, kb, per_kblock):
    """WgLauncher::plan + cost for `tiles` output tiles over kb k-blocks (no forced sizes)."""
    ks = 1
    for c in range(min(8, kb // 4), 1, -1):
        if tiles * c <= SMS and tiles <= MAX_CLUSTERS[c]:
            ks = c
            break
    kps = math.ceil(kb / ks)
    ks = max(1, math.ceil(kb / kps))
    waves = math.ceil(tiles * ks / (MAX_CLUSTERS[ks] * ks))
    cost = per_kblock * (35 + kps) * waves
    if ks == 1 and kb >= 8:  # a split last round (2-CTA clusters) where it fills half the GPU or less
        r2 = MAX_CLUSTERS[2] * 2
        whole, rest = tiles // r2, tiles % r2
        if whole >= 1 and rest > 0 and 2 * rest <= r2:
            cost = min(cost, per_kblock * ((35 + math.ceil(kb / 2)) + (35 + kb) * whole))
    return cost


def costs(k, n, m, c256):
    kb = k // 32
    tall = plan_cost(math.ceil(m / 256) * math.ceil(n / 128), kb, c256)
    wide = plan_cost(math.ceil(m / 128) * math.ceil(n / 256), kb, 1.0)
    narrow = plan_cost(math.ceil(m / 128) * math.ceil(n / 128), kb, 0.7)
    return tall, min(wide, narrow)


cases = []
for path in sys.argv[1:]:
    for line in open(path):
        p = line.split()
        if p and p[0] == "SPLITR":
            cases.append((p[1], int(p[2]), int(p[3]), int(p[4]), int(p[5]), float(p[6]), float(p[7])))
print(len(cases), "cases")
always = [math.log(u256 / min(u256, u128)) for *_, u256, u128 in cases]
print(f"always 256 rows: mean {math.exp(sum(always) / len(always)):.4f}, worst {math.exp(max(always)):.3f}")
for c256 in [0.75, 0.8, 0.85, 0.87, 0.9, 0.95, 1.0]:
    logs, worst, off = [], (1.0, ""), 0
    for name, k, n, bits, m, u256, u128 in cases:
        tall, rows128 = costs(k, n, m, c256)
        r = (u256 if tall <= rows128 else u128) / min(u256, u128)
        logs.append(math.log(r))
        off += r > 1.03
        worst = max(worst, (r, f"{name} bits {bits} M {m}"))
    print(f"c256 = {c256}: mean {math.exp(sum(logs) / len(logs)):.4f}, worst {worst[0]:.3f} ({worst[1]}), "
          f"{off} cases > 3 % off")
c256 = float(os.environ.get("C", "0.9"))
for name, k, n, bits, m, u256, u128 in cases:
    tall, rows128 = costs(k, n, m, c256)
    r = (u256 if tall <= rows128 else u128) / min(u256, u128)
    if r > 1.03:
        print(f"  miss at {c256}: {name} bits {bits} M {m} takes {'256' if tall <= rows128 else '128'} rows "
              f"(costs {tall:.0f} / {rows128:.0f}): {u256:.1f} / {u128:.1f} us, {r:.3f}")
