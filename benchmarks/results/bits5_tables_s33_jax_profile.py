"""Where the JAX-vs-harness gap goes: profile kbit_jax.matmul over rotating weights (as bench_matmul does)
and print each kernel name's count and median duration, plus the gaps between consecutive kernels."""
import collections, statistics, sys, os
sys.path.insert(0, "benchmarks")
import jax, jax.numpy as jnp, numpy as np
import kbit_jax as kj
from kbit_jax.timing import passes_function
from profile_summary import trace_kernels
from bench_matmul import rotation_count, weight_copy
for name, k, n, m, bits in [("llama3_70b_down", 28672, 8192, 16, 5), ("llama3_70b_down", 28672, 8192, 16, 4),
                            ("llama3_70b_gate_up", 8192, 28672, 16, 5), ("llama3_8b_down", 14336, 4096, 16, 5),
                            ("llama3_70b_down", 28672, 8192, 1, 4)]:
    w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * 0.02
    w_q = kj.quantize(w, bits)
    ws = [weight_copy(w_q) for _ in range(rotation_count(w_q.nbytes))]
    x = jax.random.normal(jax.random.key(m), (m, k), jnp.float32).astype(jnp.bfloat16)
    f = passes_function(lambda x, w: kj.matmul(x, w))
    ev = trace_kernels(lambda: f([x], ws), 3)
    d = collections.defaultdict(list)
    for s, e, nm in ev: d[nm[:70]].append(e - s)
    gaps = [ev[i + 1][0] - ev[i][1] for i in range(len(ev) - 1)]
    print(f"{name} M={m} bits={bits} R={len(ws)}: {len(ev)} kernels, span {(ev[-1][1]-ev[0][0]):.1f} us, "
          f"median gap {statistics.median(gaps):.2f} us")
    for nm, v in sorted(d.items(), key=lambda kv: -sum(kv[1])):
        print(f"   x{len(v):4d} median {statistics.median(v):8.2f} us  min {min(v):8.2f}  {nm}")
