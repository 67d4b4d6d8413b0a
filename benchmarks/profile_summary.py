"""Where the GPU time of a profiled run goes: per-category kernel time, idle gaps, top kernels.

Reads the ``perfetto_trace.json.gz`` that ``jax.profiler.trace(..., create_perfetto_trace=True)``
writes (``bench_decode.py --profile DIR`` does so per row) and prints, for device 0: the span
from the first kernel's start to the last kernel's end, the time at least one kernel ran
("busy"), the rest ("idle": launch gaps, host waits), and the busy time split by category. With
``--steps`` every figure is also given per decode step. ``bench_decode.py --profile`` traces
only the decode loop and stores this summary in its JSON rows.

    python benchmarks/profile_summary.py /tmp/prof/llama3-8b-4-tp1-b1 --steps 63
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
from collections import defaultdict

#: Kernel-name patterns, first match wins. Everything else is an XLA-generated fusion.
CATEGORIES = [
    ("kbit fused matmul", re.compile(r"kbit_matmul")),
    ("kbit dequantize", re.compile(r"dequantize_kernel")),
    ("kbit other", re.compile(r"kbit")),
    ("NCCL", re.compile(r"nccl", re.I)),
    ("cuBLAS / dense GEMM", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|cublas|sm90_|sm80_", re.I)),
    ("memcpy / memset", re.compile(r"memcpy|memset", re.I)),
]
OTHER = "XLA fusions (attention, norms, rotary, cache, sampling)"


def find_trace(path: str) -> str:
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(path, "**", "perfetto_trace.json.gz"), recursive=True))
    if not found:
        raise SystemExit(f"no perfetto_trace.json.gz under {path} (profile with create_perfetto_trace=True)")
    return found[-1]


def load_trace(path: str) -> dict:
    """The perfetto trace JSON at `path` (a file, or the newest one under a directory)."""
    with gzip.open(find_trace(path)) as f:
        return json.load(f)


def _process_names(events) -> dict:
    """pid -> process name ("/host:CPU", "/device:GPU:0", ...) from the trace's metadata."""
    return {e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"}


def kernel_events(trace: dict, device: int = 0) -> list[tuple[float, float, str]]:
    """(start_us, end_us, name) of the kernels that ran on GPU `device`, sorted by start."""
    events = trace["traceEvents"]
    procs = _process_names(events)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "thread_name"}
    want = [pid for pid, name in procs.items() if re.search(rf"GPU:{device}\b", name)]
    if not want:
        raise SystemExit(f"no GPU:{device} process in the trace; processes: {sorted(procs.values())}")
    pid = want[0]
    # Kernels sit on the "Stream #..." threads; the other device threads (XLA Ops, XLA Modules)
    # repeat them as annotations and would double-count.
    streams = {tid for (p, tid), name in threads.items() if p == pid and name.startswith("Stream")}
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("pid") == pid and e.get("dur", 0) > 0:
            if streams and e.get("tid") not in streams:
                continue
            out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), e["name"]))
    out.sort()
    return out


def trace_kernels(run, calls: int = 3, device: int = 0) -> list[tuple[float, float, str]]:
    """kernel_events of GPU `device` while `calls` calls of run() execute under jax.profiler
    (after one untraced call: compile, warm-up)."""
    import tempfile

    import jax
    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            for _ in range(calls):
                out = run()
            jax.block_until_ready(out)
        return kernel_events(load_trace(d), device)


