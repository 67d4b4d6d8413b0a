"""A small workload for compute-sanitizer (tools/gpu_check.sh): every CUDA kernel once per bits."""

import jax
import jax.numpy as jnp

import kbit_jax as kj

for bits in (2, 3, 4, 5):
    w = jax.random.normal(jax.random.key(bits), (256, 136))
    for layout in ("planes", "fragment"):
        q = kj.quantize(w, bits, layout=layout)
        jax.block_until_ready(kj.dequantize(q, jnp.bfloat16))
        for m in (1, 5, 17, 64):
            for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
                x = jax.random.normal(jax.random.key(m), (m, 256), dtype)
                jax.block_until_ready(kj.matmul(x, q, method="fused"))
print("sanitize case done")
