"""How consecutive kbit matmul kernels follow each other on the GPU inside one jitted program.

Profiles (jax.profiler) two chains of R products on cold weights and prints, per chain, the
median kbit kernel duration, the median time from the end of the kernel before it to its start
(negative: the two overlapped, as a programmatic dependent launch allows), and the chain's
span per product:
  * "back to back": R independent products in a row (what bench_matmul.py times);
  * "with fusions": y = x @ W_i, then an XLA elementwise fusion (an RMS norm) makes the next x,
    as in a decoder layer.
Run it with KBIT_JAX_PDL=0 / 1 and with XLA command buffers on (default) and off
(XLA_FLAGS=--xla_gpu_enable_command_buffer=) to see where the kernel launch attribute acts.

    python benchmarks/launch_overlap.py --k 2048 --n 2048 --bits 4     # (GPU: reads a profile)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import kbit_jax as kj  # noqa: E402
from bench_matmul import weight_copy  # noqa: E402
from profile_summary import trace_kernels  # noqa: E402


def chain(products: str):
    def back_to_back(x, ws):
        return [kj.matmul(x, w) for w in ws]

    def with_fusions(x, ws):
        for w in ws:
            y = kj.matmul(x, w).astype(jnp.float32)
            x = (y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)
        return x
    return jax.jit(back_to_back if products == "back to back" else with_fusions)


def measure(f, x, ws, calls: int) -> dict:
    kernels = trace_kernels(lambda: f(x, ws), calls)
    durations, gaps = [], []
    for i, (start, end, name) in enumerate(kernels):
        if "kbit_matmul" in name:
            durations.append(end - start)
            if i:
                gaps.append(start - kernels[i - 1][1])
    n = max(len(durations), 1)
    return {"kernel_us": statistics.median(durations), "gap_us": statistics.median(gaps),
            "span_us_per_product": (kernels[-1][1] - kernels[0][0]) / n, "products": len(durations)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n", type=int, default=2048, help="= K for the chain with fusions")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--m", type=int, default=1)
    p.add_argument("--products", type=int, default=32, help="weights per chain (cold: > L2 in total)")
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args()
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.standard_normal((args.k, args.n), np.float32) * 0.02)
    base = kj.quantize(w, bits=args.bits)
    ws = [weight_copy(base) for _ in range(args.products)]
    x = jnp.asarray(rng.standard_normal((args.m, args.k), np.float32)).astype(jnp.bfloat16)
    print(f"K {args.k} N {args.n} M {args.m} bits {args.bits}, {args.products} products; "
          f"KBIT_JAX_PDL={os.environ.get('KBIT_JAX_PDL', '(unset: on)')} "
          f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    for products in ("back to back", "with fusions"):
        if products == "with fusions" and args.k != args.n:
            continue
        r = measure(chain(products), x, ws, args.calls)
        print(f"  {products:13s} kbit kernel {r['kernel_us']:6.2f} us, gap before it {r['gap_us']:6.2f} us, "
              f"span per product {r['span_us_per_product']:6.2f} us ({r['products']} kernels)")


if __name__ == "__main__":
    main()
