"""Render benchmark JSON (bench_matmul.py) as a markdown table and a speedup-vs-M plot.

    python benchmarks/render.py benchmarks/results/matmul_h200.json    # -> .md and .png beside it
    python benchmarks/render.py --merge all.json part1.json part2.json   # runs split over calls
    python benchmarks/render.py --compare base.json new.json             # an A/B, to stdout

--merge joins the rows of runs made on one device (each row keeps the '% BW' of its own run's
copy bandwidth; a later run's row replaces an earlier one of the same shape, dtype, M and bits)
and records each part's header under "parts" (a part that is itself a merge brings its parts). --compare sets each row of the
second run beside the first run's row of the same shape, dtype, M and bits: two builds, or two
settings of one build, measured one after the other on one device.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys


def copy_bandwidths(result) -> str:
    def one(r):
        xla, memcpy = r.get("xla_copy_bandwidth_tbs"), r.get("memcpy_bandwidth_tbs")
        detail = f" (cudaMemcpy {memcpy:.2f}, XLA copy {xla:.2f})" if xla and memcpy else ""
        return f"{r['copy_bandwidth_tbs']:.2f} TB/s{detail}"
    parts = result.get("parts")
    if not parts:
        return one(result)
    return f"{len(parts)} runs merged: " + "; ".join(one(r) for r in parts)


def load(path):
    """One bench_matmul result (matmul.json)."""
    with open(path) as f:
        return json.load(f)


def merge(paths):
    """One result from bench_matmul runs split over several calls (same device and build). A
    row of a later part replaces an earlier part's row of the same shape, dtype, M and bits, in
    its place (a re-measurement of some rows); each kept row is marked with its part's index."""
    results = [load(path) for path in paths]
    devices = {r["device"] for r in results}
    if len(devices) != 1:
        raise SystemExit(f"--merge: runs from different devices {sorted(devices)}")
    timings = {_timing(r) for r in results}
    if len(timings) != 1:  # one table, one kind of time (bench_matmul.py --time)
        raise SystemExit(f"--merge: runs with different timings {sorted(timings)}")
    merged = {k: v for k, v in results[0].items() if k not in ("rows", "parts")}
    merged["parts"] = []
    rows = {}  # insertion order: a replaced row keeps its first place
    for r in results:
        # a part that is itself a merge brings its own parts (its rows keep their part indices)
        offset = len(merged["parts"])
        merged["parts"] += r.get("parts") or [{k: v for k, v in r.items() if k != "rows"}]
        for row in r["rows"]:
            rows[_row_key(row)] = dict(row, part=offset + (row.get("part", 0) if r.get("parts") else 0))
    merged["rows"] = list(rows.values())
    return merged


def _timing(result):
    """What a run's rows report: "busy" (every row the device's busy time) or "call" (the runs
    before bench_matmul.py had --time)."""
    return result.get("timing", "call")


def _row_key(r):
    return r["shape"], r["k"], r["n"], r["dtype"], r["m"], r["bits"]


