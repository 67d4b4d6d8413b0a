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


#: Attention kernels (the Pallas decode attention: ``decode_attention_step``); a decoder layer's
#: q/k/v product is the last kbit matmul before one. XLA's attention runs as fusions, which do not.
ATTENTION = re.compile(r"attention", re.I)
#: The grouped (expert, ``kbit_ragged_dot``) products: the fused kernels with a group operand, or
#: the ragged SIMT kernel. A trace holding one is not a dense decoder's.
GROUPED = re.compile(r"GroupParams|WgGroups|ragged", re.I)
#: The kbit products of a dense decoder layer (`kbit_jax.models.decoder`: Attention then MLP), in
#: order from the q/k/v product: q/k/v, the attention, o_proj, the norm, gate/up (SwiGLU in the
#: kernel), down.
DENSE_ROLES = ("q/k/v", "o_proj", "gate/up", "down")


def _is_kbit_matmul(name: str) -> bool:
    return category(name) == "kbit fused matmul"


def qkv_products(kernels) -> list[int]:
    """Indices (into `kernels`) of the q/k/v products: the last kbit matmul before each attention
    kernel. Empty when the trace holds no attention kernel (XLA attention: fusions)."""
    out, last = [], None
    for i, (_, _, name) in enumerate(kernels):
        if _is_kbit_matmul(name):
            last = i
        elif ATTENTION.search(name) and last is not None and (not out or out[-1] != last):
            out.append(last)
    return out


