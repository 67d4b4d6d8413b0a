"""Device-time benchmark of kbit_jax.ragged_dot, the grouped expert product of a mixture-of-experts
layer, on the routed experts of three models, against bf16 baselines measured in the same run.

Shapes (K x N per expert, G experts, top-k; gate/up interleaved for a SwiGLU, `glu="silu"`):
Qwen3-Coder-Next-class gate/up 2048 x 1024 and down 512 x 2048 (G = 512, top-10), Qwen3-30B-A3B
2048 x 1536 / 768 x 2048 (G = 128, top-8), GLM-4.7-Flash-class 2048 x 3072 / 1536 x 2048 (G = 64,
top-4). T tokens per step route to top-k experts each, uniformly at random ("uniform") or with a
Zipf-like expert popularity, p(expert of rank r) ~ (r + 1)^-1.2 ("skewed"); x has M = T * top-k
rows sorted by expert.

Each row reports, for bf16 activations:
  kbit_us         the kbit ragged_dot, over R different routings (and, where the stacked experts
                  are smaller than 4x the L2, copies of them), so the weights come from HBM
  read_mb         the bytes that product reads: the active experts' codes and scale bytes, x, y
  pct_copy        read_mb at kbit_us as a % of the copy bandwidth measured in the same run
  bf16_floor_us   the active experts' bf16 bytes at the copy bandwidth (an ideal dense grouped
                  kernel on bf16 experts)
  dense_us        a dense bf16 jnp.dot [M, K] x [K, N] (the same FLOPs), over rotated weights
  lax_us          jax.lax.ragged_dot on the bf16 experts (where its dense expansion fits: it
                  reads every expert), or null
Times are device busy time per product (`--time busy`, the default on a GPU: the union of the
kernels' intervals in a profile, as bench_matmul.py measures it), or call time (`--time call`,
kbit_jax.timing.products_seconds). Results: JSON and a markdown table at --out (a path prefix),
rewritten after every row; `--merge` joins runs made in parts (e.g. shapes on several GPUs of
one host) into one table and draws the plot (floor / kbit and % of copy by T, bits 4; it needs
matplotlib).

    python benchmarks/bench_moe.py --out benchmarks/results/moe_h200
    python benchmarks/bench_moe.py --shapes qwen3_30b_gate_up --tokens 16 64 --bits 4 --out /tmp/m
    python benchmarks/bench_moe.py --merge benchmarks/results/moe_h200 /tmp/a.json /tmp/b.json
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import kbit_jax as kj  # noqa: E402
from kbit_jax import reference  # noqa: E402
from kbit_jax.timing import products_seconds  # noqa: E402

L2_BYTES = 60e6
MAX_ROTATION = 16
# name: (K, N, G, top-k, glu)
SHAPES = {
    "qwen3_next_gate_up": (2048, 1024, 512, 10, "silu"),
    "qwen3_next_down": (512, 2048, 512, 10, None),
    "qwen3_30b_gate_up": (2048, 1536, 128, 8, "silu"),
    "qwen3_30b_down": (768, 2048, 128, 8, None),
    "glm47_flash_gate_up": (2048, 3072, 64, 4, "silu"),
    "glm47_flash_down": (1536, 2048, 64, 4, None),
}
TOKENS = (1, 4, 16, 64, 256, 4096)
ROUTINGS = ("uniform", "skewed")
LAX_MAX_BYTES = 4e9  # jax.lax.ragged_dot's dense expansion: M x G*K bf16 operand


def route(rng, tokens, g, top_k, routing):
    """group_sizes int32[G] of `tokens` tokens, each sent to top_k distinct experts."""
    if routing == "uniform":
        p = None
    else:
        p = (np.arange(g) + 1.0) ** -1.2
        p = p[rng.permutation(g)] / p.sum()
    ids = np.concatenate([rng.choice(g, top_k, replace=False, p=p) for _ in range(tokens)])
    return np.bincount(ids, minlength=g).astype(np.int32)


def kbit_bytes(sizes, k, n, bits):
    return int((sizes > 0).sum()) * (k // 32) * n * (4 * bits + 1)


def rotation(active_bytes):
    return int(min(MAX_ROTATION, max(2, np.ceil(4 * L2_BYTES / max(active_bytes, 1)))))


def measure(product, x, weights, args):
    """Seconds per product(x, w) over `weights` (busy or call time, --time)."""
    if args.time == "busy":
        from bench_matmul import busy_seconds
        return busy_seconds(product, x, weights)
    return products_seconds(product, x, weights, args.repeats, max_passes=args.max_passes)[0]


def markdown(result):
    lines = [f"# kbit_jax.ragged_dot on {result['device']}", "",
             f"{result['date']}, commit {result.get('commit') or 'unknown'}, jax {result['jax']}; "
             f"{result['time']} time per product (cold weights); copy bandwidth "
             f"{result['copy_bandwidth_tbs']:.2f} TB/s measured in the same run. bf16 activations. "
             "`floor`: the active experts' bf16 bytes at copy bandwidth (an ideal grouped kernel on "
             "bf16 experts); `dense bf16`: `jnp.dot` of [M, K] x [K, N] (the same FLOPs); "
             "`lax.ragged_dot`: jax.lax.ragged_dot on the bf16 experts (on a GPU it expands to a "
             "dense product over every expert; timed up to T = 64).", "",
             "\n".join("    " + c for c in result.get("commands") or [result.get("command", "")]), "",
             "| shape | routing | T | M | active | bits | kbit us | MB read | % copy | bf16 floor us | "
             "floor / kbit | dense bf16 us | dense / kbit | lax.ragged_dot us |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lax = f"{r['lax_us']:.1f}" if r.get("lax_us") else "-"
        dense = f"{r['dense_us']:.1f}" if r.get("dense_us") else "-"
        ratio = f"{r['dense_us'] / r['kbit_us']:.2f}" if r.get("dense_us") else "-"
        lines.append(f"| {r['shape']} | {r['routing']} | {r['tokens']} | {r['m']} | {r['active']:.1f} | "
                     f"{r['bits']} | {r['kbit_us']:.1f} | {r['read_mb']:.2f} | {r['pct_copy']:.1f} | "
                     f"{r['bf16_floor_us']:.1f} | {r['bf16_floor_us'] / r['kbit_us']:.2f} | {dense} | {ratio} | "
                     f"{lax} |")
    return "\n".join(lines) + "\n"


def plot(result, path, bits=4):
    """Two panels by T (log scale), one line per shape and routing at `bits`: the bf16 floor over
    the kbit time, and the kbit product's % of copy bandwidth."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    series = collections.defaultdict(list)
    for r in result["rows"]:
        if r["bits"] == bits:
            series[(r["shape"], r["routing"])].append((r["tokens"], r["bf16_floor_us"] / r["kbit_us"], r["pct_copy"]))
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    shapes = sorted({shape for shape, _ in series})
    colors = {shape: plt.cm.tab10(i % 10) for i, shape in enumerate(shapes)}  # a color per shape
    for (shape, routing), pts in sorted(series.items()):
        pts.sort()
        style = "-" if routing == "uniform" else "--"
        for ax, i in zip(axes, (1, 2)):
            ax.plot([p[0] for p in pts], [p[i] for p in pts], style, marker="o", color=colors[shape],
                    label=f"{shape} ({routing})")
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[0].set_ylabel("bf16 floor / kbit time (> 1: faster than any bf16 grouped kernel)")
    axes[1].set_ylabel("% of copy bandwidth")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per step T")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"kbit_jax.ragged_dot, bits {bits}, on {result['device']} (commit {result.get('commit') or '?'})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def merge(out, parts):
    """Join the rows of runs made in parts on one device into `out` (.json, .md, .png)."""
    runs = []
    for path in parts:
        with open(path) as f:
            runs.append(json.load(f))
    result = dict(runs[0])
    result["rows"] = [r for run in runs for r in run["rows"]]
    result["copy_bandwidth_tbs"] = min(run["copy_bandwidth_tbs"] for run in runs)
    result["commands"] = [run.get("command", "") for run in runs]
    write(result, out)
    try:
        plot(result, out + ".png")
    except ImportError:
        print("matplotlib is not installed: no plot", file=sys.stderr)
    return result


