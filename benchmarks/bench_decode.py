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

Mixture-of-experts configs (random weights, the routed- and shared-expert sizes of the real
models: ``kbit_jax.models.config``). The Qwen3-Coder-Next-class model (~80B) at K=4 on one H200
(bf16 does not fit), and its 12-layer variant in bf16 and K=4 (the "moe" column names the
routed-expert product: bf16 through ``kbit_jax.flax.MoE``'s gather-einsum or lax.ragged_dot, k-bit
through kbit ragged_dot; "ep" with --tp > 1: experts sharded over the devices):
    python benchmarks/bench_decode.py --configs qwen3-coder-next-12l --weights bf16,4 \
        --batches 1,8 --prompt 32 --new-tokens 64 --reps 2 --progress --out /tmp/decode_moe
    python benchmarks/bench_decode.py --configs qwen3-coder-next --weights 4 --batches 1,8 \
        --prompt 32 --new-tokens 64 --reps 2 --progress --out /tmp/decode_moe80b
    python benchmarks/bench_decode.py --configs glm-4.7-flash,qwen3-30b-a3b --weights bf16,4 \
        --batches 1,8 --prompt 32 --new-tokens 64 --reps 2 --out /tmp/decode_moe30b
``--layers N`` keeps the first N layers of every config (e.g. ``--configs qwen3-coder-next
--layers 12`` is qwen3-coder-next-12l). Expert parallelism over 2 GPUs against one, attention
replicated (the MoE models' default: one all-reduce per layer) and tensor-parallel (two)
(``--attention-parallel``, `decoder.ATTENTION_PARALLEL`; a row each at tp > 1):
    python benchmarks/bench_decode.py --configs qwen3-coder-next --weights 4 --tp 1,2 \
        --attention-parallel replicated,tensor --batches 1,8 --prompt 32 --new-tokens 64 \
        --reps 2 --out /tmp/decode_moe_ep
CPU smoke test of the MoE paths (8 experts; expert parallelism over 8 simulated devices):
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python benchmarks/bench_decode.py \
        --configs tiny-moe --tp 1,8 --batches 1,4 --weights bf16,4 --prompt 8 --new-tokens 4 \
        --attention-parallel replicated,tensor --reps 1 --out /tmp/decode_moe_cpu

The whole Llama-3-70B sweep on a 4-GPU machine in one command (tp 4, 2, 1; batch 1 and 8;
bf16, K = 4, K = 2): ``--concurrent`` runs workers whose GPUs do not overlap at the same time
(the tp-4 rows alone, then two tp-2 rows side by side, then tp 2 next to the tp-1 rows), each
worker compiles all its programs at once in parallel threads, and ``--compile-cache`` keeps
them for a later run with the same XLA options (about 4-5 minutes in all):
    python benchmarks/bench_decode.py --configs llama3-70b --weights bf16,4,2 --tp 4,2,1 \\
        --batches 1,8 --new-tokens 64 --reps 2 --concurrent --compile-cache /tmp/jax_cache \\
        --xla-flags=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false --out /tmp/tp_sweep
Where a tp-4 step's time goes (``--profile``: products / all-reduces / glue / idle per step,
a table after the throughput table), once per set of XLA options (``--xla-flags``, repeated):
    python benchmarks/bench_decode.py --configs llama3-70b --weights 4 --tp 4 --batches 1 \\
        --new-tokens 64 --reps 2 --compile-cache /tmp/jax_cache --profile /tmp/prof \\
        --xla-flags=--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false --xla-flags= \\
        --xla-flags="--xla_gpu_unsupported_use_all_reduce_one_shot_kernel=false \\
            --xla_gpu_enable_latency_hiding_scheduler=true" --out /tmp/tp4_profile
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
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2.0 ** 30
RESULT = "RESULT "  # prefix of the worker's stdout line carrying its rows as JSON

#: Weights benchmarked per config by default ("bf16" or a bit width). The 70B config in bf16
#: does not fit one H200 (141 GB of weights); it is attempted and reported as not fitting.
DEFAULT_WEIGHTS = {"llama3-8b": "bf16,2,3,4,5", "llama3-70b": "bf16,2,3,4", "tiny": "bf16,2,3,4,5",
                   "tiny-tp": "bf16,2,3,4,5", "tiny-moe": "bf16,4", "qwen3-coder-next": "4",
                   "qwen3-coder-next-12l": "bf16,4", "glm-4.7-flash": "bf16,4",
                   "qwen3-30b-a3b": "bf16,4"}
