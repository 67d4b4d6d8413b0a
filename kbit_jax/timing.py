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
import jax.numpy as jnp


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


def queue_seconds(fn, args, calls: int = 10) -> float:
    """Seconds the host takes to queue one call of fn(*args) (the last call is awaited afterwards).

    Only the last call's outputs are kept: holding all of them adds 10 calls' outputs to the peak
    (Llama-3-70B gate/up at M = 4096: 10 x 4 weights x 224 MiB), and it was there that a
    three-bits run of bench_matmul.py ran an 80 GB H100 out of memory."""
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    seconds = (time.perf_counter() - start) / calls
    jax.block_until_ready(out)
    return seconds


#: A sample measures the device only while queueing a call takes well under the call's time.
HOST_BOUND_FRACTION = 0.7


def host_bound(queue_s: float, call_s: float) -> bool:
    """Whether queueing a call took more than HOST_BOUND_FRACTION of its measured time, i.e. the
    host, not the device, set the pace."""
    return queue_s > HOST_BOUND_FRACTION * call_s


def more_passes(passes: int, queue_s: float, call_s: float, max_passes: int) -> int:
    """The next pass count for products_seconds: twice `passes` while the call was host-bound and
    the cap allows; 0 when the measurement stands."""
    if not host_bound(queue_s, call_s) or passes >= max_passes:
        return 0
    return min(2 * passes, max_passes)


def passes_function(product):
    """jit of (xs, ws) -> [product(x, w) for x in xs for w in ws], pass by pass: the x of pass
    p + 1 comes out of an optimization barrier together with pass p's results, so every product of
    a pass waits for the previous pass. Without it XLA may run one weight's products of all passes
    back to back (the later ones then read the weight from L2, not HBM) or merge them into one
    dot (its dot merger joins independent dots that share an operand): on the H200 a 21 MB bf16
    weight read 4.6 us per M = 1 product over 8 passes, 4.6 TB/s, above the copy bandwidth."""
    def run(xs, ws):
        outs, prev = [], None
        for p, xi in enumerate(xs):
            if p:
                xi, _ = jax.lax.optimization_barrier((xi, prev))
            prev = [product(xi, w) for w in ws]
            outs += prev
        return outs
    return jax.jit(run)


def products_seconds(product, x, weights, repeats: int, max_passes: int = 8,
                     passes: int = 1, warmup_seconds: float = 0.2) -> tuple[float, int, bool]:
    """Device seconds per product(x, w) over the distinct buffers in `weights` (enough of them to
    miss the L2: cold weights), the passes it took, and whether the host still set the pace at
    `max_passes` (the time is then an upper bound).

    One jitted call runs `passes` passes over the weights, each pass with its own copy of x (so
    that no product is a common subexpression of another) and after the previous pass
    (passes_function). The host's cost of a call grows with its argument leaves, the device's
    with the products: on the H200 machine queueing a call over 48 kbit weights (192 leaves)
    took 0.7 ms, 14.6 us per product, for a 7.2 us kernel, so one pass measured the host. The
    passes double until queueing a call takes at most HOST_BOUND_FRACTION of its time. (Measured
    there: qwen3 q at M = 1 read 7.6 us after 8 passes; at M = 4 it reached the cap of 8 at
    11.2 us, for a kernel of the same 7.2 us.) `passes` is where the search starts: a caller
    timing similar products passes the count the last one needed, which saves the compiles of the
    smaller counts (more passes never hurt the figure). `warmup_seconds` goes to
    median_call_seconds.
    """
    passes = max(1, min(passes, max_passes))
    f = passes_function(product)  # one jit; each pass count traces it once
    while True:
        xs = [x] + [jnp.copy(x) for _ in range(passes - 1)]
        call_s = median_call_seconds(f, (xs, weights), repeats, warmup_seconds=warmup_seconds)
        queue_s = queue_seconds(f, (xs, weights))
        nxt = more_passes(passes, queue_s, call_s, max_passes)
        if not nxt:
            # A second median, and the smaller one stands: on an H100 about one measurement in
            # 15 read 1.2-2.4x slow, dense dots too; a rerun of those rows did not repeat it,
            # but hit other rows.
            again_s = median_call_seconds(f, (xs, weights), repeats, warmup_seconds=warmup_seconds)
            call_s = min(call_s, again_s)
            # The smaller median may show that the host set the pace after all: then double on.
            nxt = more_passes(passes, queue_s, call_s, max_passes)
        if not nxt:
            return call_s / (passes * len(weights)), passes, host_bound(queue_s, call_s)
        passes = nxt
