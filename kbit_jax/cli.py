"""Command line: ``python -m kbit_jax <command> [options]`` (``--help`` after a command for its options).

    demo        quantize one layer, run the fused matmul, print its error and speed
    generate    generate text from a Hugging Face Llama-3 / Qwen3 / Qwen3-MoE directory
    perplexity  a model's perplexity on a text file (sliding window), to measure what bits cost
    quantize    quantize a Hugging Face directory once and save it (``load`` reads it back as is)
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time

COMMANDS = ("demo", "generate", "perplexity", "quantize")
GIB = 2.0 ** 30


# -- demo ------------------------------------------------------------------------------------------
def demo(argv) -> int:
    """Quantize a layer, run the fused matmul, print error and speed."""
    import jax
    import jax.numpy as jnp

    import kbit_jax as kj
    from kbit_jax.timing import median_call_seconds

    parser = argparse.ArgumentParser(prog="python -m kbit_jax demo", description=demo.__doc__)
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


# -- shared model options --------------------------------------------------------------------------
class UsageError(Exception):
    """A bad command line or input file: printed as ``error: ...`` with exit status 2."""


def _model_args(parser, *, bits_required=False):
    parser.add_argument("--model", required=True,
                        help="a Hugging Face directory (config.json, *.safetensors, tokenizer.json) "
                             "or one written by `quantize`")
    parser.add_argument("--bits", type=int, default=None, required=bits_required,
                        help="quantize the linear layers to 2..5 bits while loading "
                             "(default: keep them dense; a quantized directory loads as saved)")
    parser.add_argument("--codebook", default="nf", help="codebook name (default nf)")
    parser.add_argument("--dense-head", action="store_true",
                        help="with --bits, keep the output projection dense (default: quantize it "
                             "too: it is read whole at every step)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="dense weights and activations (default bfloat16)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar while loading")


def _mesh(tp: int):
    import jax

    if tp < 1:
        raise UsageError(f"--tp must be >= 1, got {tp}")
    if tp == 1:
        return None
    devices = jax.devices()
    if tp > len(devices):
        raise UsageError(f"--tp {tp}: only {len(devices)} {devices[0].platform} devices")
    return jax.make_mesh((tp,), ("tp",), devices=devices[:tp])


def _load(args, mesh=None):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from kbit_jax import models

    t0 = time.perf_counter()
    model = models.load(args.model, bits=args.bits, codebook=args.codebook, dtype=getattr(jnp, args.dtype),
                        mesh=mesh, quantize_head=not args.dense_head, progress=not args.no_progress)
    state = nnx.state(model)
    jax.block_until_ready(state)
    nbytes = sum(x.nbytes for x in jax.tree.leaves(state))
    print(f"loaded {args.model}: {model.config.architecture}, {model.config.n_layers} layers, "
          f"{nbytes / GIB:.2f} GiB of weights{'' if mesh is None else f' over {mesh.size} devices'} "
          f"in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return model


def _tokenizer(model_dir):
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UsageError("the tokenizers package is needed: pip install 'kbit_jax[hf]'") from None
    file = os.path.join(model_dir, "tokenizer.json")
    if not os.path.exists(file):
        raise UsageError(f"{file} not found: the model directory needs its tokenizer.json")
    return Tokenizer.from_file(file)


def _eos_ids(model_dir) -> set[int]:
    """End-of-sequence token ids from generation_config.json, else config.json."""
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(model_dir, name)
        if os.path.exists(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            if eos is not None:
                return set(eos) if isinstance(eos, list) else {int(eos)}
    return set()


# -- generate --------------------------------------------------------------------------------------
def _sample(logits, key, temperature, top_p):
    """Next tokens [B] from logits [B, V]: softmax at ``temperature``, restricted to the smallest
    set of tokens whose probability reaches ``top_p`` (nucleus sampling)."""
    import jax
    import jax.numpy as jnp

    logits = logits.astype(jnp.float32) / temperature
    order = jnp.argsort(-logits, axis=-1)
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs              # probability of the tokens ahead
    sorted_logits = jnp.where(before < top_p, sorted_logits, -jnp.inf)   # keeps the top token
    choice = jax.random.categorical(key, sorted_logits, axis=-1)
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def _pick(logits, key, temperature, top_p, greedy: bool):
    import jax.numpy as jnp

    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return _sample(logits, key, temperature, top_p)


@functools.cache
def _steps():
    """The jitted prefill and one decode step, each ending in the next token's choice."""
    import jax
    from flax import nnx

    @functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("cache",))
    def prefill(graphdef, state, tokens, cache, key, temperature, top_p, greedy):
        model = nnx.merge(graphdef, state)
        logits, cache = model(tokens, cache, 0, last_only=True)
        return _pick(logits[:, -1], key, temperature, top_p, greedy), cache

    @functools.partial(jax.jit, static_argnames=("graphdef", "greedy"), donate_argnames=("cache",))
    def step(graphdef, state, token, cache, pos, key, temperature, top_p, greedy):
        model = nnx.merge(graphdef, state)
        logits, cache = model(token[:, None], cache, pos)
        return _pick(logits[:, 0], key, temperature, top_p, greedy), cache

    return prefill, step


