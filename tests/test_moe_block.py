"""kbit_jax.flax.moe: the dense MoE block and KbitMoE built from it, against the dense block
run on the dequantized experts; routing, shared expert, jit, sharded jit, Orbax round trip."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, PartitionSpec as P  # noqa: E402

import kbit_jax as kj  # noqa: E402
from kbit_jax import sharding as ks  # noqa: E402
from kbit_jax.flax import KbitLinear, restore_checkpoint, save_checkpoint  # noqa: E402
from kbit_jax.flax.moe import KbitMoE, MoE, route  # noqa: E402


def seed(rng):
    return int(rng.integers(2**31))


def dense_twin(q: KbitMoE, moe: MoE) -> MoE:
    """``moe`` with its experts (and shared expert) replaced by q's dequantized weights: the
    float block q must match up to rounding."""
    twin = nnx.clone(moe)
    gate_up, down = (kj.dequantize(w) for w in q.weights)
    twin.gate[...] = gate_up[..., 0::2]
    twin.up[...] = gate_up[..., 1::2]
    twin.down[...] = down
    if q.shared_gate_up is not None:
        shared = q.shared_gate_up.dequantized_kernel(jnp.float32)
        twin.shared_gate.kernel[...] = shared[:, 0::2]
        twin.shared_up.kernel[...] = shared[:, 1::2]
        twin.shared_down.kernel[...] = q.shared_down.dequantized_kernel(jnp.float32)
    return twin


def assert_close(y, ref, rel):
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(y, ref, atol=rel * np.abs(ref).max(), rtol=0)


@pytest.mark.parametrize("shared", [None, 64], ids=["routed_only", "shared_expert"])
@pytest.mark.parametrize("norm", [True, False], ids=["renormalized", "softmax_weights"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_kbit_moe_matches_dense_on_dequantized_experts(rng, shared, norm, activation):
    moe = MoE(64, 32, 8, 2, norm_topk_prob=norm, activation=activation, shared_intermediate=shared,
              rngs=nnx.Rngs(seed(rng)))
    x = jnp.asarray(rng.standard_normal((3, 7, 64)), jnp.float32)
    q = KbitMoE.from_dense(moe, bits=4)
    twin = dense_twin(q, moe)
    y = q(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert_close(y, twin(x), 2e-5)
    assert_close(nnx.jit(lambda m, x: m(x))(q, x), twin(x), 2e-5)
    # Quantization error shrinks with bits: 5 bits is closer to the float block than 2.
    err = {b: float(jnp.abs(KbitMoE.from_dense(moe, bits=b)(x) - moe(x)).mean()) for b in (2, 5)}
    assert err[5] < err[2], err


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_bits_and_bf16(rng, bits):
    moe = MoE(96, 64, 6, 3, dtype=jnp.bfloat16, rngs=nnx.Rngs(seed(rng)))
    x = jnp.asarray(rng.standard_normal((9, 96)), jnp.bfloat16)
    q = KbitMoE.from_dense(moe, bits=bits)
    y = q(x)
    assert y.dtype == jnp.bfloat16 and y.shape == (9, 96)
    assert_close(y, dense_twin(q, moe)(x), 3e-2)      # bf16 rounding of h and of the products


def test_route(rng):
    logits = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
    w, ids = route(logits, 3, normalize=False)
    p = np.asarray(jax.nn.softmax(logits))
    want_ids = np.argsort(-p, axis=1)[:, :3]
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    np.testing.assert_allclose(np.asarray(w), np.take_along_axis(p, want_ids, 1), rtol=1e-6)
    w, _ = route(logits, 3, normalize=True)
    np.testing.assert_allclose(np.asarray(w).sum(1), 1.0, rtol=1e-6)


def test_only_routed_experts_contribute(rng):
    """Experts no token chose may hold anything (NaN here): the result stays finite."""
    moe = MoE(64, 32, 8, 1, rngs=nnx.Rngs(seed(rng)))
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    q = KbitMoE.from_dense(moe)
    _, ids = route(q.router(x), 1, True)
    unused = sorted(set(range(8)) - set(np.asarray(ids).ravel().tolist()))
    q.down.tensor_scale[...] = q.down.tensor_scale[...].at[jnp.asarray(unused)].set(jnp.nan)
    assert np.isfinite(np.asarray(q(x))).all()


def test_orbax_round_trip_exact(rng, tmp_path):
    moe = MoE(64, 32, 4, 2, shared_intermediate=32, rngs=nnx.Rngs(seed(rng)))
    q = KbitMoE.from_dense(moe, bits=3)
    path = save_checkpoint(tmp_path / "moe", q)
    other = KbitMoE.from_dense(MoE(64, 32, 4, 2, shared_intermediate=32, rngs=nnx.Rngs(seed(rng) + 1)), bits=3)
    restored = restore_checkpoint(path, other)
    for a, b in zip(jax.tree.leaves(nnx.state(q)), jax.tree.leaves(nnx.state(restored))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(q(x)), np.asarray(restored(x)))


def test_bad_configs(rng):
    rngs = nnx.Rngs(0)
    with pytest.raises(ValueError, match="top_k must be at most num_experts=4"):
        MoE(64, 32, 4, 5, rngs=rngs)
    with pytest.raises(ValueError, match="activation must be one of"):
        MoE(64, 32, 4, 2, activation="relu", rngs=rngs)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        MoE(64, 32, 0, 1, rngs=rngs)
    with pytest.raises(ValueError, match="intermediate=48 is not a multiple of 32"):
        KbitMoE.from_dense(MoE(64, 48, 4, 2, rngs=rngs))
    with pytest.raises(TypeError, match="moe must be a kbit_jax.flax.moe.MoE"):
        KbitMoE.from_dense(nnx.Linear(64, 64, rngs=rngs))
    q = KbitMoE.from_dense(MoE(64, 32, 4, 2, rngs=rngs))
    with pytest.raises(ValueError, match=r"x must have shape \[..., 64\]"):
        q(jnp.zeros((3, 32)))
    gate_up, down = q.weights
    with pytest.raises(ValueError, match="down must have shape"):
        KbitMoE(q.router, gate_up, gate_up, top_k=2)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (simulated) devices")
def test_expert_parallel_jit_never_gathers_experts(rng):
    """Experts sharded over 8 devices through the leaves' out_sharding: sharded jit of the block
    gathers no weight leaf (only activations move)."""
    moe = MoE(64, 64, 16, 2, rngs=nnx.Rngs(seed(rng)))
    x = jnp.asarray(rng.standard_normal((12, 64)), jnp.float32)
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(AxisType.Auto,))
    want = KbitMoE.from_dense(moe)(x)
    with jax.set_mesh(mesh):      # flax places annotated variables at creation
        q = KbitMoE.from_dense(moe, expert_sharding=("expert", None, None))
        assert q.gate_up.planes[...].sharding.spec == P("expert", None, None, None)
        graphdef, state = nnx.split(q)
        f = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
        y = f(state, x)
        text = f.lower(state, x).compile().as_text()
    assert_close(y, want, 1e-5)
    gathered = ks.all_gather_shapes(text)
    assert not any(s.startswith(("u32", "u8")) for s in gathered), gathered


class _Model(nnx.Module):
    def __init__(self, rngs):
        self.proj = nnx.Linear(64, 64, use_bias=False, rngs=rngs)
        self.blocks = nnx.List([MoE(64, 32, 4, 2, shared_intermediate=32, rngs=rngs),
                                MoE(64, 40, 4, 2, rngs=rngs)])

    def __call__(self, x):
        x = self.proj(x)
        for block in self.blocks:
            x = x + block(x)
        return x


def test_quantize_model_picks_up_moe_blocks(rng):
    from kbit_jax.flax import quantize_model

    model = _Model(nnx.Rngs(seed(rng)))
    first = model.blocks[0]
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    report = quantize_model(model, bits=4, progress=False)
    assert isinstance(model.blocks[0], KbitMoE) and isinstance(model.blocks[1], MoE)
    assert isinstance(model.blocks[0].router, nnx.Linear)           # the router stays dense
    assert isinstance(model.proj, KbitLinear)
    assert sorted(report.replaced) == ["blocks/0", "proj"], report.replaced
    assert [p for p, _ in report.skipped] == ["blocks/1"], report.skipped   # H = 40: not whole blocks
    assert report.bytes_after < report.bytes_before
    # The converted block computes what KbitMoE.from_dense of the original computes.
    np.testing.assert_array_equal(np.asarray(model.blocks[0](x)),
                                  np.asarray(KbitMoE.from_dense(first, bits=4)(x)))
    assert np.isfinite(np.asarray(model(x))).all()