#: The decoder's kernel choices (`decoder.build_model` keywords) and their values; each
#: flag takes a comma list, and every combination is a row. Spelled out here: the driver parses
#: its arguments before importing jax and flax (the decoder module would pull them in).
MODES = {"attention": ("auto", "xla", "pallas"), "norm": ("auto", "xla", "pallas"),
         "mlp_gate": ("auto", "xla"), "moe_method": ("auto", "gather", "gather-reduce", "ragged", "all"),
         "moe_routing": ("auto", "compare", "sort", "kernel"),
         "attention_parallel": ("auto", "tensor", "replicated")}
#: What a row written before a mode existed ran (markdown of older JSON rows): routing through
#: XLA (the comparison path at decode sizes on a GPU) before the routing kernel.
MODE_BEFORE = {"attention_parallel": "tensor", "moe_routing": "auto (no kernel)"}
#: Configs without MoE layers: one row whatever --moe-routing lists.
DENSE_CONFIGS = ("llama3-8b", "llama3-70b", "tiny", "tiny-tp")


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


class _Lines:
    """stderr for the worker's progress bar: tqdm redraws with carriage returns, which a pipe
    read line by line would hold back; each redraw becomes a line."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        for part in text.replace("\r", "\n").split("\n"):
            if part.strip():
                self.stream.write(part.rstrip() + "\n")
        self.stream.flush()

    def flush(self):
        self.stream.flush()

    def __getattr__(self, name):
        return getattr(self.stream, name)


def weight_bytes(cfg, bits, tp: int = 1, attention: str = "tensor", quantize_head: bool = True) -> float:
    """Bytes of one device's weights: dense MLPs and routed experts split over the ``tp``
    devices (tensor / expert parallel), attention too unless ``attention`` is "replicated",
    k-bit at ``bits + 0.25`` bits per weight (codes and one E4M4 scale per 32) when quantized;
    embedding, routers, norms and shared experts replicated (lm_head split), bf16 unless
    quantized. A quantized model's head is k-bit as ``decoder.build_model`` makes it (with
    ``quantize_head``; a tied embedding then gets a k-bit copy as the head)."""
    from kbit_jax.models import decoder
    per_weight = 2.0 if bits is None else (bits + 0.25) / 8
    attn = cfg.n_layers * cfg.dim * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    n_moe = len(cfg.moe_layers)
    split = ((cfg.n_layers - n_moe) * 3 * cfg.dim * cfg.hidden_dim
             + n_moe * cfg.n_experts * 3 * cfg.dim * cfg.moe_hidden_dim)
    shared = n_moe * 3 * cfg.dim * cfg.shared_expert_dim
    head = 0 if cfg.tie_embeddings else cfg.dim * cfg.vocab_size
    rest = cfg.num_params() - attn - split - shared - head          # embedding, routers, norms
    attn_tp = 1 if attention == "replicated" else tp
    if bits is not None and decoder.head_dense_reason(cfg, quantize_head) is None:
        head_bytes = cfg.dim * cfg.vocab_size * per_weight
    else:
        head_bytes = 2 * head
    return (split / tp + attn / attn_tp + shared) * per_weight + head_bytes / tp + 2 * rest


def run_worker(args) -> list[dict]:
    sys.path.insert(0, ROOT)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import kbit_jax
    from kbit_jax.models import config, decoder

    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    if args.compile_cache:     # XLA's persistent cache: a program compiled before loads from disk
        jax.config.update("jax_compilation_cache_dir", args.compile_cache)
        # The kbit primitives' partitioning callbacks (custom_partitioning) are looked up by a
        # per-process pointer in the program; it only matters while partitioning, so it must
        # not make every process's key different.
        jax.config.update("jax_remove_custom_partitioning_ptr_from_cache_key", True)
    cfg = decoder.CONFIGS[args.config]
    if args.layers:
        cfg = config.with_layers(cfg, args.layers)
    bits = None if args.weights == "bf16" else int(args.weights)
    tp = args.tp
    base = {"config": args.config, "layers": cfg.n_layers, "layers_override": bool(args.layers),
            "weights": args.weights, "bits": bits, "tp": tp,
            **{m: getattr(args, m) for m in MODES}, "quantize_head": not args.dense_head,
            "prompt": args.prompt, "new_tokens": args.new_tokens,
            "xla_flags": args.xla_flags[0] if args.xla_flags else "",
            "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
    max_len = args.prompt + args.new_tokens
    if tp > len(jax.devices()):
        return [{**base, "status": f"needs {tp} devices, found {len(jax.devices())}"}]
    # How attention is placed over the tp devices ("tensor" / "replicated"; "auto" resolved).
    placement = decoder.attention_placement(cfg, args.attention_parallel)
    base["attention_placement"] = placement if tp > 1 else None
    try:
        decoder.check_tp(cfg, tp, placement)
    except ValueError as e:
        return [{**base, "status": f"cannot split: {e}"}]
    devices = jax.devices()[:tp]

    # Would the model fit? Per device: its share of the weights (`weight_bytes`), the largest
    # KV cache's share (all of it with replicated attention); activations are small at decode.
    weight_bytes_ = weight_bytes(cfg, bits, tp, placement, quantize_head=not args.dense_head)
    cache_bytes = (4 * cfg.n_layers * max(args.batches) * max_len * cfg.n_kv_heads * cfg.head_dim
                   / (1 if placement == "replicated" else tp))
    limit, _ = _device_memory(devices)
    if limit is not None and weight_bytes_ + cache_bytes > limit:
        return [{**base, "status": f"does not fit: needs ~{(weight_bytes_ + cache_bytes) / GIB:.1f} GiB "
                                   f"per device, device has {limit / GIB:.1f} GiB"}]

    mesh = None
    if tp > 1:
        axis_type = {"explicit": AxisType.Explicit, "auto": AxisType.Auto}[args.axis_type]
        mesh = jax.make_mesh((tp,), ("tp",), axis_types=(axis_type,), devices=devices)
        base["axis_type"] = args.axis_type
    t0 = time.perf_counter()
    if args.progress:
        sys.stderr = _Lines(sys.stderr)
    model, report = decoder.build_model(cfg, bits=bits, codebook=args.codebook, seed=0,
                                      param_dtype=jnp.bfloat16, quantize_head=not args.dense_head,
                                      progress=args.progress, mesh=mesh,
                                      **{m: getattr(args, m) for m in MODES})
    jax.block_until_ready(nnx.state(model))
    build_s = time.perf_counter() - t0
    graphdef, state = nnx.split(model)
    model_bytes = sum(x.nbytes for x in jax.tree.leaves(state))
    device_model_bytes = _device_bytes(state, devices[0])
    model_cache_sharding = model.cache_sharding()   # kv heads over tp, or replicated
    del model

    if mesh is None:
        cache_sharding = prompt_sharding = None
        context = contextlib.nullcontext
    else:
        cache_sharding = model_cache_sharding
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
    steps = args.new_tokens - 1
    prompts = {batch: jax.device_put(rng.integers(0, cfg.vocab_size, (batch, args.prompt)).astype(np.int32),
                                     prompt_sharding) for batch in args.batches}
    t0 = time.perf_counter()
    compiled = in_mesh(_compile_all)(decoder, graphdef, state, cfg, prompts, max_len, steps,
                                     args.prompt, cache_sharding, prompt_sharding)
    compile_all_s = time.perf_counter() - t0
    for batch in args.batches:
        prompt = prompts[batch]

        @in_mesh
        def once(trace_dir=None):
            cache = decoder.init_cache(cfg, batch, max_len, jnp.bfloat16, sharding=cache_sharding)
            jax.block_until_ready(cache)
            t0 = time.perf_counter()
            logits, cache = decoder.prefill(graphdef, state, prompt, cache)
            # (placed like the prompt: the decode loop then runs the program compiled ahead)
            first = jax.device_put(jnp.argmax(logits, axis=-1).astype(jnp.int32), prompt_sharding)
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
        profile = profile_split = None
        if args.profile:
            path = os.path.join(args.profile, f"{args.config}-{args.weights}-tp{tp}-b{batch}")
            once(trace_dir=path)
            profile, profile_split = _profile_summary(path, steps)
        collectives = None
        if mesh is not None and batch == args.batches[0]:
            collectives = hlo_collectives(compiled[batch].as_text())
        _, peak = _device_memory(devices)
        rows.append({
            **base, "status": "ok", "batch": batch,
            # The routed-expert product of a decode step (None: no MoE layers).
            "moe_path": decoder.moe_path(cfg, bits, batch, tp, args.moe_method),
            "decode_tokens_per_s": batch * steps / decode_s,
            "decode_ms_per_step": 1e3 * decode_s / steps,
            "prefill_ms": 1e3 * prefill_s,
            "model_gib": model_bytes / GIB,
            "device_model_gib": device_model_bytes / GIB,
            "peak_gib": None if peak is None else peak / GIB,
            "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB,
            "build_s": build_s, "compile_s": compile_s,
            # every batch size's prefill and decode programs, compiled in parallel threads
            "compile_all_s": compile_all_s,
            "repeatable": all(np.array_equal(t[2], times[0][2]) for t in times),
            # The first row's first greedy tokens: rows of the same weights should agree
            # whichever kernels ran (up to bf16 near-ties).
            "tokens": times[0][2][0, :16].tolist(),
            "report": None if report is None else str(report),
            # With --profile: GPU time per decode step by kernel category, and idle gaps.
            "profile": profile,
            # With --profile: us per step in products / all-reduces / glue / idle (time_split).
            "profile_split": profile_split,
            # Collective instructions in the compiled decode loop (first batch size, tp > 1):
            # expected 2 all-reduces per layer with tensor-parallel attention, 1 with replicated
            # attention, + 2 tiny all-gathers (argmax over the sharded vocabulary: [batch, tp]
            # values and indices), no all-gather of weights.
            "decode_collectives": collectives,
        })
        print(f"  {args.config} {args.weights:>4} tp {tp}"
              + (f" attention {placement}" if tp > 1 else "") + f" batch {batch:>3}: "
              f"{rows[-1]['decode_tokens_per_s']:10.1f} tok/s", file=sys.stderr, flush=True)
        if profile:
            print(profile, file=sys.stderr, flush=True)
    return rows


def _compile_all(decoder, graphdef, state, cfg, prompts, max_len, steps, pos, cache_sharding,
                 prompt_sharding) -> dict:
    """Compile the prefill and decode programs of every batch size at once: traced one after
    the other, compiled in parallel threads (XLA releases the GIL), so a worker waits about
    one compile instead of two per batch size (an 80-layer program takes 10-20 s). The jitted
    functions then find them in their cache. Returns the compiled decode loop by batch size."""
    import concurrent.futures
    import jax
    import jax.numpy as jnp
    import numpy as np
    lowered = {}
    for batch, prompt in prompts.items():
        cache = decoder.init_cache(cfg, batch, max_len, jnp.bfloat16, sharding=cache_sharding)
        token = jax.device_put(np.zeros(batch, np.int32), prompt_sharding)
        lowered[("prefill", batch)] = decoder.prefill.lower(graphdef, state, prompt, cache)
        lowered[("decode", batch)] = decoder.decode.lower(graphdef, state, token, cache, pos, steps)
        del cache
    with concurrent.futures.ThreadPoolExecutor(len(lowered)) as pool:
        done = dict(zip(lowered, pool.map(lambda low: low.compile(), lowered.values())))
    return {batch: done[("decode", batch)] for batch in prompts}


def _profile_summary(path, steps):
    """(profile_summary's per-step text for the trace under `path`, or why there is none;
    the step's exclusive `time_split` in us per step, or None)."""
    import profile_summary  # benchmarks/, next to this script
    try:
        trace = profile_summary.load_trace(path)
        # The Llama layer's kbit products in order: q/k/v, o, gate/up, down; the layers are found
        # from the q/k/v product before each attention kernel, so a quantized lm_head is counted
        # apart.
        kernels = profile_summary.kernel_events(trace)
        split = time_split(kernels, profile_summary.category)
        return "\n".join([time_split_text(split, steps),
                          profile_summary.summarize(kernels, steps, period=4),
                          profile_summary.layer_sequence(kernels, period=4),
                          profile_summary.host_summary(trace, steps)]), \
            {k: v / steps for k, v in split.items()}
    except (SystemExit, OSError, ValueError) as e:   # e.g. a CPU run: no GPU process in the trace
        return f"no summary: {e}", None


#: Where a decode step's GPU time goes: profile_summary's kernel categories in three groups
#: (anything else, XLA's fusions, copies and the attention and norm kernels, is "glue").
SPLIT = {"products": ("kbit fused matmul", "kbit dequantize", "kbit other", "cuBLAS / dense GEMM"),
         "all-reduces": ("NCCL",)}
#: XLA's own collective kernels (its one-shot all-reduce) count as all-reduces too.
_COLLECTIVE_KERNEL = re.compile(r"all.?reduce|all.?gather|collective", re.I)


def time_split(kernels, category) -> dict:
    """GPU 0's span from its first kernel's start to its last kernel's end, split exclusively
    into products, all-reduces, glue and idle (microseconds): each instant goes to the
    earliest-started kernel still running (a kernel launched early, e.g. as a programmatic
    dependent, waits for its predecessor: the overlap is the predecessor's), idle where none
    runs. ``kernels``: (start, end, name) sorted by start; ``category``: name -> label."""
    def group(name):
        if _COLLECTIVE_KERNEL.search(name):
            return "all-reduces"
        label = category(name)
        return next((g for g, labels in SPLIT.items() if label in labels), "glue")

    split = dict.fromkeys(("products", "all-reduces", "glue", "idle"), 0.0)
    cursor = kernels[0][0] if kernels else 0.0
    for start, end, name in kernels:
        if end <= cursor:
            continue                          # entirely under kernels that started earlier
        split["idle"] += max(0.0, start - cursor)
        split[group(name)] += end - max(start, cursor)
        cursor = end
    return split


def time_split_text(split: dict, steps: int) -> str:
    span = sum(split.values()) or 1.0
    return "time per step, exclusive (us): " + ", ".join(
        f"{k} {v / steps:.1f} ({100 * v / span:.0f}%)" for k, v in split.items()) + \
        f"; span {span / steps:.1f}"


# -- driver ------------------------------------------------------------------------------------
def environment() -> dict:
    sys.path.insert(0, ROOT)
    code = ("import json, jax, flax, kbit_jax; d = jax.devices()[0]; "
            "print(json.dumps({'device': d.device_kind, 'platform': d.platform, "
            "'device_count': jax.device_count(), "
            "'jax': jax.__version__, 'flax': flax.__version__, 'kbit_jax': kbit_jax.__version__, "
            "'build_info': {k: str(v) for k, v in kbit_jax.build_info().items()}}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    info = json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else {"error": out.stderr[-2000:]}
    info.update(date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                python=platform.python_version(), host=platform.node(),
                xla_flags=os.environ.get("XLA_FLAGS", ""))  # e.g. the all-reduce (docs/sharding.md)
    return info


def start_worker(args, config: str, weights: str, tp: int, modes: dict, xla_flags: str = "",
                 gpus=None, live: bool = False) -> dict:
    """Start the worker of one (config, weights, tp, modes) in its own process, with
    ``xla_flags`` added to XLA_FLAGS and, given ``gpus``, CUDA_VISIBLE_DEVICES set to them.
    With ``live`` its stderr (progress) is also echoed as it comes.
    Its output goes to temporary files (pipes could fill while other workers run)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--config", config,
           "--weights", weights, "--batches", ",".join(map(str, args.batches)),
           "--prompt", str(args.prompt), "--new-tokens", str(args.new_tokens),
           "--reps", str(args.reps), "--codebook", args.codebook, "--tp", str(tp),
           "--axis-type", args.axis_type]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    for m, value in modes.items():
        cmd += [f"--{m.replace('_', '-')}", value]
    if args.profile:
        cmd += ["--profile", args.profile]
    if args.progress:
        cmd += ["--progress"]
    if args.dense_head:
        cmd += ["--dense-head"]
    if args.compile_cache:
        cmd += ["--compile-cache", args.compile_cache]
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.95", **os.environ, "PYTHONPATH": ROOT}
    if xla_flags:
        cmd += [f"--xla-flags={xla_flags}"]
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.PIPE if live else err, text=True,
                            env=env, cwd=ROOT)
    echo = None
    if live:
        def copy():
            for line in proc.stderr:
                sys.stderr.write(line)
                sys.stderr.flush()
                err.write(line)
        echo = threading.Thread(target=copy, daemon=True)
        echo.start()
    return {"proc": proc, "out": out, "err": err, "echo": echo, "gpus": gpus, "start": time.perf_counter(),
            "row": {"config": config, "weights": weights, "tp": tp, **modes, "xla_flags": xla_flags}}


def finish_worker(worker: dict) -> list[dict]:
    """Wait for a `start_worker` process; its rows, or one row saying how it failed."""
    proc = worker["proc"]
    proc.wait()
    if worker.get("echo") is not None:
        worker["echo"].join()
    out, err = worker["out"], worker["err"]
    out.seek(0), err.seek(0)
    stdout, stderr = out.read(), err.read()
    out.close(), err.close()
    if worker.get("echo") is None:
        sys.stderr.write(stderr)      # the worker's progress and any crash report
    wall = time.perf_counter() - worker["start"]
    row = worker["row"]
    print(f"worker {row['config']} {row['weights']} tp {row['tp']}"
          + (f" on GPUs {','.join(worker['gpus'])}" if worker["gpus"] else "")
          + f": exit {proc.returncode} after {wall:.0f} s", file=sys.stderr, flush=True)
    lines = [l[len(RESULT):] for l in stdout.splitlines() if l.startswith(RESULT)]
    if proc.returncode != 0 or not lines:
        # Keep the end of the worker's stderr in the results: a crash (an XLA check failure
        # aborts the process) must be diagnosable from the JSON alone.
        return [{**worker["row"], "status": f"failed (exit {proc.returncode}); stderr_tail in the JSON",
                 "stderr_tail": stderr[-4000:], "worker_s": wall}]
    return [{**r, "worker_s": wall} for r in json.loads(lines[-1])]


def run_subprocess(args, config: str, weights: str, tp: int, modes: dict, xla_flags: str = "") -> list[dict]:
    return finish_worker(start_worker(args, config, weights, tp, modes, xla_flags, live=True))


def run_concurrent(args, jobs: list[tuple], gpus: list[str]) -> list[dict]:
    """Run the workers of ``jobs`` ((config, weights, tp, modes, xla_flags) each) at the same
    time where their GPUs do not overlap: largest tp first, each started as soon as enough of
    ``gpus`` are free, on GPUs no other running worker has. Rows in the order of ``jobs``."""
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i][2])
    free, running, rows = list(gpus), {}, {}
    while order or running:
        for i in list(order):
            need = min(jobs[i][2], len(gpus))   # (a tp above that: the worker says so in its row)
            if need <= len(free):
                mine, free = free[:need], free[need:]
                running[i] = start_worker(args, *jobs[i], gpus=mine)
                order.remove(i)
        time.sleep(0.2)
        for i, worker in list(running.items()):
            if worker["proc"].poll() is not None:
                rows[i] = [{**r, "concurrent": True} for r in finish_worker(worker)]
                free += worker["gpus"]
                del running[i]
    return [r for i in range(len(jobs)) for r in rows[i]]


def mode_cell(row: dict, mode: str) -> str:
    """A row's value of one of `MODES` (what older rows ran where they lack it), with the
    attention placement that "auto" resolved to at tp > 1."""
    value = row.get(mode, MODE_BEFORE.get(mode, "xla"))
    if mode == "attention_parallel" and value == "auto" and row.get("attention_placement"):
        return f"auto ({row['attention_placement']})"
    return value


def config_cell(row: dict) -> str:
    """The config's name, with its layer count when --layers changed it."""
    return f"{row['config']} ({row['layers']} layers)" if row.get("layers_override") else row["config"]


def to_markdown(env: dict, args, rows: list[dict]) -> str:
    flag_sets = getattr(args, "xla_flags", None) or []
    show_flags = len(flag_sets) > 1    # one column more: the XLA options of the row

    def modes(r):   # (rows of older runs lack the newer modes: they ran XLA's path there)
        cells = tuple(mode_cell(r, m) for m in MODES)
        return cells + ((f"`{r.get('xla_flags') or '(none)'}`",) if show_flags else ())

    def key(r):
        return r["config"], r["batch"], r.get("tp", 1), *modes(r)

    dense = {key(r): r["decode_tokens_per_s"] for r in rows
             if r["status"] == "ok" and r["weights"] == "bf16"}
    lines = [
        f"# Greedy decode throughput ({env.get('device', '?')}, {env.get('date', '')})",
        "",
        f"Prompt {args.prompt} tokens, {args.new_tokens} new tokens (decode tok/s counts the "
        f"{args.new_tokens - 1} steps after prefill, summed over the batch); codebook "
        f"{args.codebook!r}; lm_head {'bf16' if args.dense_head else 'quantized'}; median of {args.reps}. "
        f"Peak GiB is the worker process's device peak, model building included (with tp > 1: "
        f"the largest over its devices). tp = tensor-parallel devices ({args.axis_type} mesh "
        f"axis); attention: the single-token attention (`decoder.ATTENTION_MODES`; auto = the "
        f"Pallas kernel on a GPU); norm: the residual add + RMSNorm (auto = its Pallas kernel on "
        f"a GPU); mlp gate: where silu(gate) * up runs (auto = inside the kbit gate/up kernel); "
        f"moe method: the bf16 MoE layers' expert path (`kbit_jax.flax.moe.MOE_METHODS`); moe "
        f"routing: how MoE layers route their tokens (`kbit_jax.flax.routing.ROUTING_METHODS`; auto "
        f"= softmax, top-k and the sort by expert as one Pallas kernel on a GPU at decode sizes); attention "
        f"parallel: how attention is placed over the tp devices (`decoder.ATTENTION_PARALLEL`: "
        f"tensor = heads split, an all-reduce after o_proj; replicated = whole on every device, no "
        f"collective; auto = replicated with MoE layers), the placement it ran in parentheses; moe "
        f"the product a decode step runs (k-bit: kbit ragged_dot; ep: experts over the tp devices); "
        f"vs bf16 compares with bf16 at the same tp and modes; "
        f"model GiB is the whole model, "
        f"GiB/dev the first device's share. "
        f"jax {env.get('jax')}, flax {env.get('flax')}, kbit_jax build {env.get('build_info')}; "
        f"XLA_FLAGS {env.get('xla_flags') or '(none)'}"
        + (f", plus `{flag_sets[0]}`" if len(flag_sets) == 1 and flag_sets[0] else "") + "."
        + (" Rows ran concurrently on disjoint GPUs (--concurrent)."
           if any(r.get("concurrent") for r in rows) else ""),
        "",
        "| config | tp | attention | norm | mlp gate | moe method | moe routing | attention parallel | "
        + ("xla flags | " if show_flags else "")
        + "batch | weights | moe | decode tok/s | vs bf16 | ms/step | prefill ms | model GiB | GiB/dev | peak GiB |",
        "|---|---:|---|---|---|---|---|---|" + ("---|" if show_flags else "") + "---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        tp, mode_cells = r.get("tp", 1), " | ".join(modes(r))
        if r["status"] != "ok":
            lines.append(f"| {config_cell(r)} | {tp} | {mode_cells} | | {r['weights']} | | {r['status']} | | | | | | |")
            continue
        base = dense.get(key(r))
        speedup = f"{r['decode_tokens_per_s'] / base:.2f}x" if base else "-"
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        weights = "bf16" if r["bits"] is None else f"K={r['bits']}"
        per_device = r.get("device_model_gib", r["model_gib"])
        lines.append(f"| {config_cell(r)} | {tp} | {mode_cells} | {r['batch']} | {weights} | "
                     f"{r.get('moe_path') or '-'} | {r['decode_tokens_per_s']:.1f} | "
                     f"{speedup} | {r['decode_ms_per_step']:.2f} | {r['prefill_ms']:.1f} | "
                     f"{r['model_gib']:.2f} | {per_device:.2f} | {peak} |")
    checked = [r for r in rows if r.get("decode_collectives")]
    if checked:   # the compiled decode loops' collectives: weights are never all-gathered
        lines += ["", "Collectives in the compiled decode loop (first batch size): " + "; ".join(
            f"{r['config']} tp {r['tp']} {r['weights']} attention {r.get('attention_placement') or 'tensor'}: "
            f"{r['decode_collectives']['all-reduce']} all-reduces, all-gathers "
            f"{r['decode_collectives']['all_gather_shapes'] or 'none'}"
            for r in checked) + " (expected: 2 all-reduces per layer with tensor-parallel attention, 1 "
            "with replicated attention, and the argmax's two [batch, tp] all-gathers)."]
    profiled = [r for r in rows if r.get("profile_split")]
    if profiled:
        lines += ["", "Where a decode step's GPU time goes (--profile; GPU 0, us per step, each "
                  "instant counted once: products = kbit and dense matmul kernels, all-reduces = "
                  "NCCL / XLA collective kernels (time waiting for the other GPUs included), glue "
                  "= everything else, idle = no kernel running):", "",
                  "| config | tp | " + ("xla flags | " if show_flags else "") + "batch | weights | "
                  "products | all-reduces | glue | idle | step |",
                  "|---|---:|" + ("---|" if show_flags else "") + "---:|---|---:|---:|---:|---:|---:|"]
        for r in profiled:
            t = r["profile_split"]
            flags = f"{modes(r)[-1]} | " if show_flags else ""
            lines.append(f"| {r['config']} | {r.get('tp', 1)} | {flags}{r['batch']} | {r['weights']} | "
                         + " | ".join(f"{t[k]:.0f}" for k in ("products", "all-reduces", "glue", "idle"))
                         + f" | {sum(t.values()):.0f} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="llama3-8b,llama3-70b",
                   help="comma list of: " + ", ".join(DEFAULT_WEIGHTS))
    p.add_argument("--layers", default=None, type=int,
                   help="keep the first N layers of each config (kbit_jax.models.config.with_layers)")
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
    p.add_argument("--moe-method", default="auto",
                   help="comma list of the bf16 MoE layers' expert paths, each a row (with every "
                        "other mode): auto (gather-einsum at decode sizes, else lax.ragged_dot), "
                        "gather, gather-reduce, ragged, all (every expert; the reference) "
                        "(default auto)")
    p.add_argument("--moe-routing", default="auto",
                   help="comma list of MoE routing methods, each a row (with every other mode; "
                        "MoE configs only): auto (one Pallas kernel on a GPU at decode sizes, else "
                        "compare on a GPU / sort), compare, sort, kernel (default auto)")
    p.add_argument("--attention-parallel", default="auto",
                   help="comma list of attention placements over the tp devices, each a row at "
                        "tp > 1 (with every other mode): tensor (heads split, an all-reduce after "
                        "o_proj), replicated (whole on every device, no collective), auto "
                        "(replicated in a model with MoE layers, else tensor) (default auto)")
    p.add_argument("--out", default=None, help="directory for <name>.json and <name>.md")
    p.add_argument("--name", default="decode", help="file name stem under --out (default: decode)")
    p.add_argument("--profile", default=None, help="write a jax.profiler trace per row under this dir")
    p.add_argument("--progress", action="store_true", help="progress bar while building models")
    p.add_argument("--dense-head", action="store_true",
                   help="keep lm_head bf16 in the k-bit models (default: quantized like the blocks; "
                        "read whole every step, a bf16 head is ~1/5 of a K=4 8B step's weight bytes)")
    p.add_argument("--in-process", action="store_true",
                   help="run every model in this process (peak memory is then cumulative)")
    p.add_argument("--xla-flags", action="append", default=None, metavar="FLAGS",
                   help="XLA options added to XLA_FLAGS for the workers; repeat the option to "
                        "compare option sets (every row once per set, e.g. --xla-flags= "
                        "--xla-flags=--xla_gpu_enable_latency_hiding_scheduler=true: write "
                        "'=' before a value that starts with --)")
    p.add_argument("--concurrent", action="store_true",
                   help="on GPUs, run workers whose device sets do not overlap at the same time "
                        "(each on its own GPUs through CUDA_VISIBLE_DEVICES; largest tp first): "
                        "a sweep over tp 1, 2, 4 on 4 GPUs takes about 5 worker times instead "
                        "of 9. Rows record concurrent: true")
    p.add_argument("--compile-cache", default=None, metavar="DIR",
                   help="JAX's persistent compilation cache directory: a program compiled by an "
                        "earlier run (same jax, XLA options and shapes) is loaded, not compiled")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2")
    if args.worker:
        if len(args.tp) != 1:
            p.error("a worker runs one --tp size")
        args.tp = args.tp[0]
    if args.in_process and (args.xla_flags or args.concurrent):
        p.error("--in-process runs in this process: XLA_FLAGS are fixed and nothing runs "
                "concurrently (drop --xla-flags / --concurrent, or --in-process)")
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
    start = time.perf_counter()
    env = environment()
    print(json.dumps(env), file=sys.stderr)
    rows, jobs = [], []
    for config in args.configs.split(","):
        for xla_flags in args.xla_flags or [""]:
            for tp in args.tp:
                for values in itertools.product(*(getattr(args, m).split(",") for m in MODES)):
                    modes = dict(zip(MODES, values))
                    for weights in (args.weights or DEFAULT_WEIGHTS[config]).split(","):
                        if weights != "bf16" and modes["moe_method"] != args.moe_method.split(",")[0]:
                            continue      # k-bit MoE layers have one path: one row
                        if tp == 1 and modes["attention_parallel"] != args.attention_parallel.split(",")[0]:
                            continue      # one device: nothing to place, one row
                        if config in DENSE_CONFIGS and modes["moe_routing"] != args.moe_routing.split(",")[0]:
                            continue      # no MoE layers: nothing to route, one row
                        jobs.append((config, weights, tp, modes, xla_flags))
    if args.in_process:
        for config, weights, tp, modes, _ in jobs:
            rows += run_worker(argparse.Namespace(**{**vars(args), "config": config,
                                                     "weights": weights, "tp": tp, **modes}))
    elif args.concurrent and env.get("platform") == "gpu":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        gpus = visible.split(",") if visible else [str(i) for i in range(env["device_count"])]
        rows = run_concurrent(args, jobs, gpus)
    else:
        for job in jobs:
            rows += run_subprocess(args, *job)
            write_results(args, env, rows)  # after every worker: a run cut short keeps its rows
    env["wall_s"] = time.perf_counter() - start
    print(f"{len(jobs)} workers, {env['wall_s']:.0f} s in all", file=sys.stderr, flush=True)
    print(write_results(args, env, rows))


def write_results(args, env, rows) -> str:
    """The markdown table of ``rows``; with ``--out``, it and the JSON written there."""
    md = to_markdown(env, args, rows)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
            json.dump({"environment": env, "args": {k: v for k, v in vars(args).items()
                                                    if k not in ("worker", "config")},
                       "results": rows}, f, indent=1)
        with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
            f.write(md)
    return md


if __name__ == "__main__":
    main()
