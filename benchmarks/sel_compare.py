"""Compare "SEL" timing lines of the CUDA kernel harness (benchmarks/cuda_kernel_harness.cu sel).

    python benchmarks/sel_compare.py AFTER.log [BEFORE.log ...] [--md OUT.md]

Each log holds lines `SEL <shape> <K> <N> <bits> <M> <us_v0> <us_v1> <us> <GB/s> <% copy>`
(the selected time is `us`). With several BEFORE logs (or AFTER logs given as A,B,...), the
per-row median is used, which is how tools/kernel_profile.sh ab evens out drift between runs.
Prints the ratio after/before per M group and optionally writes a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class SelRow:
    shape: str
    k: int
    n: int
    bits: int
    m: int
    us: float
    pct_copy: float


def parse_sel(text: str) -> dict[tuple[str, int, int], SelRow]:
    """Rows keyed by (shape, bits, M); lines that are not SEL lines are ignored."""
    rows = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 11 or parts[0] != "SEL":
            continue
        row = SelRow(parts[1], int(parts[2]), int(parts[3]), int(parts[4]), int(parts[5]),
                     float(parts[8]), float(parts[10]))
        rows[(row.shape, row.bits, row.m)] = row
    return rows


def median_rows(logs: list[dict[tuple[str, int, int], SelRow]]) -> dict[tuple[str, int, int], SelRow]:
    """Per-row median time over several runs (rows present in every run)."""
    out = {}
    for key in logs[0] if logs else ():  # the harness's row order
        if not all(key in log for log in logs[1:]):
            continue
        runs = sorted((log[key] for log in logs), key=lambda r: r.us)
        out[key] = runs[len(runs) // 2]
    return out


def ratio_summary(after, before) -> dict[str, tuple[float, float, float]]:
    """after/before time ratio per M group: (min, median, max)."""
    groups: dict[str, list[float]] = {}
    for key, row in after.items():
        if key in before:
            label = "M<=8" if row.m <= 8 else f"M={row.m}"
            groups.setdefault(label, []).append(row.us / before[key].us)
    return {g: (min(v), statistics.median(v), max(v)) for g, v in sorted(groups.items())}


def markdown_table(after, before) -> str:
    lines = ["| shape (K x N) | bits | M | before us | after us | after % copy |",
             "|---|---:|---:|---:|---:|---:|"]
    for key, row in after.items():  # harness order
        b = before.get(key)
        lines.append(f"| {row.shape} ({row.k} x {row.n}) | {row.bits} | {row.m} | "
                     f"{f'{b.us:.1f}' if b else ''} | {row.us:.1f} | {row.pct_copy:.1f} |")
    return "\n".join(lines) + "\n"


def _load(paths: str) -> dict[tuple[str, int, int], SelRow]:
    logs = []
    for path in paths.split(","):
        with open(path) as f:
            logs.append(parse_sel(f.read()))
    return median_rows(logs) if len(logs) > 1 else logs[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("after", help="SEL log(s) of the new kernel, comma-separated for a median")
    p.add_argument("before", nargs="?", default=None, help="SEL log(s) of the baseline")
    p.add_argument("--md", default=None, help="write a markdown table here")
    args = p.parse_args()
    after = _load(args.after)
    before = _load(args.before) if args.before else {}
    for group, (lo, med, hi) in ratio_summary(after, before).items():
        print(f"{group}: after/before time {lo:.3f} .. {hi:.3f} (median {med:.3f})")
    if args.md:
        with open(args.md, "w") as f:
            f.write(markdown_table(after, before))


if __name__ == "__main__":
    main()
