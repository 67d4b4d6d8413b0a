"""A small workload for compute-sanitizer (tools/gpu_check.sh): every CUDA kernel once per bits.

    python tools/sanitize_case.py [PART ...]   the named parts (default: all): small, clusters,
                                               glu, wide5, wgmma, wgmma_f16, wgmma64, ragged
                                               (racecheck
                                               over all of them takes minutes)
"""

import sys

import jax
import jax.numpy as jnp

import kbit_jax as kj


def small():
    # (K, N): N = 136 and 257 end inside a tile (257 at M = 33 once read past the scales), N = 256
    # takes the warp-specialized (TMA) kernel at M <= 128 (M = 1, 5: one n8 tile; 12: two; 17, 33,
    # 64: several blocks of 16 rows, the last one partial at 17 and 33), K = 320 ends in a partial
    # chunk.
    shapes = ((256, 136), (320, 257), (256, 256))
    for bits, (k, n) in [(b, s) for b in (2, 3, 4, 5) for s in shapes]:
        w = jax.random.normal(jax.random.key(bits), (k, n))
        for layout in ("planes", "fragment"):
            q = kj.quantize(w, bits, layout=layout)
            jax.block_until_ready(kj.dequantize(q, jnp.bfloat16))
            for m in (1, 5, 12, 17, 33, 64):
                for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
                    x = jax.random.normal(jax.random.key(m), (m, k), dtype)
                    jax.block_until_ready(kj.matmul(x, q, method="fused"))


def clusters():
    # Larger products on the launcher's own plan (bf16 and f16): N = 8192 at M = 17, 33, 64 takes
    # the N-split tiling (blocks of 32 or 64 rows, the last one partial at 17 and 33), mostly with
    # 2-CTA k-split clusters, whose warps add their sums across the cluster (item_reduce.cuh:
    # WarpClusterReducer); K = 4096, N = 256 at M = 1 and 12 has 4 column groups, so the launcher
    # splits K over clusters of up to 8 CTAs, whose ranks send their sums to rank 0
    # (ItemReducer); K = 2048, N = 256 takes chunk-balanced clusters of 4 CTAs (ItemWalk), each
    # item's owner adding three ranks' pieces (ItemReducer::finish_piece); K = 128, N = 16384 at
    # M = 9 and 16 takes the N-split tiling in blocks of 16 rows with bf16. (Longer walks of
    # pieces, e.g. K = 8192, N = 5120, run in the harness's test; under racecheck they take
    # minutes.)
    # (Bits 5's 64-column tiling: the wide5 part.)
    cases = [(((256, 8192), (17, 33, 64)), (2, 3, 4, 5)), (((4096, 256), (1, 12)), (2, 3, 4, 5)),
             (((2048, 256), (1, 12)), (2, 3, 4, 5)), (((128, 16384), (9, 16)), (2, 3, 4, 5))]
    for ((k, n), ms), bits_values in cases:
        for bits in bits_values:
            q = kj.quantize(jax.random.normal(jax.random.key(bits), (k, n)), bits)
            for m in ms:
                for dtype in (jnp.bfloat16, jnp.float16):
                    x = jax.random.normal(jax.random.key(m), (m, k), dtype)
                    jax.block_until_ready(kj.matmul(x, q, method="fused"))


def glu():
    # The GLU epilogue (shuffled gate/up pairs, N / 2 columns stored): every path above once, bits
    # 4.
    for (k, n), ms in (((256, 136), (1, 12)), ((256, 256), (5, 33)), ((256, 8192), (17,)),
                       ((4096, 256), (1,)), ((2048, 256), (12,))):
        q = kj.quantize(jax.random.normal(jax.random.key(k + n), (k, n)), 4)
        for m in ms:
            for dtype in (jnp.bfloat16, jnp.float32):
                x = jax.random.normal(jax.random.key(m), (m, k), dtype)
                jax.block_until_ready(kj.matmul(x, q, method="fused", glu="silu"))


def wide5():
    # Bits 5's 64-column tiling (Tiling::kWideBits5, variant 4) on K = 2048, N = 5120 (Qwen3 gate/up), 80 items on as
    # many CTAs: in 16-row blocks at M = 12 (the launcher's plan), in 8-row blocks from the 128 KiB
    # table at M = 1 (planned) and 5 (its rule at M = 4..8); bf16 and fp16, and a GLU at M = 1.
    q = kj.quantize(jax.random.normal(jax.random.key(5), (2048, 5120)), 5)
    for m in (1, 5, 12):
        for dtype in (jnp.bfloat16, jnp.float16):
            x = jax.random.normal(jax.random.key(m), (m, 2048), dtype)
            jax.block_until_ready(kj.matmul(x, q, method="fused"))
    x = jax.random.normal(jax.random.key(1), (1, 2048), jnp.bfloat16)
    jax.block_until_ready(kj.matmul(x, q, method="fused", glu="silu"))


