"""A model loaded from a Hugging Face directory decodes as fast as the random-weight model of the
same shape: greedy decode tokens/s of ``kbit_jax.models.load(dir, bits=K)`` against
``decoder.build_model(cfg, bits=K)`` (what bench_decode.py measures), timed the same way in one
process: prefill the prompt (jitted), then ``new_tokens - 1`` greedy steps in one jitted
``fori_loop``; median of ``--reps`` after a warm-up (compile) run.

The Hugging Face directory is made first if ``--dir`` has no config.json: transformers builds
the config's model with random weights (bf16, on the GPU when torch has one) and
``save_pretrained`` writes it (safetensors shards + index), in a subprocess so that torch's
memory is gone before JAX starts. Later runs reuse the directory.

Llama-3-8B shape at K=4 on one H200 (the first run writes ~16 GB to --dir):
    python benchmarks/bench_load.py --config llama3-8b --bits 4 --dir /tmp/llama3-8b-hf
CPU smoke test:
    python benchmarks/bench_load.py --config tiny --bits 4 --dir /tmp/tiny-hf --prompt 16 \\
        --new-tokens 8 --reps 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2.0 ** 30


def hf_config(cfg) -> dict:
    """transformers' LlamaConfig arguments for a decoder config (Llama-3 layout, untied)."""
    return dict(vocab_size=cfg.vocab_size, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
                num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
                num_key_value_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=cfg.norm_eps,
                rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_embeddings,
                max_position_embeddings=8192)


def write_checkpoint(path: str, config: dict) -> None:
    """Runs in a subprocess: a random bf16 LlamaForCausalLM of ``config``, saved to ``path``."""
    import torch
    import transformers

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.set_default_dtype(torch.bfloat16)
    hf = transformers.LlamaConfig(**config)
    with torch.device(device), torch.no_grad():
        model = transformers.LlamaForCausalLM(hf).eval()
        for p in model.parameters():       # transformers' init leaves the norms at 1
            p.normal_(1.0 if p.ndim == 1 else 0.0, 0.02)
    model.save_pretrained(path, max_shard_size="5GB")


def ensure_checkpoint(path: str, cfg) -> float:
    """Seconds spent writing the checkpoint (0 when ``path`` already holds one)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return 0.0
    t0 = time.perf_counter()
    subprocess.run([sys.executable, os.path.abspath(__file__), "--write-checkpoint", path,
                    json.dumps(hf_config(cfg))], check=True)
    return time.perf_counter() - t0


def time_decode(model, batch: int, prompt_len: int, new_tokens: int, reps: int):
    """(decode tok/s, prefill ms, compile s, the first row's tokens) of greedy decoding."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from kbit_jax.models import decoder

    cfg = model.config
    graphdef, state = nnx.split(model)
    prompt = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (batch, prompt_len)),
                         jnp.int32)
    steps = new_tokens - 1

    def once():
        cache = decoder.init_cache(cfg, batch, prompt_len + new_tokens, jnp.bfloat16)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        logits, cache = decoder.prefill(graphdef, state, prompt, cache)
        first = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        first.block_until_ready()
        t1 = time.perf_counter()
        out, cache = decoder.decode(graphdef, state, first, cache, prompt_len, steps)
        out.block_until_ready()
        return t1 - t0, time.perf_counter() - t1, np.asarray(out)

    t0 = time.perf_counter()
    once()
    compile_s = time.perf_counter() - t0
    times = [once() for _ in range(reps)]
    decode_s = statistics.median(t[1] for t in times)
    prefill_s = statistics.median(t[0] for t in times)
    return batch * steps / decode_s, 1e3 * prefill_s, compile_s, times[0][2][0, :8].tolist()


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--write-checkpoint"]:
        write_checkpoint(argv[1], json.loads(argv[2]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="llama3-8b", help="tiny, tiny-tp, llama3-8b or llama3-70b")
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--dir", required=True, help="the Hugging Face directory (made when missing)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dense-head", action="store_true",
                   help="keep the output projection bf16 (default: quantized with the layers)")
    args = p.parse_args(argv)
    sys.path.insert(0, ROOT)

    from kbit_jax.models import config as mconfig

    cfg = mconfig.CONFIGS[args.config]
    write_s = ensure_checkpoint(args.dir, cfg)

    import jax
    from flax import nnx

    from kbit_jax import models
    from kbit_jax.models import decoder

    device = jax.devices()[0]
    print(f"{args.config} K={args.bits} (lm_head {'bf16' if args.dense_head else 'quantized'}) batch {args.batch}, prompt {args.prompt}, {args.new_tokens} new "
          f"tokens, median of {args.reps}; {device.device_kind}; checkpoint {args.dir}"
          + (f" (written in {write_s:.0f} s)" if write_s else " (reused)"), flush=True)
    rows = {}
    for name in ("loaded", "random"):
        t0 = time.perf_counter()
        if name == "loaded":
            model = models.load(args.dir, bits=args.bits, quantize_head=not args.dense_head)
            if model.config != cfg:
                raise SystemExit(f"{args.dir} holds {model.config}, not {args.config}")
        else:
            model, _ = decoder.build_model(cfg, bits=args.bits, quantize_head=not args.dense_head)
        jax.block_until_ready(nnx.state(model))
        build_s = time.perf_counter() - t0
        gib = sum(x.nbytes for x in jax.tree.leaves(nnx.state(model))) / GIB
        tok_s, prefill_ms, compile_s, tokens = time_decode(model, args.batch, args.prompt,
                                                           args.new_tokens, args.reps)
        rows[name] = tok_s
        label = "models.load (HF safetensors)" if name == "loaded" else "decoder.build_model (random)"
        print(f"{label:>30}: decode {tok_s:8.1f} tok/s, prefill {prefill_ms:7.1f} ms, model {gib:.2f} GiB, "
              f"{'load' if name == 'loaded' else 'build'} {build_s:.1f} s, compile {compile_s:.1f} s, "
              f"tokens {tokens}", flush=True)
        del model
    print(f"loaded / random decode tokens/s: {rows['loaded'] / rows['random']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
