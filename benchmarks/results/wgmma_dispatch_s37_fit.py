"""Scores rules for which bf16 products at M = 17..64 take the wgmma kernel (cpp/cuda/matmul.cu's
wgmma_min_rows) on the session-37 harness logs: "rows" without PDL, every case timed with the
wgmma kernel from 17 rows (KBIT_JAX_WGMMA_MIN_M=17) and with matmul_fused.cuh only (=0); the
"default" column is the launcher's time. Per case the median over the logs' rounds; a rule's
score is its time over the faster kernel's, (geometric) mean and worst case.

    python3 wgmma_dispatch_s37_fit.py       (in benchmarks/results)
"""
import collections
import math
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))


def load(*names):
    d = collections.defaultdict(list)
    for name in names:
        for line in open(os.path.join(HERE, name)):
            if line.startswith("ROWS "):
                f = line.split()
                d[(f[1], int(f[2]), int(f[3]), int(f[4]), int(f[5]))].append(float(f[8]))
    return {k: statistics.median(v) for k, v in d.items()}


wg = load("wgmma_dispatch_h200_s37_rows_wgmma.log", "wgmma_dispatch_h200_s37_rows_tp_wgmma.log")
fu = load("wgmma_dispatch_h200_s37_rows_fused.log", "wgmma_dispatch_h200_s37_rows_tp_fused.log")
MI = 1 << 20
RULES = {
    "session 36 (33 where N >= 4096 or bits 5, else 65)": lambda K, N, b, M: M >= 65 or (M >= 33 and (N >= 4096 or b == 5)),
    "wgmma from 17 everywhere": lambda K, N, b, M: True,
    "from 33 everywhere": lambda K, N, b, M: M >= 33,
    "33; 17 at bits 5 (N >= 4096) or K <= 2048 with N >= 5120": lambda K, N, b, M: M >= 33 or (b >= 5 and N >= 4096) or (K <= 2048 and N >= 5120),
    "33; 17 at bits 5 (N >= 2560) or N >= 5120 with K * N <= 48 Mi (session 37)": lambda K, N, b, M: M >= 33 or (b >= 5 and N >= 2560) or (N >= 5120 and K * N <= 48 * MI),
}
for name, rule in RULES.items():
    logs, worst = 0.0, (0.0, None)
    for k, tw in wg.items():
        _, K, N, b, M = k
        tf = fu[k]
        r = (tw if rule(K, N, b, M) else tf) / min(tw, tf)
        logs += math.log(r)
        worst = max(worst, (r, k))
    print(f"{name}: {math.exp(logs / len(wg)):.4f} on average over {len(wg)} cases, worst {worst[0]:.3f} {worst[1]}")
