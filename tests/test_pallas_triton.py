"""Without Pallas's Triton backend (deprecated by JAX; `kbit_jax.pallas_triton`): the package
imports, each Pallas kernel's ``supported`` gives the reason, an explicit request for a kernel
raises ValueError with it, and the decoder's "auto" modes run their XLA paths. Each case runs
in a subprocess whose ``sys.modules`` hides ``jax.experimental.pallas.triton``, as a JAX
without it would."""

import os
import subprocess
import sys
import textwrap

HIDE_TRITON = 'import sys; sys.modules["jax.experimental.pallas.triton"] = None\n'


def run_without_triton(code: str, platform: str) -> str:
    env = dict(os.environ, JAX_PLATFORMS="cuda" if platform == "gpu" else "cpu",
               XLA_PYTHON_CLIENT_PREALLOCATE="false")   # beside the test process's own GPU client
    result = subprocess.run([sys.executable, "-c", HIDE_TRITON + textwrap.dedent(code)],
                            capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    return result.stdout


def test_kernels_say_why_and_explicit_requests_raise():
    out = run_without_triton("""
        import numpy as np, jax.numpy as jnp, pytest
        import kbit_jax, kbit_jax.flax, kbit_jax.models
        from kbit_jax import pallas_triton
        from kbit_jax.examples import decode_attention, fused_norm
        from kbit_jax.flax import routing, routing_kernel
        why = pallas_triton.MISSING
        assert pallas_triton.plt is None and "no Pallas Triton backend" in why, why
        assert fused_norm.supported((4, 64)) == why
        assert decode_attention.supported((1, 2, 4, 64), (1, 16, 2, 64)) == why
        assert decode_attention.supported_step((1, 2, 6, 64), (1, 16, 2, 64)) == why
        assert routing_kernel.supported(4, 8, 2) == why
        x = jnp.ones((4, 64), jnp.bfloat16)
        with pytest.raises(ValueError, match="add_rms_norm: this JAX has no Pallas Triton"):
            fused_norm.add_rms_norm(x, x, jnp.ones((64,)), 1e-6)
        q, cache = jnp.ones((1, 2, 4, 64)), jnp.ones((1, 16, 2, 64))
        with pytest.raises(ValueError, match="decode_attention: this JAX has no Pallas Triton"):
            decode_attention.decode_attention(q, cache, cache, 3)
        logits = jnp.asarray(np.random.default_rng().standard_normal((4, 8)), jnp.float32)
        with pytest.raises(ValueError, match="this JAX has no Pallas Triton"):
            routing.route_sorted(logits, 2, True, method="kernel")
        auto = routing.route_sorted(logits, 2, True)
        sort = routing.route_sorted(logits, 2, True, method="sort")
        for a, b in zip(auto, sort):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        print("checked")
    """, "cpu")
    assert "checked" in out


def test_decoder_auto_modes_take_xla(device):
    out = run_without_triton("""
        import jax, jax.numpy as jnp, numpy as np, pytest
        from flax import nnx
        from kbit_jax.models import config, decoder
        cfg = config.TINY_MOE
        prompt = np.random.default_rng().integers(0, cfg.vocab_size, (2, 5)).astype(np.int32)
        auto, _ = decoder.build_model(cfg, bits=4)
        xla, _ = decoder.build_model(cfg, bits=4, attention="xla", norm="xla")
        graphdef, state = nnx.split(auto)
        hlo = decoder.decode_step.lower(graphdef, state, jnp.zeros((2,), jnp.int32),
                                        decoder.init_cache(cfg, 2, 16), 3).as_text()
        assert "triton" not in hlo.lower()   # no Pallas kernel (each is a Triton custom call)
        np.testing.assert_array_equal(decoder.generate(auto, prompt, 4), decoder.generate(xla, prompt, 4))
        for flag in ("norm", "attention"):
            model, _ = decoder.build_model(cfg, bits=4, **{flag: "pallas"})
            with pytest.raises(ValueError, match=f"{flag}='pallas': this JAX has no Pallas Triton"):
                decoder.generate(model, prompt, 2)
        print("checked on", jax.default_backend())
    """, device.platform)
    assert "checked on" in out
