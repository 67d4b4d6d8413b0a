"""Session 48 (H200, call 2): matmul.cu's rule for M = 17..32 (which products take the wgmma
kernel early) scored on today's kernels. Harness "rows" (graph-timed, PDL on, as JAX runs them),
the ten shapes and Llama-3-70B's layers at TP 4, bits 2-5, M = 17, 24, 32, 48, 64, once with the
wgmma kernel never (KBIT_JAX_WGMMA_MIN_M=0: dispatch_h200_s48_rows_fused.log, the "default"
column is then matmul_fused.cuh's own pick) and once always (MIN_M=1: ..._rows_wgmma.log).

Prints, per case, both times and the rule's pick over the faster; then the rule's geometric-mean
and worst distance from the faster kernel at M <= 32 (at 48 and 64 it takes the wgmma kernel
everywhere, and that is the faster on every case here).

    python3 benchmarks/results/dispatch_s48_check.py
"""

import math
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def load(name):
    rows = {}
    for line in open(os.path.join(HERE, name)):
        f = line.split()
        if f and f[0] == "ROWS":  # ROWS shape K N bits M 16-row n-split default cp.async ...
            rows[(f[1], int(f[2]), int(f[3]), int(f[4]), int(f[5]))] = float(f[8])
    return rows


def rule_min_rows(n, k, bits):
    """matmul.cu's wgmma_rule_rows: the first M that takes the wgmma kernel."""
    early = bits >= 5 or (n >= 2560 and (k * n <= 48 << 20 or 5120 <= n <= 8192))
    return 17 if early else 33


def main():
    fused, wgmma = load("dispatch_h200_s48_rows_fused.log"), load("dispatch_h200_s48_rows_wgmma.log")
    logs, worst, wgmma_wins_above_32 = [], (0.0, ()), True
    for key in sorted(fused):
        shape, k, n, bits, m = key
        f, w = fused[key], wgmma[key]
        pick = w if m >= rule_min_rows(n, k, bits) else f
        print(f"{shape:20s} bits {bits} M {m:3d}: fused {f:7.2f} wgmma {w:7.2f} us, pick / best {pick / min(f, w):.3f}")
        if m <= 32:
            logs.append(math.log(pick / min(f, w)))
            worst = max(worst, (pick / min(f, w), key))
        else:
            wgmma_wins_above_32 &= w <= f
    print(f"M <= 32: {len(logs)} cases, the rule's pick {100 * (math.exp(sum(logs) / len(logs)) - 1):.2f} % "
          f"slower than the faster kernel on (geometric) average, {100 * (worst[0] - 1):.1f} % at worst {worst[1]}")
    print(f"M = 48, 64: the wgmma kernel the faster on every case: {wgmma_wins_above_32}")


if __name__ == "__main__":
    main()
