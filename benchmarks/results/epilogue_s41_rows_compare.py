#!/usr/bin/env python3
"""Session 41's before/after of the N-split reducer, recomputed from the harness `rows` logs.

    python3 benchmarks/results/epilogue_s41_rows_compare.py BEFORE.log AFTER.log

Each log holds the ROWS lines of one build (two rounds, concatenated):
    ROWS <layer> K N bits M <16-row us> <N-split us> <launcher's pick us> <cp.async us> <ratio> v<variant>/<rows>
A case's time is the smallest over the rounds. Prints the geometric mean of AFTER / BEFORE (with
the range) for the N-split tiling forced, for the launcher's pick (all cases, and by the tiling
it picked: v2 = N-split, v3 = wgmma, v0/v1 = the 16-row tilings, which this change left alone:
the control), and for the N-split tiling on the small (Qwen3, GLM-4.7) and the Llama layers.

The session's logs (benchmarks/results/epilogue_s41.md):
    epilogue_s41_h100_rows_base_a.log  epilogue_s41_h100_rows_new_a.log   (call 2)
    epilogue_s41_h100_rows_base_b.log  epilogue_s41_h100_rows_new_b.log   (call 6, another H100)
"""

from __future__ import annotations

import argparse
import collections
import math

COLUMNS = ("16-row", "N-split", "pick", "cp.async")


def load(path: str):
    """(layer, bits, M) -> {column: smallest time}, and -> the pick's variant (v0..v3)."""
    times, variant = collections.defaultdict(lambda: collections.defaultdict(list)), {}
    for line in open(path):
        f = line.split()
        if not f or f[0] != "ROWS":
            continue
        case = (f[1], int(f[4]), int(f[5]))
        for name, value in zip(COLUMNS, f[6:10]):
            times[case][name].append(float(value))
        variant[case] = f[11].split("/")[0]
    return {c: {n: min(v) for n, v in t.items()} for c, t in times.items()}, variant


def summary(ratios: list[float]) -> str:
    if not ratios:
        return "no cases"
    mean = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return f"{mean:.3f}x  ({min(ratios):.3f}-{max(ratios):.3f}, {len(ratios)} cases)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    args = ap.parse_args()
    before, _ = load(args.before)
    after, picked = load(args.after)
    cases = sorted(set(before) & set(after))
    ratio = lambda c, col: after[c][col] / before[c][col]  # noqa: E731
    print("N-split tiling forced:", summary([ratio(c, "N-split") for c in cases]))
    print("  on Qwen3 and GLM-4.7:", summary([ratio(c, "N-split") for c in cases if not c[0].startswith("llama")]))
    print("  on Llama:           ", summary([ratio(c, "N-split") for c in cases if c[0].startswith("llama")]))
    print("launcher's pick:      ", summary([ratio(c, "pick") for c in cases]))
    for label, tilings in (("N-split (v2)", ("v2",)), ("wgmma (v3)", ("v3",)), ("16-row, control (v0/v1)", ("v0", "v1"))):
        print(f"  where it is {label}:", summary([ratio(c, "pick") for c in cases if picked[c] in tilings]))


if __name__ == "__main__":
    main()
