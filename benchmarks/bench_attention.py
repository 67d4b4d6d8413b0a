"""Single-token attention per layer: the example decoder's XLA path vs the Pallas kernel.

Times ``kbit_jax.examples.decode_attention.decode_attention`` against ``llama.attend`` (the
jnp einsum/softmax path XLA compiles into five kernels) at decode shapes: one query per row,
the cache full (kv_len = S). ``--layers`` distinct caches are chained in one jitted call
(each layer's output feeds the next query), as in a decode step, and the time is per layer:
on a GPU the device's busy time from a profile (``--time busy``, the default there: the union of
the kernels' intervals, the splits' combine included), else the call time.

    python benchmarks/bench_attention.py --out /tmp/attn          # on a GPU
    python benchmarks/bench_attention.py --lens 64 --batches 1 --layers 2 --repeats 1  # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def layer_seconds(kind, batch, kv_heads, group, head_dim, seq_len, layers, repeats, timing="call"):
    """Seconds per layer of ``kind``: "xla", or "pallas" / "pallas:BLOCKxWARPS" (the kernel with
    block_s=BLOCK and num_warps=WARPS); ``timing`` "busy" (a GPU's kernel time) or "call"."""
    import jax
    import jax.numpy as jnp

    from kbit_jax.examples import llama
    from kbit_jax.examples.decode_attention import decode_attention
    from kbit_jax.timing import median_call_seconds

    shape = (batch, seq_len, kv_heads, head_dim)
    keys = jax.random.split(jax.random.key(0), 2 * layers + 1)
    caches = [(jax.random.normal(keys[2 * i], shape, jnp.bfloat16),
               jax.random.normal(keys[2 * i + 1], shape, jnp.bfloat16)) for i in range(layers)]
    q = jax.random.normal(keys[-1], (batch, kv_heads, group, head_dim), jnp.bfloat16)
    kv_len = jnp.int32(seq_len)
    options = {}
    if kind.startswith("pallas:"):
        block, warps = map(int, kind.split(":")[1].split("x"))
        options = {"block_s": block, "num_warps": warps}

    def one(q, k, v):
        if kind.startswith("pallas"):
            return decode_attention(q, k, v, kv_len, **options)
        return llama.attend(q[:, None], k, v, (kv_len - 1)[None])[:, 0].astype(q.dtype)

    @jax.jit
    def chain(q, caches):
        for k, v in caches:
            q = one(q, k, v)
        return q

    if timing == "busy":
        from profile_summary import busy_us, trace_kernels   # benchmarks/, next to this script
        kernels = trace_kernels(lambda: chain(q, caches), repeats)
        return busy_us(kernels) * 1e-6 / (repeats * layers)
    return median_call_seconds(chain, (q, caches), repeats) / layers


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lens", default="192,1024,4096,16384", help="cache lengths S")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--heads", default="4x8,8x8",
                   help="kv heads x query heads per kv head (4x8: Llama-3-70B at TP 2)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--variants", default="",
                   help="extra kernel settings to time, comma list of BLOCKxWARPS (e.g. 64x4,256x8)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="directory for attention.json and attention.md")
    p.add_argument("--time", default=None, choices=["busy", "call"],
                   help="the device's busy time from a profile (default on a GPU) or the call time")
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import jax

    on_gpu = jax.default_backend() == "gpu"
    timing = args.time or ("busy" if on_gpu else "call")
    if timing == "busy" and not on_gpu:
        p.error("--time busy needs a GPU: the CPU backend's profile has no kernel intervals")

    variants = [v for v in args.variants.split(",") if v]
    kinds = ["xla", "pallas"] + [f"pallas:{v}" for v in variants]
    rows = []
    for heads in args.heads.split(","):
        kv_heads, group = map(int, heads.split("x"))
        for batch in map(int, args.batches.split(",")):
            for seq_len in map(int, args.lens.split(",")):
                row = {"kv_heads": kv_heads, "group": group, "batch": batch, "seq_len": seq_len}
                for kind in kinds:
                    row[f"{kind}_us"] = 1e6 * layer_seconds(kind, batch, kv_heads, group, args.head_dim,
                                                            seq_len, args.layers, args.repeats, timing)
                rows.append(row)
                print(json.dumps(row), flush=True)
    lines = [f"# Single-token attention per layer ({jax.devices()[0].device_kind}, jax {jax.__version__})",
             "", f"head_dim {args.head_dim}, bf16 cache full to S, {args.layers} chained layers per call; "
             f"{'device busy time' if timing == 'busy' else 'call time'} per layer.",
             "", "Pallas: the kernel's default settings; BLOCKxWARPS columns: other block_s and num_warps.",
             "", "| kv heads x group | batch | S | XLA us | Pallas us | XLA / Pallas | "
             + " | ".join(f"{v} us" for v in variants) + " |",
             "|---|---:|---:|---:|---:|---:|" + "---:|" * len(variants)]
    lines += [f"| {r['kv_heads']}x{r['group']} | {r['batch']} | {r['seq_len']} | {r['xla_us']:.1f} | "
              f"{r['pallas_us']:.1f} | {r['xla_us'] / r['pallas_us']:.2f}x | "
              + " | ".join(f"{r[f'pallas:{v}_us']:.1f}" for v in variants) + " |"
              for r in rows]
    md = "\n".join(lines) + "\n"
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "attention.json"), "w") as f:
            json.dump({"args": vars(args), "device": jax.devices()[0].device_kind,
                       "jax": jax.__version__, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "attention.md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
