"""Timing a jitted call by its device time, for the demo and the benchmarks.

A blocking call per sample measures dispatch and host latency, not the device: on an H200 that
made a 121 us dense 70B product look like 300 us. So each sample queues `calls` calls back to
back without waiting (JAX dispatches asynchronously, so the device runs them end to end and the
host overhead hides behind device work), then awaits the last result.
"""

from __future__ import annotations

import statistics
import time

import jax


def median_call_seconds(fn, args, repeats: int, calls: int = 10, warmup_seconds: float = 0.2) -> float:
    """Median over `repeats` samples of the seconds per call of `calls` queued calls of fn(*args).

    The samples follow `warmup_seconds` of untimed batches: a GPU left idle while the host
    compiles a new shape starts at low clocks, and a single warm-up call does not bring them up
    (bench_matmul.py read the first M of each small shape up to 2x slow, dense dot included).
    """
    jax.block_until_ready(fn(*args))  # compile
    start = time.perf_counter()
    while time.perf_counter() - start < warmup_seconds:
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)