def host_summary(trace: dict, steps: int = 1, top: int = 8) -> str:
    """The host threads' XLA events (thunk launches; Python frames left out) with the largest
    total time: a launch path slower than the GPU's kernels shows here as host time per step
    above the step's span."""
    events = trace["traceEvents"]
    host = {pid for pid, name in _process_names(events).items() if "host" in name.lower()}
    total, count = defaultdict(float), defaultdict(int)
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in host and not e["name"].startswith(("$", "end: ")):
            name = re.sub(r"\.\d+$", "", e["name"])   # one row per op kind, not per HLO instance
            total[name] += float(e.get("dur", 0))
            count[name] += 1
    lines = ["host events with the largest total time (us per step, calls per step, mean us):"]
    for name, t in sorted(total.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {t / steps:10.1f}  x{count[name] / steps:6.1f}  {t / count[name]:8.1f}  {name[:80]}")
    return "\n".join(lines)


def category(name: str) -> str:
    for label, pattern in CATEGORIES:
        if pattern.search(name):
            return label
    return OTHER


def _idle_gaps(kernels) -> tuple[dict, dict, float]:
    """Idle time before each kernel (from the end of everything that ran before it; overlapping
    kernels leave no gap), summed and counted per category of the kernel that follows it; and
    the last end of any kernel."""
    gap, n = defaultdict(float), defaultdict(int)
    end = kernels[0][1]
    for s, e, name in kernels[1:]:
        if s > end:
            gap[category(name)] += s - end
            n[category(name)] += 1
        end = max(end, e)
    return gap, n, end


def _gap_lines(gap, n, steps) -> list[str]:
    """The idle gaps by following category: a category that collects most of the idle time is
    launched late (a slow host path, a graph boundary), not run slowly."""
    lines = ["idle time before kernels, by the category of the kernel that follows:"]
    for label, t in sorted(gap.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {label:<58s} {t / steps:10.1f}  ({n[label] / steps:.1f} gaps, "
                     f"mean {t / n[label]:.1f} us)")
    return lines


def _kbit_by_position(kernels, steps, period) -> list[str]:
    """Median time of the kbit matmul calls by their position modulo ``period`` (e.g. 4 in a
    decoder layer with q/k/v, o, gate/up and down projections), in order of execution."""
    calls = [e - s for s, e, name in kernels if category(name) == "kbit fused matmul"]
    if not calls or len(calls) % period:
        return [f"kbit matmul calls: {len(calls)}, not a multiple of {period}; no per-position times"]
    lines = [f"kbit matmul time by position in a period of {period} calls (median, min, max us):"]
    for i in range(period):
        t = sorted(calls[i::period])
        lines.append(f"  position {i}: {t[len(t) // 2]:8.1f} {t[0]:8.1f} {t[-1]:8.1f}  x{len(t) / steps:.1f} per step")
    return lines


def layer_sequence(kernels, period: int = 4) -> str:
    """The kernels of one decoder layer in the middle of the trace, in order: start (from the
    layer's first kbit matmul), idle gap before, duration, name. A layer is ``period``
    consecutive kbit matmul calls, so the listing runs from one q/k/v projection to the next;
    it shows which kernels the idle gaps precede and what a collective costs in place."""
    kbit = [i for i, (_, _, name) in enumerate(kernels) if category(name) == "kbit fused matmul"]
    if len(kbit) < 2 * period:
        return f"layer sequence: {len(kbit)} kbit matmul calls, fewer than two periods of {period}"
    first = kbit[(len(kbit) // period // 2) * period]
    last = kbit[kbit.index(first) + period]
    t0, end = kernels[first][0], kernels[first][0]
    lines = [f"one layer's kernels ({last - first}): start us, gap us, duration us, name"]
    for s, e, name in kernels[first:last]:
        lines.append(f"  {s - t0:8.1f} {max(0.0, s - end):6.1f} {e - s:8.1f}  {name[:90]}")
        end = max(end, e)
    return "\n".join(lines)


def busy_us(kernels: list[tuple[float, float, str]]) -> float:
    """The time at least one kernel ran: the union of the kernels' intervals."""
    if not kernels:
        return 0.0
    gap, _, last_end = _idle_gaps(kernels)
    return last_end - kernels[0][0] - sum(gap.values())


def summarize(kernels: list[tuple[float, float, str]], steps: int = 1, top: int = 12,
              period: int = 0) -> str:
    if not kernels:
        return "no kernels in the trace"
    span = kernels[-1][1] - kernels[0][0]
    gap, gap_count, _ = _idle_gaps(kernels)
    busy = busy_us(kernels)
    by_cat, by_name, count = defaultdict(float), defaultdict(float), defaultdict(int)
    for s, e, name in kernels:
        by_cat[category(name)] += e - s
        by_name[name] += e - s
        count[name] += 1
    per = f" per step (/{steps})" if steps > 1 else ""
    lines = [f"{len(kernels)} kernels; times in us{per}",
             f"  span  {span / steps:10.1f}", f"  busy  {busy / steps:10.1f}  ({100 * busy / span:.1f} %)",
             f"  idle  {(span - busy) / steps:10.1f}  ({100 * (span - busy) / span:.1f} %: launch gaps, waits)",
             "kernel time by category:"]
    for label, t in sorted(by_cat.items(), key=lambda kv: -kv[1]):
        lines.append(f"  {label:<58s} {t / steps:10.1f}  ({100 * t / busy:.1f} % of busy)")
    lines += _gap_lines(gap, gap_count, steps)
    if period:
        lines += _kbit_by_position(kernels, steps, period)
    lines.append(f"top {top} kernels:")
    for name, t in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {t / steps:10.1f}  x{count[name] / steps:6.1f}  {name[:100]}")
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="+", help="trace files or directories holding perfetto_trace.json.gz")
    p.add_argument("--steps", type=int, default=1, help="divide every time by this (decode steps)")
    p.add_argument("--device", type=int, default=0)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--period", type=int, default=0,
                   help="also give the kbit matmul times by call position modulo this (4 for a Llama layer)")
    p.add_argument("--layer", action="store_true",
                   help="also list one layer's kernels in order (a period of kbit matmul calls)")
    args = p.parse_args()
    for path in args.paths:
        print(f"== {path}")
        trace = load_trace(path)
        kernels = kernel_events(trace, args.device)
        print(summarize(kernels, args.steps, args.top, args.period))
        if args.layer:
            print(layer_sequence(kernels, args.period or 4))
        print(host_summary(trace, args.steps))


if __name__ == "__main__":
    main()
