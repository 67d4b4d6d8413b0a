"""Session 33: where bench_matmul.py's time goes at M = 16 (Llama layers). Profiles the
benchmark's function (kbit_jax.matmul over the rotating cold weights, one pass) and prints, per
case, the kernels' count, their span, the median gap between consecutive kernels (negative:
they overlap) and each kernel name's median and minimum duration. GPU only; from the repository
root:
    python3 benchmarks/results/bits5_tables_s33_jax_profile.py
"""
import collections
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import kbit_jax as kj  # noqa: E402
from bench_matmul import rotation_count, weight_copy  # noqa: E402
from kbit_jax.timing import passes_function  # noqa: E402
from profile_summary import trace_kernels  # noqa: E402

CASES = [("llama3_70b_down", 28672, 8192, 16, 5), ("llama3_70b_down", 28672, 8192, 16, 4),
         ("llama3_70b_gate_up", 8192, 28672, 16, 5), ("llama3_8b_down", 14336, 4096, 16, 5),
         ("llama3_70b_down", 28672, 8192, 1, 4)]
for name, k, n, m, bits in CASES:
    w_q = kj.quantize(jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * 0.02, bits)
    ws = [weight_copy(w_q) for _ in range(rotation_count(w_q.nbytes))]
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
    f = passes_function(lambda x, w: kj.matmul(x, w))
    events = trace_kernels(lambda: f([x], ws), 3)
    by_name = collections.defaultdict(list)
    for start, end, kernel in events:
        by_name[kernel[:70]].append(end - start)
    gaps = [events[i + 1][0] - events[i][1] for i in range(len(events) - 1)]
    print(f"{name} M={m} bits={bits} R={len(ws)}: {len(events)} kernels, span {events[-1][1] - events[0][0]:.1f} us, "
          f"median gap {statistics.median(gaps):.2f} us")
    for kernel, d in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"   x{len(d):4d} median {statistics.median(d):8.2f} us  min {min(d):8.2f}  {kernel}")
