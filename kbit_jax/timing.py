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


def median_call_seconds(fn, args, repeats: int, calls: int = 10) -> float:
    """Median over `repeats` samples of the seconds per call of `calls` queued calls of fn(*args)."""
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)
