"""End-to-end greedy decoding: tokens/s of a Llama-style model, bf16 weights vs kbit K=2..5.

Each (config, weights) pair runs in its own subprocess so that peak GPU memory is per model
and an out-of-memory failure costs one row, not the run. Inside a worker the model is built
once (randomly initialized; kbit models are quantized block by block as they are built, see
``kbit_jax.models.decoder.build_model``), then for each batch size: prefill the prompt
(jitted), then greedy-decode ``new_tokens - 1`` steps in one jitted ``fori_loop``, so the
timed region has one dispatch and wall time equals device time to within a dispatch.
Median of ``--reps`` repetitions after a warm-up (compile) run.

Full run on one H200 (defaults):
    python benchmarks/bench_decode.py --out /tmp/decode
The committed Llama-3-8B table (benchmarks/results/decode_llama3_8b_h200.md):
    python benchmarks/bench_decode.py --configs llama3-8b --weights bf16,4,2,3,5 \\
        --new-tokens 128 --reps 2 --out benchmarks/results --name decode_llama3_8b_h200
A run of a few minutes:
    python benchmarks/bench_decode.py --configs llama3-8b --batches 1 --weights bf16,4 \\
        --new-tokens 64 --reps 2 --out /tmp/decode
CPU smoke test (slow; the tiny config):
    python benchmarks/bench_decode.py --configs tiny --batches 1,2 --weights bf16,4 \\
        --prompt 16 --new-tokens 8 --reps 1 --out /tmp/decode

Tensor parallelism (``--tp``, a comma list of sizes: each runs over the first N devices, with
``kbit_jax.models.decoder``'s Megatron layout: fused q/k/v and gate/up column-parallel, o/down
row-parallel, lm_head over the vocabulary, KV cache over kv heads; two all-reduces per layer).
Llama-3-70B on a 2-GPU and a 4-GPU H200 machine:
    python benchmarks/bench_decode.py --configs llama3-70b --weights bf16,4,2 --tp 2 \\
        --out /tmp/decode_tp2
    python benchmarks/bench_decode.py --configs llama3-70b --weights bf16,4,2 --tp 2,4 \\
        --out /tmp/decode_tp4
CPU smoke test of the tensor-parallel path ("tiny-tp" splits over up to 4 devices, "tiny" 2):
    XLA_FLAGS=--xla_force_host_platform_device_count=4 python benchmarks/bench_decode.py \\
        --configs tiny-tp --tp 1,2,4 --batches 1,2 --weights bf16,4 --prompt 16 --new-tokens 8 \\
        --reps 1 --out /tmp/decode_tp
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import itertools
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2.0 ** 30
RESULT = "RESULT "  # prefix of the worker's stdout line carrying its rows as JSON

#: Weights benchmarked per config by default ("bf16" or a bit width). The 70B config in bf16
#: does not fit one H200 (141 GB of weights); it is attempted and reported as not fitting.
DEFAULT_WEIGHTS = {"llama3-8b": "bf16,2,3,4,5", "llama3-70b": "bf16,2,3,4", "tiny": "bf16,2,3,4,5",
                   "tiny-tp": "bf16,2,3,4,5"}
#: The decoder's kernel choices (`decoder.build_model` keywords) and their values; each
#: flag takes a comma list, and every combination is a row. Spelled out here: the driver parses
#: its arguments before importing jax and flax (the decoder module would pull them in).
MODES = {"attention": ("auto", "xla", "pallas"), "norm": ("auto", "xla", "pallas"),
         "mlp_gate": ("auto", "xla")}


# -- worker: one model, all batch sizes -------------------------------------------------------
def _device_memory(devices=None):
    """(the smallest bytes_limit, the largest peak_bytes_in_use) over ``devices`` (default:
    the first device); None where the platform does not report them (CPU)."""
    import jax
    stats = [d.memory_stats() or {} for d in (devices or jax.devices()[:1])]
    limits = [s["bytes_limit"] for s in stats if "bytes_limit" in s]
    peaks = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
    return (min(limits) if limits else None), (max(peaks) if peaks else None)


def _device_bytes(tree, device) -> int:
    """Bytes of ``tree``'s arrays that live on ``device``."""
    import jax
    return sum(shard.data.nbytes for x in jax.tree.leaves(tree) for shard in x.addressable_shards
               if shard.device == device)


