"""Tensor-parallel matmul microbenchmark: kbit column/row-parallel layers vs the dense sharded dot.

For each device count n (a 1-D mesh ``("tp",)`` over the first n devices), each weight shape
and each layout:

- **column**: W sharded on N (``kbit_jax.column_parallel``), x replicated -> y sharded on N;
  no collective;
- **row**: W sharded on K at whole blocks (``kbit_jax.row_parallel``), x sharded on K ->
  local product + one all-reduce of y;

it times ``kbit_jax.matmul`` and the dense ``jnp.dot`` on a weight sharded the same way
(bf16 by default), under ``jit`` with NamedSharding inputs. The compiled HLO of both is
checked for collectives (recorded; a kbit program with an all-gather is reported as an error).

Timing (docs/performance.md): one jitted call applies the layer to R different weight buffers (R so
that the per-GPU weight bytes exceed the 60 MB L2 at least four times: weights come from HBM
as in decoding), in passes until queueing a call no longer sets its pace
(kbit_jax.timing.products_seconds, as in bench_matmul.py; rows record "passes" and
"host_bound"); several calls are queued per sample so host dispatch hides behind device work,
and the median sample is divided by the products per call. Weights are random
codes/scales generated on the devices (values do not matter for speed). The floor is the
per-GPU bytes (weight shard + activations) / the copy bandwidth measured in the same run.

    python benchmarks/bench_sharded.py --out /tmp/sharded                   # all GPUs
    python benchmarks/bench_sharded.py --ndev 1 2 --m 1 16 --bits 4 --out /tmp/r
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python benchmarks/bench_sharded.py --shapes 1024x512 --m 1 8 --repeats 2 --out /tmp/r  # smoke test

Writes ``sharded_matmul.json`` and ``sharded_matmul.md`` under ``--out``.

Expert parallelism (``--moe CONFIG``): the decode step of a mixture-of-experts model's MoE
layers (router, top-k, the grouped gate/up and down products ``kbit_jax.ragged_dot``, combine;
no attention, no shared expert) for a batch of tokens, with the experts of every layer spread
over ``--ep`` devices (``shard_map``: each device multiplies the rows routed to its own
experts, one all-reduce of the combined ``[batch, hidden]`` per layer; weights never move),
against the same step on one device. Random k-bit experts generated on the devices; the
whole model's weights are read every step (no L2 reuse). Writes ``moe_ep.json`` / ``.md``:

    python benchmarks/bench_sharded.py --moe qwen3-next --ep 1 2 4 --m 1 8 --bits 4 --out /tmp/ep
    XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \\
        python benchmarks/bench_sharded.py --moe tiny --ep 1 2 4 --m 1 8 --repeats 2 --out /tmp/ep
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.dirname(__file__))
import kbit_jax as kj  # noqa: E402
from kbit_jax.timing import median_call_seconds, passes_function, products_seconds  # noqa: E402
from kbit_jax import codebooks, sharding as ks  # noqa: E402
from kbit_jax.sharding import collective_counts as collectives  # noqa: E402
from shapes import SHAPES  # noqa: E402

L2_BYTES = 60e6
DEFAULT_SHAPES = ("llama3_70b_gate_up", "llama3_70b_down")
DEFAULT_M = (1, 4, 16, 64, 256)


def copy_bandwidth(device, repeats):
    """Bytes read + written per second by a large copy on one device (x + 1, 1 GiB bf16)."""
    on_cpu = device.platform == "cpu"
    x = jax.device_put(jnp.ones((1 << (24 if on_cpu else 29),), jnp.bfloat16), device)
    t = median_call_seconds(jax.jit(lambda x: x + 1), (x,), repeats)
    return 2 * x.nbytes / t


def rotation_count(bytes_per_device):
    return int(min(32, max(2, math.ceil(4 * L2_BYTES / max(bytes_per_device, 1)))))


def parse_shape(name):
    if name in SHAPES:
        return SHAPES[name]
    try:
        k, n = (int(v) for v in name.lower().split("x"))
    except ValueError:
        raise SystemExit(f"unknown shape {name!r}: use one of {list(SHAPES)} or KxN") from None
    return k, n


def layout_specs(layout):
    """(logical weight spec, x spec) of a layout over the mesh axis "tp"."""
    return {"column": (P(None, "tp"), P()), "row": (P("tp", None), P(None, "tp"))}[layout]


def random_kbit(key, k, n, bits, shardings: kj.KbitWeight) -> kj.KbitWeight:
    """A valid weight with random codes and scales, generated in place on the devices."""
    cb = jnp.asarray(codebooks.get_codebook("nf", bits))

    def make(key):
        k1, k2 = jax.random.split(key)
        planes = jax.random.bits(k1, (k // 32, n, bits), jnp.uint32)
        scales = jax.random.randint(k2, (k // 32, n), 0x60, 0x90, jnp.int32).astype(jnp.uint8)
        return kj.KbitWeight(planes, scales, cb, jnp.float32(2.0 ** -6), layout="fragment")

    return jax.jit(make, out_shardings=shardings)(key)


def random_dense(key, k, n, dtype, sharding):
    return jax.jit(lambda key: (jax.random.normal(key, (k, n), jnp.float32) * 0.02).astype(dtype),
                   out_shardings=sharding)(key)


def bench_config(mesh, name, k, n, layout, ms, bits_list, dtype, method, repeats, bw, key):
    ndev = mesh.size
    w_spec, x_spec = layout_specs(layout)
    x_sharding = NamedSharding(mesh, x_spec)
    rows = []
    dense_sharding = NamedSharding(mesh, w_spec)
    dense_bytes = k * n * dtype.itemsize / ndev
    dense_ws = [random_dense(jax.random.fold_in(key, r), k, n, dtype, dense_sharding)
                for r in range(rotation_count(dense_bytes))]
    def dense_product(x, w):
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    def kbit_product(x, w):
        return kj.matmul(x, w, method=method)

    # one pass of the timed programs, lowered for their collective counts
    dense_f, kbit_f = passes_function(dense_product), passes_function(kbit_product)
    kbit_sets = {}
    for bits in bits_list:
        template = jax.ShapeDtypeStruct((k // 32, n, bits), jnp.uint32)
        shape_only = kj.KbitWeight(template, jax.ShapeDtypeStruct((k // 32, n), jnp.uint8),
                                   jax.ShapeDtypeStruct((1 << bits,), jnp.float32),
                                   jax.ShapeDtypeStruct((), jnp.float32), layout="fragment")
        shardings = ks.weight_shardings(shape_only, mesh, w_spec)
        wbytes = (k * n * bits / 8 + k * n / 32) / ndev
        kbit_sets[bits] = (wbytes, [random_kbit(jax.random.fold_in(key, 1000 + r), k, n, bits, shardings)
                                    for r in range(rotation_count(wbytes))])

    for m in ms:
        x = jax.device_put((jax.random.normal(jax.random.fold_in(key, m), (m, k)) * 0.5).astype(dtype),
                           x_sharding)
        t_dense, _, dense_host_bound = products_seconds(dense_product, x, dense_ws, repeats)
        dense_coll = collectives(dense_f.lower([x], dense_ws[:1]).compile().as_text())
        act_bytes = (m * k / (ndev if layout == "row" else 1) + m * n / (ndev if layout == "column" else 1)) \
            * dtype.itemsize
        for bits in bits_list:
            wbytes, ws = kbit_sets[bits]
            t, passes, host_bound = products_seconds(kbit_product, x, ws, repeats)
            coll = collectives(kbit_f.lower([x], ws[:1]).compile().as_text())
            # Sanity: kbit == dense product of its own dequantized weight (same sharding).
            y = kj.matmul(x, ws[0], method=method)
            ref = jnp.dot(x.astype(jnp.float32), kj.dequantize(ws[0], jnp.float32))
            err = float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)) / (jnp.max(jnp.abs(ref)) + 1e-30))
            row = dict(ndev=ndev, shape=name, k=k, n=n, layout=layout, m=m, bits=bits,
                       dtype=dtype.name, kbit_us=t * 1e6, dense_us=t_dense * 1e6,
                       speedup=t_dense / t, floor_us=(wbytes + act_bytes) / bw * 1e6,
                       bw_fraction=(wbytes + act_bytes) / bw / t,
                       dense_bw_fraction=(dense_bytes + act_bytes) / bw / t_dense,
                       passes=passes, host_bound=host_bound or dense_host_bound,
                       kbit_collectives=coll, dense_collectives=dense_coll, rel_err=err,
                       ok=coll["all-gather"] == 0 and err < 3e-2)
            rows.append(row)
            print(f"n={ndev} {name:20s} {layout:6s} M={m:<4d} K={bits} kbit {t * 1e6:8.1f} us  "
                  f"dense {t_dense * 1e6:8.1f} us  x{t_dense / t:5.2f}  "
                  f"{100 * row['bw_fraction']:5.1f}% BW  coll {_fmt(coll)}  err {err:.1e}"
                  + ("" if row["ok"] else "  <-- CHECK"), flush=True)
    return rows


def _fmt(coll):
    return ",".join(f"{c}x{v}" for c, v in coll.items() if v) or "none"


def markdown(result) -> str:
    lines = [f"# Tensor-parallel kbit matmul vs dense sharded dot: {result['device']} x "
             f"{result['devices_available']}, jax {result['jax']}, {result['date']}",
             "",
             f"Copy bandwidth (one device, same run): {result['copy_bandwidth_tbs']:.2f} TB/s. "
             "Time per layer call under jit with NamedSharding inputs, cold weights (see "
             "bench_sharded.py); floor = per-GPU bytes / copy bandwidth. column: W on N, x "
             "replicated; row: W on K, x on K, one all-reduce. "
             f"method={result['method']}.",
             "",
             "| GPUs | shape (K x N) | layout | dtype | M | bits | kbit us | dense us | speedup | "
             "% BW | floor us | kbit collectives | dense collectives |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for r in result["rows"]:
        lines.append(
            f"| {r['ndev']} | {r['shape']} ({r['k']}x{r['n']}) | {r['layout']} | {r['dtype']} | "
            f"{r['m']} | {r['bits']} | {r['kbit_us']:.1f} | {r['dense_us']:.1f} | "
            f"{r['speedup']:.2f}x | {100 * r['bw_fraction']:.0f}% | {r['floor_us']:.1f} | "
            f"{_fmt(r['kbit_collectives'])} | {_fmt(r['dense_collectives'])} |")
    return "\n".join(lines) + "\n"


# -- expert-parallel MoE decode ---------------------------------------------------------------
#: MoE layer shapes: hidden K, each expert's intermediate H (gate/up [G, K, 2H] interleaved for
#: the GLU, down [G, H, K]), G experts, top_k per token, MoE layers.
MOE_CONFIGS = {
    # Qwen3-Next-80B-A3B, the Qwen3-Coder-Next architecture (its shared expert left out)
    "qwen3-next": dict(hidden=2048, intermediate=512, experts=512, top_k=10, layers=48),
    "qwen3-30b-a3b": dict(hidden=2048, intermediate=768, experts=128, top_k=8, layers=48),
    "tiny": dict(hidden=64, intermediate=32, experts=8, top_k=2, layers=2),
}


def moe_layer(x, router, gate_up, down, *, top_k: int, axis=None):
    """One MoE layer on decode tokens ``x[B, K]``: softmax router, top-k (renormalized), rows
    sorted by expert, ``ragged_dot`` gate/up (SwiGLU in the kernel) and down, combined by the
    router weights. ``axis`` (inside ``shard_map``): ``gate_up``/``down`` are this device's
    experts, the consecutive ``G / E`` from ``axis_index * G / E``; their rows are moved to the
    front (the grouped product gives 0 past its groups' rows), so each device combines only
    its own experts' outputs and one psum of ``[B, K]`` adds the devices' shares."""
    b, k = x.shape
    experts, local = router.shape[1], gate_up.batch_shape[0]
    probs = jax.nn.softmax(jnp.dot(x, router, preferred_element_type=jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    flat = ids.reshape(-1)
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.zeros((experts,), jnp.int32).at[flat].add(1)
    rows = x[order // top_k]                                      # [B * top_k, K], by expert
    shift = 0
    if axis is not None:
        first = jax.lax.axis_index(axis) * local
        shift = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes)])[first]
        sizes = jax.lax.dynamic_slice(sizes, (first,), (local,))
        rows = jnp.roll(rows, -shift, axis=0)
    out = kj.ragged_dot(kj.ragged_dot(rows, gate_up, sizes, glu="silu"), down, sizes)
    out = jnp.roll(out, shift, axis=0) if axis is not None else out
    out = jnp.zeros_like(out).at[order].set(out).reshape(b, top_k, k)
    y = jnp.einsum("bj,bjk->bk", weights, out.astype(jnp.float32))
    if axis is not None:
        y = jax.lax.psum(y, axis)
    return y.astype(x.dtype)


def moe_step_fn(cfg: dict, mesh=None, axis: str = "ep"):
    """A jitted decode step over the MoE layers, ``step(x, routers, layers)`` with ``layers``
    a list of (gate_up, down); residual adds between layers. With ``mesh``: experts over
    ``axis`` through ``shard_map`` (x and routers replicated)."""
    def step(x, routers, layers, axis=None):
        for router, (gate_up, down) in zip(routers, layers):
            x = x + moe_layer(x, router, gate_up, down, top_k=cfg["top_k"], axis=axis)
        return x

    if mesh is None:
        return jax.jit(step)

    def sharded(x, routers, layers):
        specs = [tuple(ks.weight_specs(w, P(axis, None, None)) for w in layer) for layer in layers]
        return jax.shard_map(functools.partial(step, axis=axis), mesh=mesh,
                             in_specs=(P(), [P()] * len(routers), specs), out_specs=P(),
                             check_vma=False)(x, routers, layers)

    return jax.jit(sharded)


def random_experts(key, cfg: dict, bits: int, mesh=None, axis: str = "ep"):
    """(routers, layers): per layer a dense router [K, G] and random k-bit experts, gate/up
    [G, K, 2H] and down [G, H, K], generated on the default device layer by layer and, with
    ``mesh``, placed at once with the experts over ``axis`` (the same values either way)."""
    k, h, g = cfg["hidden"], cfg["intermediate"], cfg["experts"]
    cb = jnp.asarray(codebooks.get_codebook("nf", bits))

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def make(key, kin, n):
        k1, k2 = jax.random.split(key)
        planes = jax.random.bits(k1, (g, kin // 32, n, bits), jnp.uint32)
        scales = jax.random.randint(k2, (g, kin // 32, n), 0x60, 0x90, jnp.int32).astype(jnp.uint8)
        return kj.KbitWeight(planes, scales, jnp.broadcast_to(cb, (g, cb.shape[0])),
                             jnp.full((g,), 2.0 ** -6, jnp.float32), layout="fragment")

    def place(w):
        return w if mesh is None else ks.shard_weight(w, mesh, P(axis, None, None))

    routers, layers = [], []
    for i in range(cfg["layers"]):
        kr, kg, kd = jax.random.split(jax.random.fold_in(key, i), 3)
        router = (jax.random.normal(kr, (k, g), jnp.float32) * k ** -0.5).astype(jnp.bfloat16)
        routers.append(router if mesh is None else jax.device_put(router, NamedSharding(mesh, P())))
        layers.append((place(make(kg, k, 2 * h)), place(make(kd, h, k))))
    return routers, layers


def bench_moe(args):
    cfg = dict(MOE_CONFIGS[args.moe])
    if args.moe_layers:
        cfg["layers"] = args.moe_layers
    devices = jax.devices()
    rows, base = [], {}
    for bits in args.bits:
        for ep in args.ep:
            if ep > len(devices):
                print(f"ep={ep}: skipped (only {len(devices)} devices)", flush=True)
                continue
            if cfg["experts"] % ep:
                print(f"ep={ep}: skipped ({cfg['experts']} experts do not split over {ep})", flush=True)
                continue
            mesh = None if ep == 1 else jax.sharding.Mesh(np.array(devices[:ep]), ("ep",))
            routers, layers = random_experts(jax.random.key(0), cfg, bits, mesh)
            step = moe_step_fn(cfg, mesh)
            weight_bytes = sum(leaf.nbytes for layer in layers for w in layer for leaf in jax.tree.leaves(w))
            for m in args.m:
                x = (jax.random.normal(jax.random.key(m), (m, cfg["hidden"]), jnp.float32) * 0.5
                     ).astype(jnp.dtype(args.dtype))
                if mesh is not None:
                    x = jax.device_put(x, NamedSharding(mesh, P()))
                t = median_call_seconds(step, (x, routers, layers), args.repeats)
                coll = collectives(step.lower(x, routers, layers).compile().as_text())
                if ep == 1:
                    base[(bits, m)] = t
                row = dict(config=args.moe, **cfg, ep=ep, m=m, bits=bits, dtype=args.dtype,
                           step_ms=t * 1e3, tokens_per_s=m / t, weight_gib_per_device=weight_bytes / ep / 2 ** 30,
                           speedup_vs_ep1=base[(bits, m)] / t if (bits, m) in base else None,
                           collectives=coll,
                           ok=coll["all-gather"] == 0 and coll["all-reduce"] == (cfg["layers"] if ep > 1 else 0))
                rows.append(row)
                print(f"{args.moe} ep={ep} M={m:<4d} K={bits} step {t * 1e3:8.3f} ms  {m / t:9.1f} tok/s"
                      + (f"  x{row['speedup_vs_ep1']:.2f} vs ep=1" if row["speedup_vs_ep1"] else "")
                      + f"  coll {_fmt(coll)}" + ("" if row["ok"] else "  <-- CHECK"), flush=True)
            del routers, layers
    return rows


def moe_markdown(result) -> str:
    lines = [f"# Expert-parallel MoE decode step: {result['device']} x {result['devices_available']}, "
             f"jax {result['jax']}, {result['date']}", "",
             "One decode step through the MoE layers only (router, top-k, kbit_jax.ragged_dot gate/up "
             "and down, combine; no attention or shared expert), experts spread over ep devices with "
             "shard_map, one all-reduce of [batch, hidden] per layer; median of queued calls "
             "(bench_sharded.py --moe).", "",
             "| config | layers | experts | top k | ep | batch | bits | ms/step | tok/s | vs ep=1 | GiB/device | collectives |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in result["rows"]:
        speedup = f"{r['speedup_vs_ep1']:.2f}x" if r["speedup_vs_ep1"] else "-"
        lines.append(f"| {r['config']} | {r['layers']} | {r['experts']} | {r['top_k']} | {r['ep']} | {r['m']} | "
                     f"{r['bits']} | {r['step_ms']:.3f} | {r['tokens_per_s']:.1f} | {speedup} | "
                     f"{r['weight_gib_per_device']:.2f} | {_fmt(r['collectives'])} |")
    return "\n".join(lines) + "\n"


def write_result(out, name, result, render) -> None:
    """<out>/<name>.json and the markdown ``render(result)`` beside it (nothing without ``out``)."""
    if not out:
        return
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(render(result))
    print(f"wrote {out}/{name}.json and .md")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES),
                   help=f"names from shapes.py ({', '.join(SHAPES)}) or KxN, e.g. 1024x2048")
    p.add_argument("--layouts", nargs="+", default=["column", "row"], choices=["column", "row"])
    p.add_argument("--ndev", nargs="+", type=int, default=None,
                   help="device counts to run (default: 1 and every power of two up to all devices)")
    p.add_argument("--m", nargs="+", type=int, default=list(DEFAULT_M))
    p.add_argument("--bits", nargs="+", type=int, default=[4, 2])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--method", default="auto", choices=["auto", "fused", "dequantize"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=None, help="directory for sharded_matmul.json (+ .md)")
    p.add_argument("--moe", default=None, choices=sorted(MOE_CONFIGS),
                   help="instead of the matmul rows: the expert-parallel MoE decode step of this "
                        "config (see above; uses --ep, --m, --bits, --dtype, --repeats)")
    p.add_argument("--ep", nargs="+", type=int, default=[1, 2],
                   help="with --moe: expert-parallel device counts (1 = one device, no shard_map)")
    p.add_argument("--moe-layers", type=int, default=None,
                   help="with --moe: MoE layers to run (default: the config's)")
    args = p.parse_args(argv)
    if args.moe:
        devices = jax.devices()
        print(f"{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}, build {kj.build_info()}",
              flush=True)
        rows = bench_moe(args)
        result = dict(device=devices[0].device_kind, devices_available=len(devices), jax=jax.__version__,
                      date=datetime.date.today().isoformat(), build=kj.build_info(), rows=rows,
                      all_ok=all(r["ok"] for r in rows))
        write_result(args.out, "moe_ep", result, moe_markdown)
        return result

    devices = jax.devices()
    ndevs = args.ndev or sorted({1, *[2 ** i for i in range(1, 8) if 2 ** i <= len(devices)], len(devices)})
    if max(ndevs) > len(devices):
        p.error(f"--ndev {max(ndevs)} > {len(devices)} available devices")
    dtype = jnp.dtype(args.dtype)
    bw = copy_bandwidth(devices[0], args.repeats)
    print(f"{len(devices)} x {devices[0].device_kind}, jax {jax.__version__}, copy bandwidth "
          f"{bw / 1e12:.2f} TB/s, build {kj.build_info()}", flush=True)
    rows = []
    for ndev in ndevs:
        mesh = jax.sharding.Mesh(np.array(devices[:ndev]), ("tp",))
        for name in args.shapes:
            k, n = parse_shape(name)
            for layout in args.layouts:
                key = jax.random.key(hash((name, layout)) & 0xFFFF)
                try:
                    rows += bench_config(mesh, name, k, n, layout, args.m, args.bits, dtype,
                                         args.method, args.repeats, bw, key)
                except ValueError as e:           # e.g. K/32 or N not divisible by ndev
                    print(f"n={ndev} {name} {layout}: skipped ({e})", flush=True)
    result = dict(device=devices[0].device_kind, devices_available=len(devices), jax=jax.__version__,
                  date=datetime.date.today().isoformat(), copy_bandwidth_tbs=bw / 1e12,
                  build=kj.build_info(), method=args.method, rows=rows,
                  all_ok=all(r["ok"] for r in rows))
    write_result(args.out, "sharded_matmul", result, markdown)
    if not result["all_ok"]:
        print("WARNING: some rows failed the all-gather / numerics check (see 'ok')", flush=True)
    return result


if __name__ == "__main__":
    main()