class _Streamer:
    """Prints the text of a growing token list as it grows (whole characters only)."""

    def __init__(self, tokenizer, out):
        self.tokenizer, self.out, self.ids, self.shown = tokenizer, out, [], 0

    def add(self, token: int):
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):          # a multi-byte character not complete yet
            return
        self.out.write(text[self.shown:])
        self.out.flush()
        self.shown = len(text)

    def finish(self):
        """Print what is held back (bytes that never completed a character)."""
        self.out.write(self.tokenizer.decode(self.ids)[self.shown:] + "\n")
        self.out.flush()


def generate(argv) -> int:
    """Generate text from a prompt, streaming it to stdout; speed on stderr at the end."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    from kbit_jax.models import decoder

    parser = argparse.ArgumentParser(prog="python -m kbit_jax generate", description=generate.__doc__)
    _model_args(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 (default): greedy; > 0: sample at this temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel over the first N devices (MoE layers expert-parallel)")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        raise UsageError(f"--temperature must be >= 0 and --top-p in (0, 1]; got {args.temperature}, {args.top_p}")

    tokenizer = _tokenizer(args.model)
    eos = _eos_ids(args.model)
    ids = tokenizer.encode(args.prompt).ids
    if not ids:
        raise UsageError("--prompt encodes to no tokens")
    mesh = _mesh(args.tp)
    model = _load(args, mesh)
    cfg = model.config
    prefill, step = _steps()
    greedy = args.temperature == 0
    temperature, top_p = jnp.float32(max(args.temperature, 1e-6)), jnp.float32(args.top_p)
    graphdef, state = nnx.split(model)
    cache_dtype = model.embed.embedding.get_value().dtype
    t, max_len = len(ids), len(ids) + args.max_new_tokens
    sharding = model.cache_sharding()   # None without a mesh
    context = contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)
    key = jax.random.key(args.seed)
    with context:
        prompt = jnp.asarray(np.asarray([ids], np.int32))
        if mesh is not None:
            prompt = jax.device_put(prompt, NamedSharding(mesh, P()))

        def run_prefill():
            cache = decoder.init_cache(cfg, 1, max_len, cache_dtype, sharding=sharding)
            jax.block_until_ready(cache)
            t0 = time.perf_counter()
            token, cache = prefill(graphdef, state, prompt, cache, key, temperature, top_p, greedy)
            token = int(token[0])
            return token, cache, time.perf_counter() - t0

        compile_s = run_prefill()[2]                     # compiles; the timed run follows
        token, cache, prefill_s = run_prefill()
        sys.stdout.write(args.prompt)
        stream = _Streamer(tokenizer, sys.stdout)
        stream.add(token)
        decode_s, decoded, pos = 0.0, 0, t
        while token not in eos and pos < max_len - 1:
            t0 = time.perf_counter()
            out, cache = step(graphdef, state, jnp.asarray([token], jnp.int32), cache, pos,
                              jax.random.fold_in(key, pos), temperature, top_p, greedy)
            token = int(out[0])
            elapsed = time.perf_counter() - t0
            if pos > t:                                  # the first step compiled
                decode_s, decoded = decode_s + elapsed, decoded + 1
            else:
                compile_s += elapsed
            pos += 1
            stream.add(token)
    stream.finish()
    rate = f"{decoded / decode_s:.1f} tok/s" if decoded and decode_s > 0 else "n/a"
    print(f"{len(stream.ids)} new tokens; prefill: {t} tokens in {prefill_s * 1e3:.1f} ms "
          f"({t / prefill_s:.1f} tok/s); decode: {decoded} tokens in {decode_s:.2f} s ({rate}; "
          f"the first step compiles and is not counted); compile: {compile_s:.1f} s", file=sys.stderr)
    return 0


# -- perplexity ------------------------------------------------------------------------------------
@functools.cache
def _nll():
    import jax
    import jax.numpy as jnp
    from flax import nnx

    @functools.partial(jax.jit, static_argnames=("graphdef",))
    def nll(graphdef, state, tokens, scored):
        """Summed negative log-likelihood of tokens[:, 1:] where ``scored`` [B, T-1] is true."""
        logits = nnx.merge(graphdef, state)(tokens[:, :-1]).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        target = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return -jnp.sum(jnp.where(scored, target, 0.0))

    return nll


def windows(n: int, context: int, stride: int):
    """Sliding windows over ``n`` tokens, as ``(begin, end, first)``: the window holds tokens
    ``begin .. end-1`` (at most ``context``) and scores the predictions of tokens ``first ..
    end-1``. The first window scores every token after the first; each later one the next
    ``min(stride, context - 1)`` tokens, with the rest of the window before them as history.
    Every token but the first is scored exactly once."""
    end = min(context, n)
    out = [(0, end, 1)]
    while end < n:
        new_end = min(end + min(stride, context - 1), n)
        out.append((max(0, new_end - context), new_end, end))
        end = new_end
    return out


def perplexity(argv) -> int:
    """Perplexity of a model on a text file: exp(mean negative log-likelihood per token),
    sliding windows of --context tokens advancing by --stride."""
    import contextlib

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import NamedSharding, PartitionSpec as P

    parser = argparse.ArgumentParser(prog="python -m kbit_jax perplexity", description=perplexity.__doc__)
    _model_args(parser)
    parser.add_argument("--text", required=True, help="a UTF-8 text file")
    parser.add_argument("--context", type=int, default=1024, help="window length in tokens (default 1024)")
    parser.add_argument("--stride", type=int, default=512, help="window step in tokens (default 512)")
    parser.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel over the first N devices (MoE layers expert-parallel)")
    args = parser.parse_args(argv)
    if not 0 < args.stride <= args.context or args.context < 2:
        raise UsageError(f"need 0 < --stride <= --context and --context >= 2, got {args.stride}, {args.context}")
    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--text {args.text}: {e}") from None
    tokens = _tokenizer(args.model).encode(text).ids[:args.max_tokens]
    if len(tokens) < 2:
        raise UsageError(f"--text {args.text} has {len(tokens)} tokens; need at least 2")
    mesh = _mesh(args.tp)
    model = _load(args, mesh)
    graphdef, state = nnx.split(model)
    nll = _nll()
    context = min(args.context, len(tokens))
    total, count = 0.0, 0
    t0 = time.perf_counter()
    with contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh):
        for begin, end, first in windows(len(tokens), context, args.stride):
            window = np.zeros((1, context), np.int32)      # one shape: one compilation
            window[0, :end - begin] = tokens[begin:end]
            scored = np.zeros((1, context - 1), bool)      # target j + 1 of the window
            scored[0, first - begin - 1:end - begin - 1] = True
            window, scored = jnp.asarray(window), jnp.asarray(scored)
            if mesh is not None:
                window, scored = (jax.device_put(x, NamedSharding(mesh, P())) for x in (window, scored))
            total += float(nll(graphdef, state, window, scored))
            count += end - first
    ppl = math.exp(total / count)
    bits = "dense" if args.bits is None else f"{args.bits} bits"
    print(f"perplexity {ppl:.4f} over {count} tokens ({args.model}, {bits}, window {context}, "
          f"stride {args.stride}; {time.perf_counter() - t0:.1f} s)")
    return 0


# -- quantize --------------------------------------------------------------------------------------
def quantize(argv) -> int:
    """Quantize a Hugging Face directory and save it with its tokenizer files; `generate`,
    `perplexity` and ``kbit_jax.models.load`` read the result without quantizing again."""
    from kbit_jax import models
    from kbit_jax.models import loader

    parser = argparse.ArgumentParser(prog="python -m kbit_jax quantize", description=quantize.__doc__)
    _model_args(parser, bits_required=True)
    parser.add_argument("--out", required=True, help="the directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    args = parser.parse_args(argv)
    if loader.is_saved_model(args.model):
        raise UsageError(f"{args.model} is already quantized; quantize the original checkpoint")
    model = _load(args)
    path = models.save(model, args.out, overwrite=args.overwrite)
    copied = loader.copy_side_files(args.model, path)
    print(f"saved {path} ({', '.join(copied) or 'no tokenizer files'} copied)", file=sys.stderr)
    return 0


# -- dispatch --------------------------------------------------------------------------------------
def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] not in COMMANDS:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(__doc__.strip(), file=sys.stdout if asked else sys.stderr)
        return 0 if asked else 2
    command = {"demo": demo, "generate": generate, "perplexity": perplexity, "quantize": quantize}[argv[0]]
    try:
        return command(argv[1:])
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, TypeError, NotImplementedError) as e:    # a bad checkpoint or option
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