def hlo_collectives(text: str) -> dict:
    """Collective counts of compiled HLO, and the shapes of any all-gathers (to show they
    gather activations, not weights)."""
    from kbit_jax.sharding import all_gather_shapes, collective_counts
    return {**collective_counts(text), "all_gather_shapes": all_gather_shapes(text)}


def run_worker(args) -> list[dict]:
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import kbit_jax
    from kbit_jax.models import decoder

    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    cfg = decoder.CONFIGS[args.config]
    bits = None if args.weights == "bf16" else int(args.weights)
    tp = args.tp
    base = {"config": args.config, "weights": args.weights, "bits": bits, "tp": tp,
            **{m: getattr(args, m) for m in MODES}, "quantize_head": args.quantize_head,
            "prompt": args.prompt, "new_tokens": args.new_tokens}
    max_len = args.prompt + args.new_tokens
    if tp > len(jax.devices()):
        return [{**base, "status": f"needs {tp} devices, found {len(jax.devices())}"}]
    try:
        decoder.check_tp(cfg, tp)
    except ValueError as e:
        return [{**base, "status": f"cannot split: {e}"}]
    devices = jax.devices()[:tp]

    # Would the model fit? Per device: its share of the linear layers and lm_head, the whole
    # embedding (replicated), the largest KV cache's share; activations are small at decode.
    n = cfg.num_params()
    linear = cfg.n_layers * (cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
                             + 3 * cfg.dim * cfg.hidden_dim)
    head = cfg.dim * cfg.vocab_size
    linear_bytes = 2 * linear if bits is None else linear * (bits + 0.25) / 8
    weight_bytes = linear_bytes / tp + 2 * head / tp + 2 * (n - linear - head)
    cache_bytes = 4 * cfg.n_layers * max(args.batches) * max_len * cfg.n_kv_heads * cfg.head_dim / tp
    limit, _ = _device_memory(devices)
    if limit is not None and weight_bytes + cache_bytes > limit:
        return [{**base, "status": f"does not fit: needs ~{(weight_bytes + cache_bytes) / GIB:.1f} GiB "
                                   f"per device, device has {limit / GIB:.1f} GiB"}]

    mesh = None
    if tp > 1:
        axis_type = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[args.axis_type]
        mesh = jax.make_mesh((tp,), ("tp",), axis_types=(axis_type,), devices=devices)
        base["axis_type"] = args.axis_type
    t0 = time.perf_counter()
    model, report = decoder.build_model(cfg, bits=bits, codebook=args.codebook, seed=0,
                                      param_dtype=jnp.bfloat16, quantize_head=args.quantize_head,
                                      progress=args.progress, mesh=mesh,
                                      **{m: getattr(args, m) for m in MODES})
    jax.block_until_ready(nnx.state(model))
    build_s = time.perf_counter() - t0
    graphdef, state = nnx.split(model)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    device_model_bytes = _device_bytes(state, devices[0])
    del model

    if mesh is None:
        cache_sharding = prompt_sharding = None
        context = contextlib.nullcontext
    else:
        cache_sharding = decoder.cache_sharding(mesh)
        prompt_sharding = NamedSharding(mesh, P())
        context = functools.partial(jax.set_mesh, mesh)

    def in_mesh(fn):     # run fn under jax.set_mesh(mesh) when tensor-parallel
        @functools.wraps(fn)
        def wrapped(*args, **kwargs):
            with context():
                return fn(*args, **kwargs)
        return wrapped

    rows = []
    rng = np.random.default_rng(0)
    for batch in args.batches:
        prompt = jax.device_put(rng.integers(0, cfg.vocab_size, (batch, args.prompt)).astype(np.int32),
                                prompt_sharding)
        steps = args.new_tokens - 1

        @in_mesh
        def once(trace_dir=None):
            cache = decoder.init_cache(cfg, batch, max_len, jnp.bfloat16, sharding=cache_sharding)
            jax.block_until_ready(cache)
            t0 = time.perf_counter()
            logits, cache = decoder.prefill(graphdef, state, prompt, cache)
            first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
            first.block_until_ready()
            t1 = time.perf_counter()
            # Only the decode loop is traced (the perfetto JSON is what profile_summary reads).
            with (jax.profiler.trace(trace_dir, create_perfetto_trace=True) if trace_dir
                  else contextlib.nullcontext()):
                out, cache = decoder.decode(graphdef, state, first, cache, args.prompt, steps)
                out.block_until_ready()
            t2 = time.perf_counter()
            return t1 - t0, t2 - t1, np.asarray(out)

        t0 = time.perf_counter()
        once()  # compile + warm-up
        compile_s = time.perf_counter() - t0
        times = [once() for _ in range(args.reps)]
        prefill_s = statistics.median(t[0] for t in times)
        decode_s = statistics.median(t[1] for t in times)
        profile = None
        if args.profile:
            path = os.path.join(args.profile, f"{args.config}-{args.weights}-tp{tp}-b{batch}")
            once(trace_dir=path)
            profile = _profile_summary(path, steps)
        collectives = None
        if mesh is not None and batch == args.batches[0]:
            collectives = in_mesh(lambda: hlo_collectives(decoder.decode.lower(
                graphdef, state, jax.device_put(np.zeros(batch, np.int32), prompt_sharding),
                decoder.init_cache(cfg, batch, max_len, jnp.bfloat16, sharding=cache_sharding),
                args.prompt, steps).compile().as_text()))()
        _, peak = _device_memory(devices)
        rows.append({
            **base, "status": "ok", "batch": batch,
            "decode_tokens_per_s": batch * steps / decode_s,
            "decode_ms_per_step": 1e3 * decode_s / steps,
            "prefill_ms": 1e3 * prefill_s,
            "model_gib": model_bytes / GIB,
            "device_model_gib": device_model_bytes / GIB,
            "peak_gib": None if peak is None else peak / GIB,
            "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
            "build_s": build_s, "compile_s": compile_s,
            "repeatable": all(np.array_equal(t[2], times[0][2]) for t in times),
            # The first row's first greedy tokens: rows of the same weights should agree
            # whichever kernels ran (up to bf16 near-ties).
            "tokens": times[0][2][0, :16].tolist(),
            "report": None if report is None else str(report),
            # With --profile: GPU time per decode step by kernel category, and idle gaps.
            "profile": profile,
            # Collective instructions in the compiled decode loop (first batch size, tp > 1):
            # expected 2 all-reduces per layer + 2 tiny all-gathers (argmax over the sharded
            # vocabulary: [batch, tp] values and indices), no all-gather of weights.
            "decode_collectives": collectives,
        })
        print(f"  {args.config} {args.weights:>4} tp {tp} batch {batch:>3}: "
              f"{rows[-1]['decode_tokens_per_s']:10.1f} tok/s", file=sys.stderr, flush=True)
        if profile:
            print(profile, file=sys.stderr, flush=True)
    return rows


