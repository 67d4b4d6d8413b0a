"""Session 48, harness `wgplans` A/Bs on an H200 (calls 1, 4 and 5): the wgmma kernel's cluster
sum against the session's start (71386e6), two runs of each tree alternating, plus one run each
with a GLU (KBIT_HARNESS_GLU=1):

    swizzle  the final add's 16-byte pieces loaded in a swizzled order (call 1)
    rolled   + the final add rank by rank in a short loop, no pull code where every cluster
             size pushes (call 4; the committed kernel)
    batch    + the push's loads of a batch of rows before their sends (call 5; not kept)

Prints wgmma64_s47_ab.py's summary for each (same forced tile, the base's spread, the launcher's
picks per shape), then the GLU run's picks per shape.

    python3 benchmarks/results/cluster_sum_s48_ab.py [swizzle|rolled|batch ...]
"""

import collections
import os
import sys

import wgmma64_s47_ab as ab

HERE = os.path.dirname(os.path.abspath(__file__))


def glu(prefix):
    _, base = ab.load(os.path.join(HERE, f"{prefix}_wgplans_glu_base1.log"))
    _, new = ab.load(os.path.join(HERE, f"{prefix}_wgplans_glu_new1.log"))
    picks = collections.defaultdict(list)
    for k, b in base.items():
        if k in new:
            picks[k[0]].append(new[k][2] / b[2])
    for shape, r in sorted(picks.items()):
        print(f"GLU pick {shape:20s}: new / base {ab.gmean(r):.3f} ({min(r):.3f}..{max(r):.3f})")
    every = [x for r in picks.values() for x in r]
    print(f"GLU every pick: {len(every)} cases, new / base {ab.gmean(every):.3f}")


if __name__ == "__main__":
    for step in sys.argv[1:] or ["swizzle", "rolled", "batch"]:
        prefix = f"cluster_sum_h200_s48_{step}"
        ab.main(prefix, HERE)
        glu(prefix)