def _commit():
    """The source's commit: $KBIT_JAX_COMMIT (a copied tree whose .git is not its own), else git's."""
    if os.environ.get("KBIT_JAX_COMMIT"):
        return os.environ["KBIT_JAX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def write(result, out):
    if not out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(markdown(result))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--kn", nargs=4, type=int, metavar=("K", "N", "G", "TOPK"),
                   help="one custom shape instead of --shapes (no GLU)")
    p.add_argument("--tokens", nargs="+", type=int, default=list(TOKENS))
    p.add_argument("--bits", nargs="+", type=int, default=[2, 3, 4, 5])
    p.add_argument("--routing", nargs="+", default=list(ROUTINGS), choices=list(ROUTINGS))
    p.add_argument("--baselines", nargs="*", default=["dense", "lax"], choices=["dense", "lax"],
                   help="the bf16 baselines to time (the floor is always computed)")
    p.add_argument("--lax-max-tokens", type=int, default=64,
                   help="time jax.lax.ragged_dot up to this T (it reads every expert at every T)")
    p.add_argument("--time", default=None, choices=["busy", "call"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-passes", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="path prefix of the .json and .md results")
    p.add_argument("--merge", nargs="+", metavar=("OUT", "PART"),
                   help="join the .json results PART... into OUT (.json, .md, .png) and exit")
    args = p.parse_args(argv)
    if args.merge:
        if len(args.merge) < 2:
            p.error("--merge needs OUT and at least one PART")
        return merge(args.merge[0], args.merge[1:])
    on_gpu = jax.default_backend() == "gpu"
    args.time = args.time or ("busy" if on_gpu else "call")
    shapes = {"custom": (*args.kn, None)} if args.kn else {s: SHAPES[s] for s in args.shapes}
    rng = np.random.default_rng(args.seed)

    from bench_matmul import copy_bandwidth, memcpy_bandwidth
    xla_bw = copy_bandwidth(args.repeats)
    memcpy_bw = memcpy_bandwidth() if on_gpu else None
    bw = max(xla_bw, memcpy_bw or 0.0)
    command = "python benchmarks/bench_moe.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = dict(device=jax.devices()[0].device_kind, time=args.time, jax=jax.__version__,
                  date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  commit=_commit(), command=command.strip(),
                  copy_bandwidth_tbs=bw / 1e12, xla_copy_bandwidth_tbs=xla_bw / 1e12,
                  memcpy_bandwidth_tbs=(memcpy_bw or 0.0) / 1e12, rows=[])
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s ({args.time} time)", flush=True)

    for name, (k, n, g, top_k, glu) in shapes.items():
        key = jax.random.PRNGKey(args.seed)
        w16 = (jax.random.normal(key, (g, k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        n_out = n // 2 if glu else n
        for bits in args.bits:
            w_q = kj.quantize(w16, bits)
            stacked = g * (k // 32) * n * (4 * bits + 1)
            copies = [w_q] + [jax.tree.map(lambda a: a + 0 if a.dtype != jnp.uint8 else a | 0, w_q)
                              for _ in range(int(np.ceil(4 * L2_BYTES / stacked)) - 1)]
            for tokens in args.tokens:
                m = tokens * top_k
                x = jax.random.normal(jax.random.PRNGKey(tokens), (m, k), jnp.bfloat16)
                for routing in args.routing:
                    draws = [route(rng, tokens, g, top_k, routing) for _ in range(MAX_ROTATION)]
                    active_bytes = np.mean([kbit_bytes(s, k, n, bits) for s in draws])
                    draws = draws[:rotation(active_bytes)]
                    weights = [(copies[i % len(copies)], jnp.asarray(s)) for i, s in enumerate(draws)]
                    active = float(np.mean([(s > 0).sum() for s in draws]))
                    read = float(np.mean([kbit_bytes(s, k, n, bits) for s in draws])) + m * (k + n_out) * 2

                    def kbit_product(x, w):
                        return kj.ragged_dot(x, w[0], w[1], glu=glu)
                    kbit_s = measure(kbit_product, x, weights, args)
                    row = dict(shape=name, k=k, n=n, groups=g, top_k=top_k, glu=glu, routing=routing,
                               tokens=tokens, m=m, bits=bits, active=active, rotation=len(weights),
                               kbit_us=kbit_s * 1e6, read_mb=read / 1e6, pct_copy=100 * read / kbit_s / bw,
                               bf16_floor_us=active * k * n * 2 / bw * 1e6, dense_us=None, lax_us=None)
                    first = bits == args.bits[0] and routing == args.routing[0]
                    if "dense" in args.baselines and first:
                        dense_w = [jax.random.normal(jax.random.PRNGKey(i), (k, n), jnp.bfloat16)
                                   for i in range(rotation(k * n * 2))]
                        row["dense_us"] = measure(lambda x, w: jnp.dot(x, w), x, dense_w, args) * 1e6
                    elif "dense" in args.baselines:  # the same FLOPs at every bits and routing
                        same = [r for r in result["rows"] if r["shape"] == name and r["tokens"] == tokens
                                and r["dense_us"]]
                        row["dense_us"] = same[0]["dense_us"] if same else None
                    if ("lax" in args.baselines and m * g * k * 2 <= LAX_MAX_BYTES and bits == args.bits[0]
                            and tokens <= args.lax_max_tokens):
                        def lax_product(x, w):
                            y = jax.lax.ragged_dot(x, w[0], w[1], preferred_element_type=jnp.float32)
                            y = reference.apply_glu(y, glu) if glu else y
                            return y.astype(x.dtype)
                        try:
                            row["lax_us"] = measure(lax_product, x, [(w16, s) for _, s in weights[:2]], args) * 1e6
                        except Exception as e:  # noqa: BLE001  (out of memory: recorded, not fatal)
                            row["lax_error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    result["rows"].append(row)
                    print(f"{name:20s} {routing:8s} T={tokens:5d} bits={bits} active={active:6.1f} "
                          f"kbit {row['kbit_us']:9.1f} us ({row['pct_copy']:5.1f} % copy) floor "
                          f"{row['bf16_floor_us']:8.1f} dense {row['dense_us'] or 0:8.1f} lax {row['lax_us'] or 0:8.1f}",
                          flush=True)
                    write(result, args.out)
            del copies, w_q
    return result


if __name__ == "__main__":
    main()