def _profile_summary(path, steps):
    """profile_summary's per-step text for the trace under `path`, or why there is none."""
    import profile_summary  # benchmarks/, next to this script
    try:
        trace = profile_summary.load_trace(path)
        # The Llama layer's kbit products in order: q/k/v, o, gate/up, down (lm_head too when
        # quantized, which breaks the period; the summary then says so).
        kernels = profile_summary.kernel_events(trace)
        return "\n".join([profile_summary.summarize(kernels, steps, period=4),
                          profile_summary.layer_sequence(kernels, period=4),
                          profile_summary.host_summary(trace, steps)])
    except (SystemExit, OSError, ValueError) as e:   # e.g. a CPU run: no GPU process in the trace
        return f"no summary: {e}"


# -- driver ------------------------------------------------------------------------------------
def environment() -> dict:
    sys.path.insert(0, ROOT)
    code = ("import json, jax, flax, kbit_jax; d = jax.devices()[0]; "
            "print(json.dumps({'device': d.device_kind, 'platform': d.platform, "
            "'jax': jax.__version__, 'flax': flax.__version__, 'kbit_jax': kbit_jax.__version__, "
            "'build_info': {k: str(v) for k, v in kbit_jax.build_info().items()}}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    info = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-2000:]}
    info.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), host=platform.node(),
                xla_flags=os.environ.get("XLA_FLAGS", ""))  # e.g. the all-reduce (docs/sharding.md)
    return info