# (K, N) and M values of the wgmma parts (see wgmma)
_WGMMA_SHAPES = (((544, 400), (33, 65, 128, 200)), ((4096, 256), (48, 100, 200)), ((512, 20480), (100,)))


def wgmma():
    # The wgmma kernel (bf16 and fp16, N % 16 == 0, M = 33..512 here): K = 544 ends in a partial
    # ring stage, N = 400 in a partial column tile; K = 4096, N = 256 splits K over a cluster;
    # a GLU. These small layers take 128-column tiles, on two warpgroup pairs up to 128 rows
    # (bits 5 at 65..128 with the 64 KiB table), at M = 200 two row tiles of 128, the second
    # partial; N = 20480 keeps the 256-column one (the launcher's cost model, matmul_wgmma.cuh).
    # K = 8192, N = 2048 at M = 256 takes the 256-row tile over 6-CTA clusters, whose sum pulls
    # rank by rank (bits 4 only: the largest case here). A GLU with bf16.
    for bits in (2, 3, 4, 5):
        shapes = _WGMMA_SHAPES + ((((8192, 2048), (256,)),) if bits == 4 else ())
        for (k, n), ms in shapes:
            q = kj.quantize(jax.random.normal(jax.random.key(bits), (k, n)), bits)
            for m in ms:
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
                jax.block_until_ready(kj.matmul(x, q))
                jax.block_until_ready(kj.matmul(x, q, glu="silu"))
                jax.block_until_ready(kj.matmul(x.astype(jnp.float16), q))


def wgmma_f16():
    # The wgmma kernel's fp16 instantiations alone (racecheck over the whole wgmma part takes
    # more than 3 minutes): the shapes above, bits 2 and 5.
    for bits in (2, 5):
        for (k, n), ms in _WGMMA_SHAPES:
            q = kj.quantize(jax.random.normal(jax.random.key(bits), (k, n)), bits)
            for m in ms:
                x = jax.random.normal(jax.random.key(m), (m, k), jnp.float16)
                jax.block_until_ready(kj.matmul(x, q))


def wgmma64():
    # The wgmma kernel's 64-column tile (four warpgroups, each with its own chunks and tile; M <=
    # 64): K = 2048, N = 4096 at M = 48 (64 tiles over 2-CTA clusters), K = 4096, N = 256 at M = 40
    # (4 tiles over 8-CTA clusters, a partial row tile); a GLU; fp16 at bits 3.
    for bits in (2, 3, 4, 5):
        for (k, n), m in (((2048, 4096), 48), ((4096, 256), 40)):
            q = kj.quantize(jax.random.normal(jax.random.key(bits), (k, n)), bits)
            x = jax.random.normal(jax.random.key(m), (m, k), jnp.bfloat16)
            jax.block_until_ready(kj.matmul(x, q))
            jax.block_until_ready(kj.matmul(x, q, glu="silu"))
            if bits == 3:
                jax.block_until_ready(kj.matmul(x.astype(jnp.float16), q))


def ragged():
    # The grouped expert product (kbit_ragged_dot), bits 2..5, bf16, with and without a GLU: at
    # decode sizes (4 and 12 rows over 8 experts, some without rows, and rows past the groups'
    # sum, which the kernel zeroes) the warp-specialized kernel's grouped mode with its
    # device-built schedule; at 40 rows per expert the wgmma kernel's grouped mode, one expert's
    # tile per CTA; 64 experts with 1 row each the schedule over many groups.
    cases = ((8, (1, 0, 2, 0, 1, 0, 0, 0), 5), (8, (3, 1, 0, 2, 0, 4, 1, 0), 12),
             (8, (40, 40, 0, 40, 40, 40, 40, 40), 280), (64, (1,) * 64, 64))
    for bits in (2, 3, 4, 5):
        for g, sizes, m in cases:
            q = kj.quantize(jax.random.normal(jax.random.key(bits + g), (g, 512, 256)), bits)
            x = jax.random.normal(jax.random.key(m), (m, 512), jnp.bfloat16)
            group_sizes = jnp.array(sizes, jnp.int32)
            jax.block_until_ready(kj.ragged_dot(x, q, group_sizes))
            jax.block_until_ready(kj.ragged_dot(x, q, group_sizes, glu="silu"))


PARTS = {"small": small, "clusters": clusters, "glu": glu, "wide5": wide5, "wgmma": wgmma, "ragged": ragged,
         "wgmma_f16": wgmma_f16, "wgmma64": wgmma64}

if __name__ == "__main__":
    names = sys.argv[1:] or list(PARTS)
    unknown = [n for n in names if n not in PARTS]
    if unknown:
        sys.exit(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    for name in names:
        PARTS[name]()
    print("sanitize case done:", " ".join(names))
