"""Issue #3's three targets, scored on a bench_matmul.py result (matmul.json), as markdown.

    python benchmarks/targets.py benchmarks/results/matmul_h200_s50.json

1. Llama-3-8B and -70B gate/up and down, M = 1 and 16, every bits value: the compressed bytes
   move at >= 70 % of the copy bandwidth measured in the same run (the row's `bw_fraction`).
2. Qwen3 gate/up, down, q, o and GLM-4.7 shared gate/up, down at M = 1..16, K = 4: >= 1.5x
   faster than the dense bf16 dot.
3. No row, at any shape, M or bits, below 0.9x of the dense bf16 dot.

Each target gets a line (rows met / rows scored) and a table of its rows, misses first. A row
that the result does not hold is listed as missing; it counts as neither met nor missed. Only
bf16 rows are scored (the targets are stated for bf16 activations).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import render  # noqa: E402  (render.load: one bench_matmul result)

LLAMA = ("llama3_8b_gate_up", "llama3_8b_down", "llama3_70b_gate_up", "llama3_70b_down")
SMALL = ("qwen3_gate_up", "qwen3_down", "qwen3_q", "qwen3_o", "glm47_shared_gate_up", "glm47_shared_down")
COPY_FRACTION, SMALL_SPEEDUP, FLOOR_SPEEDUP = 0.70, 1.5, 0.9


def bf16_rows(result) -> dict:
    """{(shape, m, bits): row} of the result's bf16 rows."""
    return {(r["shape"], r["m"], r["bits"]): r for r in result["rows"] if r["dtype"] == "bfloat16"}


def score(rows: dict) -> list[dict]:
    """The three targets: for each, its title and [(key, value, met)] for the rows it names that
    the result holds, and the keys it names that the result lacks."""
    def collect(keys, value, threshold):
        held = [(k, value(rows[k]), value(rows[k]) >= threshold) for k in keys if k in rows]
        return held, [k for k in keys if k not in rows]

    llama = [(s, m, b) for s in LLAMA for m in (1, 16) for b in (2, 3, 4, 5)]
    small = [(s, m, 4) for s in SMALL for m in sorted({k[1] for k in rows if 1 <= k[1] <= 16} | {1, 16})]
    every = sorted(rows)
    targets = []
    for title, unit, keys, value, threshold in (
            ("Llama-3 gate/up and down at M = 1 and 16: >= 70 % of copy", "% of copy", llama,
             lambda r: r["bw_fraction"], COPY_FRACTION),
            ("Qwen3 / GLM-4.7 layers at M = 1..16, K = 4: >= 1.5x the dense dot", "speedup", small,
             lambda r: r["speedup"], SMALL_SPEEDUP),
            ("Every row: >= 0.9x the dense dot", "speedup", every, lambda r: r["speedup"], FLOOR_SPEEDUP)):
        held, missing = collect(keys, value, threshold)
        targets.append(dict(title=title, unit=unit, rows=held, missing=missing))
    return targets


def to_markdown(result, targets, only_misses_for_every=True) -> str:
    lines = [f"# Issue #3's targets on {result.get('device', '?')} ({result.get('date', '?')})", ""]
    for t in targets:
        met = sum(1 for _, _, ok in t["rows"] if ok)
        lines.append(f"- {t['title']}: **{met} of {len(t['rows'])}** rows met"
                     + (f" ({len(t['missing'])} not in the result)" if t["missing"] else ""))
    for i, t in enumerate(targets):
        rows = sorted(t["rows"], key=lambda x: (x[2], x[1]))  # misses first, worst first
        if only_misses_for_every and i == len(targets) - 1:
            rows = [x for x in rows if not x[2]]
        lines += ["", f"## {t['title']}", "", f"| layer | M | bits | {t['unit']} | met |", "|---|---:|---:|---:|---|"]
        for (shape, m, bits), value, ok in rows:
            shown = f"{100 * value:.0f} %" if t["unit"] == "% of copy" else f"{value:.2f}x"
            lines.append(f"| {shape} | {m} | {bits} | {shown} | {'yes' if ok else 'no'} |")
        for shape, m, bits in t["missing"]:
            lines.append(f"| {shape} | {m} | {bits} | - | not measured |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("result", help="a bench_matmul.py matmul.json (or a render.py --merge of several)")
    p.add_argument("--all-rows", action="store_true", help="list every row under target 3, not only its misses")
    args = p.parse_args(argv)
    result = render.load(args.result)
    print(to_markdown(result, score(bf16_rows(result)), only_misses_for_every=not args.all_rows), end="")


if __name__ == "__main__":
    main()