def run_subprocess(args, config: str, weights: str, tp: int, modes: dict) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--config", config,
           "--weights", weights, "--batches", ",".join(map(str, args.batches)),
           "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
           "--reps", str(args.reps), "--codebook", args.codebook, "--tp", str(tp),
           "--axis-type", args.axis_type]
    for m, value in modes.items():
        cmd += [f"--{m.replace('_', '-')}", value]
    if args.profile:
        cmd += ["--profile", args.profile]
    if args.progress:
        cmd += ["--progress"]
    if args.quantize_head:
        cmd += ["--quantize-head"]
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    sys.stderr.write(proc.stderr)      # the worker's progress and any crash report
    lines = [l[len(RESULT):] for l in proc.stdout.splitlines() if l.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        # Keep the end of the worker's stderr in the results: a crash (an XLA check failure
        # aborts the process) must be diagnosable from the JSON alone.
        return [{"config": config, "weights": weights, "tp": tp, **modes,
                 "status": f"failed (exit {proc.returncode}); stderr_tail in the JSON",
                 "stderr_tail": proc.stderr[-4000:]}]
    return json.loads(lines[-1])


def to_markdown(env: dict, args, rows: list[dict]) -> str:
    def modes(r):   # (rows of older runs lack the newer modes: they ran XLA's path there)
        return tuple(r.get(m, "xla") for m in MODES)

    def key(r):
        return r["config"], r["batch"], r.get("tp", 1), *modes(r)

    dense = {key(r): r["decode_tokens_per_s"] for r in rows
             if r["status"] == "ok" and r["weights"] == "bf16"}
    lines = [
        f"# Greedy decode throughput ({env.get('device', '?')}, {env.get('date', '')})",
        "",
        f"Prompt {args.prompt} tokens, {args.new_tokens} new tokens (decode tok/s counts the "
        f"{args.new_tokens - 1} steps after prefill, summed over the batch); codebook "
        f"{args.codebook!r}; lm_head {'quantized' if args.quantize_head else 'bf16'}; median of {args.reps}. "
        f"Peak GiB is the worker process's device peak, model building included (with tp > 1: "
        f"the largest over its devices). tp = tensor-parallel devices ({args.axis_type} mesh "
        f"axis); attention: the single-token attention (`decoder.ATTENTION_MODES`; auto = the "
        f"Pallas kernel on a GPU); norm: the residual add + RMSNorm (auto = its Pallas kernel on "
        f"a GPU); mlp gate: where silu(gate) * up runs (auto = inside the kbit gate/up kernel); "
        f"vs bf16 compares with bf16 at the same tp and modes; "
        f"model GiB is the whole model, "
        f"GiB/dev the first device's share. "
        f"jax {env.get('jax')}, flax {env.get('flax')}, kbit_jax build {env.get('build_info')}; "
        f"XLA_FLAGS {env.get('xla_flags') or '(none)'}.",
        "",
        "| config | tp | attention | norm | mlp gate | batch | weights | decode tok/s | vs bf16 | ms/step | prefill ms | model GiB | GiB/dev | peak GiB |",
        "|---|---:|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tp, mode_cells = r.get("tp", 1), " | ".join(modes(r))
        if r["status"] != "ok":
            lines.append(f"| {r['config']} | {tp} | {mode_cells} | | {r['weights']} | {r['status']} | | | | | | |")
            continue
        base = dense.get(key(r))
        speedup = f"{r['decode_tokens_per_s'] / base:.2f}x" if base else "-"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        weights = "bf16" if r["bits"] is None else f"K={r['bits']}"
        per_device = r.get("device_model_gib", r["model_gib"])
        lines.append(f"| {r['config']} | {tp} | {mode_cells} | {r['batch']} | {weights} | {r['decode_tokens_per_s']:.1f} | "
                     f"{speedup} | {r['decode_ms_per_step']:.2f} | {r['prefill_ms']:.1f} | "
                     f"{r['model_gib']:.2f} | {per_device:.2f} | {peak} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="llama3-8b,llama3-70b",
                   help="comma list of: tiny, tiny-tp, llama3-8b, llama3-70b")
    p.add_argument("--weights", default=None,
                   help="comma list of bf16 and/or bit widths 2..5 (default per config: "
                        + "; ".join(f"{k}: {v}" for k, v in DEFAULT_WEIGHTS.items()) + ")")
    p.add_argument("--batches", default="1,8,32", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--prompt", default=128, type=int)
    p.add_argument("--new-tokens", default=256, type=int)
    p.add_argument("--reps", default=3, type=int)
    p.add_argument("--tp", default=[1], type=lambda s: [int(x) for x in str(s).split(",")],
                   help="comma list of tensor-parallel sizes; each runs over the first N devices "
                        "(default 1: one device, no mesh)")
    p.add_argument("--axis-type", default="explicit", choices=("explicit", "auto"),
                   help="the type of the 'tp' mesh axis when tp > 1 (default explicit, jax.make_mesh's)")
    p.add_argument("--codebook", default="nf")
    p.add_argument("--attention", default="auto",
                   help="comma list of single-token attention modes, each a row: auto (the Pallas "
                        "kernel on a GPU), xla, pallas (default auto)")
    p.add_argument("--norm", default="auto",
                   help="comma list of residual add + RMSNorm modes, each a row (with every "
                        "--attention mode): auto (the Pallas kernel on a GPU), xla, pallas "
                        "(default auto)")
    p.add_argument("--mlp-gate", default="auto",
                   help="comma list of MLP gate modes, each a row (with every other mode): auto "
                        "(silu(gate) * up inside the kbit gate/up kernel), xla (default auto)")
    p.add_argument("--out", default=None, help="directory for <name>.json and <name>.md")
    p.add_argument("--name", default="decode", help="file name stem under --out (default: decode)")
    p.add_argument("--profile", default=None, help="write a jax.profiler trace per row under this dir")
    p.add_argument("--progress", action="store_true", help="progress bar while building models")
    p.add_argument("--quantize-head", action="store_true",
                   help="quantize lm_head too (default: dense, like embeddings; it is ~1/8 of an 8B model's bytes)")
    p.add_argument("--in-process", action="store_true",
                   help="run every model in this process (peak memory is then cumulative)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2")
    if args.worker:
        if len(args.tp) != 1:
            p.error("a worker runs one --tp size")
        args.tp = args.tp[0]
    for mode, choices in MODES.items():
        value = getattr(args, mode)
        if any(m not in choices for m in value.split(",")) or (args.worker and "," in value):
            p.error(f"--{mode.replace('_', '-')}: {value!r} (a worker takes one of {', '.join(choices)})")
    if any(t < 1 for t in ([args.tp] if args.worker else args.tp)):
        p.error("--tp sizes must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(RESULT + json.dumps(run_worker(args)), flush=True)
        return
    env = environment()
    print(json.dumps(env), file=sys.stderr)
    rows = []
    for config in args.configs.split(","):
        for tp in args.tp:
            for values in itertools.product(*(getattr(args, m).split(",") for m in MODES)):
                modes = dict(zip(MODES, values))
                for weights in (args.weights or DEFAULT_WEIGHTS[config]).split(","):
                    if args.in_process:
                        sub = argparse.Namespace(**{**vars(args), "config": config, "weights": weights,
                                                    "tp": tp, **modes})
                        rows += run_worker(sub)
                    else:
                        rows += run_subprocess(args, config, weights, tp, modes)
    md = to_markdown(env, args, rows)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
            json.dump({"environment": env, "args": {k: v for k, v in vars(args).items()
                                                    if k not in ("worker", "config")},
                       "results": rows}, f, indent=1)
        with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
            f.write(md)


if __name__ == "__main__":
    main()