def compare(base, new) -> str:
    """Markdown: the kbit time of every row of `new` against `base`'s row of the same shape,
    dtype, M and bits (rows without a partner are left out and counted), with the dense dot of
    each run and the new run's speedup over its dense dot; then the median ratio."""
    if base["device"] != new["device"]:
        raise SystemExit(f"--compare: runs from different devices ({base['device']}, {new['device']})")
    before = {_row_key(r): r for r in base["rows"]}
    lines = [] if _timing(base) == _timing(new) else [
        f"(base times are {_timing(base)} times, new times {_timing(new)} times: see bench_matmul.py --time)", ""]
    lines += ["| shape (K x N) | dtype | M | bits | base us | new us | new / base | dense us (base / new) "
              "| new speedup over dense |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    ratios, unpaired = [], 0
    for r in new["rows"]:
        b = before.get(_row_key(r))
        if b is None:
            unpaired += 1
            continue
        ratio = r["kbit_us"] / b["kbit_us"]
        ratios.append(ratio)
        lines.append(f"| {r['shape']} ({r['k']}x{r['n']}) | {r['dtype']} | {r['m']} | {r['bits']} | "
                     f"{b['kbit_us']:.1f} | {r['kbit_us']:.1f} | {ratio:.3f} | "
                     f"{b['dense_us']:.1f} / {r['dense_us']:.1f} | {r['speedup']:.2f}x |")
    if ratios:
        lines += ["", f"new / base: median {statistics.median(ratios):.3f} "
                      f"({min(ratios):.3f} .. {max(ratios):.3f}) over {len(ratios)} rows"]
    if unpaired:
        lines.append(f"({unpaired} rows of the new run have no partner in the base run)")
    return "\n".join(lines) + "\n"


def summary(result) -> str:
    """Markdown: the speedup over the dense dot by M (rows) and bits (columns), the geometric
    mean over the run's shapes with the lowest and highest in brackets, for one activation
    dtype (bf16 where the run has it)."""
    dtypes = [r["dtype"] for r in result["rows"]]
    if not dtypes:
        return ""
    dtype = "bfloat16" if "bfloat16" in dtypes else dtypes[0]
    cells = collections.defaultdict(list)
    for r in result["rows"]:
        if r["dtype"] == dtype:
            cells[(r["m"], r["bits"])].append(r["speedup"])
    ms, bits = sorted({m for m, _ in cells}), sorted({b for _, b in cells})
    shapes = len({r["shape"] for r in result["rows"] if r["dtype"] == dtype})
    lines = [f"Speedup over the dense {dtype} dot, geometric mean over {shapes} shapes (lowest-highest):",
             "", "| M | " + " | ".join(f"bits {b}" for b in bits) + " |",
             "|---:|" + "---:|" * len(bits)]
    for m in ms:
        row = []
        for b in bits:
            v = cells.get((m, b))
            row.append(f"{statistics.geometric_mean(v):.2f}x ({min(v):.2f}-{max(v):.2f})" if v else "")
        lines.append(f"| {m} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def markdown(result) -> str:
    busy = _timing(result) == "busy"
    timing = ("Every kbit and dense time is the device's busy time per product from a profile (the union "
              "of the kernels' intervals; bench_matmul.py --time busy); the other 16-bit dense dot's is "
              "its call time. " if busy else
              "Where the host still set the pace at the benchmark's cap on passes, '*' marks the "
              "device's busy time from a profile (and '<=', in older results without it, the call time: "
              "an upper bound). ")
    lines = [f"# kbit matmul vs dense jnp.dot: {result['device']}, jax {result['jax']}, {result['date']}",
             "",
             f"Copy bandwidth measured in the same run: {copy_bandwidths(result)}. "
             f"Times are device time per product with cold weights (see bench_matmul.py). "
             f"'% BW' = bytes moved by the kbit product / copy bandwidth / its time. {timing}"
             f"method={result['method']}.",
             "",
             summary(result),
             "| shape (K x N) | dtype | M | bits | kbit us | dense us | other 16-bit dense us | speedup | % BW | floor us |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def us(t, host_bound, profiled):  # where the host, not the device, set the call's pace
        return f"{t:.1f}" if busy or not host_bound else f"{t:.1f}*" if profiled else f"<={t:.1f}"

    for r in result["rows"]:
        lines.append(f"| {r['shape']} ({r['k']}x{r['n']}) | {r['dtype']} | {r['m']} | {r['bits']} | "
                     f"{us(r['kbit_us'], r.get('host_bound'), 'kbit_call_us' in r)} | "
                     f"{us(r['dense_us'], r.get('dense_host_bound'), 'dense_call_us' in r)} | {r.get('dense_other_us', float('nan')):.1f} | {r['speedup']:.2f}x | "
                     f"{100 * r['bw_fraction']:.0f}% | {r['floor_us']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(result, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    series = collections.defaultdict(list)
    # one dtype's speedups: bf16's where the run has them, else its first rows' (an fp16 run)
    dtypes = [r["dtype"] for r in result["rows"]]
    dtype = "bfloat16" if "bfloat16" in dtypes else dtypes[0]
    for r in result["rows"]:
        if r["dtype"] == dtype:
            series[(r["shape"], r["bits"])].append((r["m"], r["speedup"]))
    shapes = sorted({s for s, _ in series})
    all_bits = sorted({b for _, b in series})  # one panel per bits value the run has
    fig, axes = plt.subplots(1, len(all_bits), figsize=(5 * len(all_bits), 5), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, bits in zip(axes, all_bits):
        for shape in shapes:
            pts = sorted(series.get((shape, bits), []))
            if pts:
                ax.plot([m for m, _ in pts], [s for _, s in pts], marker="o", label=shape)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"bits = {bits}")
        ax.set_xlabel("M (rows of x)")
    axes[0].set_ylabel(f"speedup over dense {'bf16' if dtype == 'bfloat16' else 'fp16'} jnp.dot")
    axes[-1].legend(fontsize=7)
    fig.suptitle(f"kbit_jax matmul on {result['device']} ({result['date']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv):
    if argv[0] == "--compare":
        print(compare(load(argv[1]), load(argv[2])), end="")
        return
    if argv[0] == "--merge":
        path = argv[1]
        result = merge(argv[2:])
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    else:
        path = argv[0]
        result = load(path)
    stem = os.path.splitext(path)[0]
    with open(stem + ".md", "w") as f:
        f.write(markdown(result))
    try:
        plot(result, stem + ".png")
    except ImportError:
        print("matplotlib not installed: no plot")
    print(f"wrote {stem}.md")


if __name__ == "__main__":
    main(sys.argv[1:])
