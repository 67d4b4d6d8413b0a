"""``python -m kbit_jax`` end to end, each command in a subprocess: a tiny random Llama checkpoint
(safetensors from NumPy) with a byte-level BPE tokenizer trained here (``tokenizers``)."""

import math
import os
import re
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("safetensors")
tokenizers = pytest.importorskip("tokenizers")

from test_models import LLAMA, random_tensors, write_checkpoint  # noqa: E402

import kbit_jax.flax as kflax  # noqa: E402
from kbit_jax import models  # noqa: E402
from kbit_jax.cli import windows  # noqa: E402

TEXT = ("the quick brown fox jumps over the lazy dog. a stitch in time saves nine. "
        "héllo wörld, ünïcode text in a tiny corpus. ") * 8
HF = {**LLAMA, "vocab_size": 320, "eos_token_id": None}   # no early stop: every run makes its tokens


def tokenizer(path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=HF["vocab_size"], special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([TEXT], trainer)
    assert tok.get_vocab_size() <= HF["vocab_size"]
    tok.save(os.path.join(path, "tokenizer.json"))
    return tok


@pytest.fixture
def checkpoint(tmp_path, rng):
    path = write_checkpoint(tmp_path / "llama", HF, random_tensors(HF, rng))
    tokenizer(path)
    return path


def run(*args, devices=1):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    return subprocess.run([sys.executable, "-m", "kbit_jax", *args], capture_output=True, text=True,
                          env=env, timeout=600)


def test_generate_quantize_perplexity(checkpoint, tmp_path):
    prompt = "the quick brown"
    greedy = run("generate", "--model", checkpoint, "--bits", "4", "--prompt", prompt,
                 "--max-new-tokens", "6", "--dtype", "float32", "--no-progress")
    assert greedy.returncode == 0, greedy.stderr
    assert greedy.stdout.startswith(prompt) and len(greedy.stdout) > len(prompt) + 1
    assert "6 new tokens" in greedy.stderr
    assert re.search(r"prefill: \d+ tokens in .* tok/s\); decode: \d+ tokens", greedy.stderr)
    # the same greedy text from the saved quantized model, tensor-parallel over 2 devices
    out = tmp_path / "llama-k4"
    saved = run("quantize", "--model", checkpoint, "--bits", "4", "--out", str(out), "--dtype", "float32",
                "--no-progress")
    assert saved.returncode == 0, saved.stderr
    assert "tokenizer.json" in saved.stderr and (out / "tokenizer.json").exists()
    again = run("generate", "--model", str(out), "--prompt", prompt, "--max-new-tokens", "6",
                "--tp", "2", "--dtype", "float32", devices=2)
    assert again.returncode == 0, again.stderr
    assert again.stdout == greedy.stdout
    sampled = run("generate", "--model", str(out), "--prompt", prompt, "--max-new-tokens", "6",
                  "--temperature", "0.8", "--top-p", "0.9", "--seed", "3")
    assert sampled.returncode == 0, sampled.stderr
    assert sampled.stdout.startswith(prompt)

    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    ppl = run("perplexity", "--model", checkpoint, "--bits", "4", "--text", str(text),
              "--context", "32", "--stride", "16", "--no-progress")
    assert ppl.returncode == 0, ppl.stderr
    n = len(tokenizers.Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json")).encode(TEXT).ids)
    line = ppl.stdout.strip().splitlines()[-1]
    assert f"over {n - 1} tokens" in line
    value = float(line.split()[1])
    # a random model on a 320-token vocabulary: near-uniform predictions
    assert math.isfinite(value) and 30 < value < 3000

    # one window over the whole text: exp(mean NLL) of the model's own logits
    whole = run("perplexity", "--model", checkpoint, "--text", str(text), "--context", str(n),
                "--stride", str(n), "--dtype", "float32", "--no-progress")
    assert whole.returncode == 0, whole.stderr
    ids = tokenizers.Tokenizer.from_file(os.path.join(checkpoint, "tokenizer.json")).encode(TEXT).ids
    logits = np.asarray(models.load(checkpoint, dtype=jnp.float32, progress=False)(np.asarray([ids], np.int32)),
                        np.float64)[0, :-1]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - logits.max(-1, keepdims=True)
    want = math.exp(-np.mean(logp[np.arange(n - 1), ids[1:]]))
    got = float(whole.stdout.strip().splitlines()[-1].split()[1])
    assert abs(got - want) <= 1e-4 * want


def test_quantize_head_flag(checkpoint, tmp_path):
    """`quantize --bits` quantizes the output projection with the layers (the saved model loads
    it back as a KbitLinear); --dense-head keeps it dense."""
    for flags, head in (([], kflax.KbitLinear), (["--dense-head"], nnx.Linear)):
        out = tmp_path / ("dense-head" if flags else "k4")
        saved = run("quantize", "--model", checkpoint, "--bits", "4", "--out", str(out), "--no-progress", *flags)
        assert saved.returncode == 0, saved.stderr
        model = models.load(out, progress=False)
        assert type(model.lm_head) is head
        assert isinstance(model.layers[0].mlp.down_proj, kflax.KbitLinear)


def test_cli_errors(checkpoint, tmp_path):
    usage = run()
    assert usage.returncode == 2 and "generate" in usage.stderr
    bad = run("generate", "--model", str(tmp_path / "nowhere"), "--prompt", "x")
    assert bad.returncode == 2 and "tokenizer.json not found" in bad.stderr
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "tokenizer.json").write_text(open(os.path.join(checkpoint, "tokenizer.json")).read())
    bad = run("generate", "--model", str(tmp_path / "bad"), "--prompt", "x")
    assert bad.returncode == 1 and "config.json not found" in bad.stderr and "Traceback" not in bad.stderr
    bits = run("generate", "--model", checkpoint, "--prompt", "x", "--bits", "9")
    assert bits.returncode == 1 and "bits" in bits.stderr and "Traceback" not in bits.stderr
    tp = run("generate", "--model", checkpoint, "--prompt", "x", "--tp", "4")
    assert tp.returncode == 2 and "--tp 4: only 1" in tp.stderr
    missing = run("perplexity", "--model", checkpoint, "--text", str(tmp_path / "none.txt"))
    assert missing.returncode == 2 and "none.txt" in missing.stderr


@pytest.mark.parametrize("n, context, stride", [(2, 4, 2), (10, 4, 2), (10, 4, 4), (11, 4, 3),
                                                (100, 16, 5), (7, 7, 7), (50, 10, 1), (9, 2, 2)])
def test_windows_score_each_token_once(n, context, stride):
    scored = np.zeros(n, int)
    for begin, end, first in windows(n, context, stride):
        assert 0 <= begin < first <= end <= n and end - begin <= context
        scored[first:end] += 1
    np.testing.assert_array_equal(scored[1:], 1)
    assert scored[0] == 0