def decoder_layers(kernels, period: int):
    """The trace cut into decoder layers: ``(anchored, layers, apart, past)``. Anchored (the trace
    has attention kernels): a layer runs from one q/k/v product to the next (the last one to the
    trace's end) and is whole when it holds exactly ``period`` kbit matmul calls; a step's last
    layer also holds the lm_head's call when the head is quantized, so it is not whole. Not
    anchored: consecutive runs of ``period`` kbit matmul calls from the first, whose first
    product's role is unknown. ``layers``: the whole layers as (first kernel index, end kernel
    index, kbit call indices); ``apart``: the kbit call indices outside them; ``past``: those of
    ``apart`` that follow the first ``period`` calls of a layer holding more (the lm_head at a
    step's end; anchored only)."""
    kbit = [i for i, (_, _, name) in enumerate(kernels) if _is_kbit_matmul(name)]
    anchors = qkv_products(kernels)
    if anchors:
        bounds = anchors + [len(kernels)]
        spans = [(a, b, [i for i in kbit if a <= i < b]) for a, b in zip(bounds, bounds[1:])]
        layers = [span for span in spans if len(span[2]) == period]
        past = [i for _, _, calls in spans if len(calls) > period for i in calls[period:]]
    else:
        starts = kbit[::period] + [len(kernels)]
        layers = [(starts[j], starts[j + 1], kbit[j * period:(j + 1) * period])
                  for j in range(len(kbit) // period)]
        past = []
    inside = {i for _, _, calls in layers for i in calls}
    return bool(anchors), layers, [i for i in kbit if i not in inside], past


def _roles(kernels, anchored: bool, period: int) -> list[str]:
    """Labels of a layer's kbit products in order: `DENSE_ROLES` for a dense decoder's layers of 4
    anchored at their q/k/v product (no grouped expert product in the trace); otherwise "q/k/v"
    first when anchored and positions for the rest."""
    if anchored and period == len(DENSE_ROLES) and not any(GROUPED.search(name) for _, _, name in kernels):
        return list(DENSE_ROLES)
    return (["q/k/v"] if anchored else ["position 0"]) + [f"position {k}" for k in range(1, period)]


def _kbit_by_position(kernels, steps, period) -> list[str]:
    """Median time of the kbit matmul calls by their position in a decoder layer (`decoder_layers`:
    from the q/k/v product when the trace has attention kernels), in order of execution; the calls
    outside whole layers (the lm_head, a step's last layer with it) are counted apart."""
    anchored, layers, apart, past = decoder_layers(kernels, period)
    n_kbit = sum(1 for _, _, name in kernels if _is_kbit_matmul(name))
    if not anchored and (not n_kbit or n_kbit % period):
        return [f"kbit matmul calls: {n_kbit}, not a multiple of {period} and no attention kernel to "
                f"find the layers by; no per-position times"]
    if not layers:
        return [f"kbit matmul calls: {n_kbit}, no layer of {period} from one q/k/v product to the next; "
                f"no per-position times"]
    roles = _roles(kernels, anchored, period)
    start = "from the q/k/v product" if anchored else "from the first call; the first product's role is unknown"
    lines = [f"kbit matmul time by position in a layer of {period} calls ({start}; "
             f"{len(layers) / steps:.1f} whole layers per step; median, min, max us):"]
    for k in range(period):
        t = sorted(kernels[calls[k]][1] - kernels[calls[k]][0] for _, _, calls in layers)
        lines.append(f"  {roles[k] + ':':<11s} {t[len(t) // 2]:8.1f} {t[0]:8.1f} {t[-1]:8.1f}  "
                     f"x{len(t) / steps:.1f} per step")
    if apart:
        total = sum(kernels[i][1] - kernels[i][0] for i in apart)
        lines.append(f"  outside whole layers: x{len(apart) / steps:.1f} per step, {total / steps:.1f} us per step")
    if past:
        t = sorted(kernels[i][1] - kernels[i][0] for i in past)
        lines.append(f"    of them after a layer's {period} products (at a step's end: the lm_head): "
                     f"x{len(t) / steps:.1f} per step, median {t[len(t) // 2]:.1f} us")
    return lines


def layer_sequence(kernels, period: int = 4) -> str:
    """The kernels of one whole decoder layer in the middle of the trace (`decoder_layers`), in
    order: start (from the layer's first kbit matmul), idle gap before, duration, role (with
    attention kernels in the trace: q/k/v, then o_proj, gate/up, down in a dense decoder's layers
    of 4, positions otherwise), name. With attention kernels in the trace the listing runs from
    one q/k/v product to the next and holds no step boundary (no lm_head); it shows which kernels
    the idle gaps precede and what a collective costs in place."""
    anchored, layers, _, _ = decoder_layers(kernels, period)
    # A listing ends at the next layer's first product, not at the trace's end (only the last
    # layer can run to it).
    ended = [layer for layer in layers if layer[1] < len(kernels)]
    if not ended:
        n_kbit = sum(1 for _, _, name in kernels if _is_kbit_matmul(name))
        if anchored:
            return (f"layer sequence: {n_kbit} kbit matmul calls, no layer of {period} from one q/k/v "
                    f"product to the next")
        return f"layer sequence: {n_kbit} kbit matmul calls, fewer than two periods of {period}"
    first, last, calls = ended[min(len(layers) // 2, len(ended) - 1)]
    roles = _roles(kernels, anchored, period)
    role_of = dict(zip(calls, roles)) if anchored else {}
    start = ("from its q/k/v product" if anchored else
             f"{period} kbit matmul calls; no attention kernel in the trace, so the first product's role is unknown")
    t0, end = kernels[first][0], kernels[first][0]
    lines = [f"one layer's kernels ({last - first}, {start}): start us, gap us, duration us, "
             + ("role, name" if anchored else "name")]
    for i in range(first, last):
        s, e, name = kernels[i]
        role = f"{role_of.get(i, ''):<10s} " if anchored else ""
        lines.append(f"  {s - t0:8.1f} {max(0.0, s - end):6.1f} {e - s:8.1f}  {role}{name[:90]}")
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
                   help="also give the kbit matmul times by position in a decoder layer of this many calls "
                        "(4 for a Llama layer: q/k/v, o_proj, gate/up, down)")
    p.add_argument("--layer", action="store_true",
                   help="also list one decoder layer's kernels in order (from one q/k/v product to the next)")
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
