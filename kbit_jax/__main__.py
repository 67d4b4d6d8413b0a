"""`python -m kbit_jax demo`: quantize a layer, run the fused matmul, print error and speed."""

from __future__ import annotations

import argparse
import sys
import time

import jax
import jax.numpy as jnp

import kbit_jax as kj
from kbit_jax.timing import median_call_seconds


def demo(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m kbit_jax demo", description=__doc__)
    on_gpu = jax.default_backend() == "gpu"
    parser.add_argument("--k", type=int, default=8192 if on_gpu else 4096, help="in_features")
    parser.add_argument("--n", type=int, default=28672 if on_gpu else 4096, help="out_features")
    parser.add_argument("--m", type=int, nargs="+", default=[1, 16], help="rows of x")
    parser.add_argument("--bits", type=int, nargs="+", default=[2, 3, 4, 5])
    parser.add_argument("--repeats", type=int, default=50 if on_gpu else 5)
    args = parser.parse_args(argv)

    device = jax.devices()[0]
    print(f"kbit_jax {kj.__version__} on {device.platform.upper()} ({device.device_kind}); "
          f"build: {kj.build_info()}")
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    w = jax.random.normal(jax.random.key(0), (args.k, args.n), jnp.float32) * 0.02
    dense = w.astype(dtype)
    dot = jax.jit(jnp.dot)
    exact = jax.jit(lambda x, w: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST))
    matmul = jax.jit(kj.matmul)
    print(f"layer {args.k} x {args.n}, activations {jnp.dtype(dtype).name}; "
          f"time per call: median of {args.repeats} samples of 10 queued calls (kbit_jax.timing)")
    print(f"{'bits':>4} {'M':>5} {'MB':>8} {'rel.err vs dense':>17} {'kbit ms':>9} {'dense ms':>9} {'speedup':>8}")
    for bits in args.bits:
        t0 = time.perf_counter()
        w_q = jax.block_until_ready(kj.quantize(w, bits))
        quantize_s = time.perf_counter() - t0
        for m in args.m:
            x = jax.random.normal(jax.random.key(m), (m, args.k), dtype)
            y = matmul(x, w_q)
            reference = exact(x.astype(jnp.float32), w)        # the unquantized product
            err = float(jnp.linalg.norm(y.astype(jnp.float32) - reference) / jnp.linalg.norm(reference))
            t_kbit = median_call_seconds(matmul, (x, w_q), args.repeats)
            t_dense = median_call_seconds(dot, (x, dense), args.repeats)
            print(f"{bits:>4} {m:>5} {w_q.nbytes / 1e6:>8.1f} {err:>17.4f} {t_kbit * 1e3:>9.3f} "
                  f"{t_dense * 1e3:>9.3f} {t_dense / t_kbit:>7.2f}x")
        print(f"     (quantize took {quantize_s:.2f} s, dense weight {dense.nbytes / 1e6:.1f} MB)")
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "demo":
        print("usage: python -m kbit_jax demo [--k K] [--n N] [--m M ...] [--bits B ...]")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return demo(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
