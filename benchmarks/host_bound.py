"""Is a jitted call over many products timed by the host or by the device? For one shape, M = 1
and 4, and R = 4/16/48 weight copies per call (kbit K=4 and the dense bf16 dot), prints:
  wall      seconds per product by kbit_jax.timing.median_call_seconds over one pass (what
            bench_matmul measured before it took passes),
  dispatch  the host's time to queue a call, per product (kbit_jax.timing.queue_seconds),
  kernel    the kernels' device time per product, from a profiler trace of 3 calls,
  span      first kernel start to last kernel end of those calls, per product.
Where dispatch exceeds kernel, one pass measured the host. (H200, qwen3 q 2048 x 4096, M = 1,
R = 48: wall 11.6, dispatch 14.6, kernel 7.2 us; `results/bench_host_bound_h200.log`.)

    python benchmarks/host_bound.py 2048 4096
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
import kbit_jax as kj  # noqa: E402
import profile_summary  # noqa: E402
from bench_matmul import weight_copy  # noqa: E402
from kbit_jax.timing import median_call_seconds, queue_seconds  # noqa: E402


def kernel_seconds(f, args, products, calls=3):
    """(kernel time, kernel span) per product over `calls` traced calls of f(*args)."""
    kernels = profile_summary.trace_kernels(lambda: f(*args), calls)
    busy = sum(end - start for start, end, _ in kernels)
    return busy / (calls * products) * 1e-6, (kernels[-1][1] - kernels[0][0]) / (calls * products) * 1e-6


def main():
    k, n = int(sys.argv[1]), int(sys.argv[2])
    w = jax.random.normal(jax.random.key(0), (k, n), jnp.float32) * 0.02
    w_q = kj.quantize(w, 4)
    for m in (1, 4):
        x = jax.random.normal(jax.random.key(m), (m, k)).astype(jnp.bfloat16)
        for r in (4, 16, 48):
            for kind in ("kbit4", "dense"):
                if kind == "dense":
                    ws = [w.astype(jnp.bfloat16) + i for i in range(r)]
                    f = jax.jit(lambda x, ws: [jnp.dot(x, q) for q in ws])
                else:
                    ws = [weight_copy(w_q) for _ in range(r)]
                    f = jax.jit(lambda x, ws: [kj.matmul(x, q) for q in ws])
                wall = median_call_seconds(f, (x, ws), 5) / r
                dispatch = queue_seconds(f, (x, ws)) / r
                kernel, span = kernel_seconds(f, (x, ws), r)
                print(f"K{k} N{n} M={m} R={r:2d} {kind:5s} wall {wall * 1e6:6.1f} us/prod  dispatch "
                      f"{dispatch * 1e6:6.1f}  kernel {kernel * 1e6:6.1f}  span {span * 1e6:6.1f}", flush=True)


if __name__ == "__main__":
    main()
