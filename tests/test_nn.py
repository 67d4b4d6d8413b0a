"""Flax integration: NNX KbitLinear, quantize_model, the Llama example, Orbax, Linen KbitDense."""

import math
from typing import Any

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import kbit_jax as kj
from kbit_jax import nn as knn
from kbit_jax.examples import llama

#: SQNR (dB) of the NF codebook with E4M4 scales on Gaussian weights (docs/format.md).
SQNR_DB = {2: 7.42, 3: 14.99, 4: 21.09, 5: 25.95}


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def np_init(rng, scale=None):
    """An initializer drawing from numpy: no XLA compilation per shape (keeps the file fast)."""
    def init(key, shape, dtype=jnp.float32):
        std = scale if scale is not None else 1 / math.sqrt(shape[-2] if len(shape) > 1 else 1)
        return jnp.asarray(rng.standard_normal(shape) * std, dtype)
    return init


def numpy_llama(cfg, seed):
    """The example decoder in float32 with numpy-drawn weights (shapes from an abstract model)."""
    rng = np.random.default_rng(seed)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: llama.build_model(cfg, param_dtype=jnp.float32)[0]))

    def draw(path, x):
        where = jax.tree_util.keystr(path)
        if "scale" in where:                                   # RMSNorm
            return jnp.ones(x.shape, x.dtype)
        std = 1.0 if "embed" in where else 1 / math.sqrt(x.shape[0])
        return jnp.asarray(rng.standard_normal(x.shape) * std, x.dtype)

    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, abstract))


def dense_twin(layer: knn.KbitLinear) -> nnx.Linear:
    """An nnx.Linear holding the layer's exactly dequantized kernel and its bias."""
    lin = nnx.Linear(layer.in_features, layer.out_features, use_bias=layer.use_bias,
                     dtype=layer.dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0),
                     kernel_init=nnx.initializers.zeros_init())
    lin.kernel.set_value(layer.dequantized_kernel(jnp.float32))
    if layer.use_bias:
        lin.bias.set_value(layer.bias.get_value())
    return lin


# -- KbitLinear -------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,use_bias", [(2, True), (4, False), (5, True)])
def test_kbit_linear_equals_dense_linear_with_dequantized_weight(rng, bits, use_bias):
    layer = knn.KbitLinear(96, 40, use_bias=use_bias, bits=bits, rngs=nnx.Rngs(0),
                           kernel_init=np_init(rng), bias_init=np_init(rng, 1.0))
    x = jnp.asarray(rng.standard_normal((3, 5, 96)), jnp.float32)
    y, y_ref = layer(x), dense_twin(layer)(x)
    assert y.shape == (3, 5, 40) and y.dtype == jnp.float32
    # Same exact weight, both accumulate in float32: only summation-order rounding differs.
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(y_ref).max()))

    state = nnx.state(layer)
    assert isinstance(layer.kernel, kj.KbitWeight) and layer.kernel.bits == bits
    assert all(isinstance(v, knn.QuantizedWeight) for v in jax.tree.leaves(
        layer.kernel, is_leaf=lambda v: isinstance(v, nnx.Variable)))
    assert set(nnx.state(layer, knn.QuantizedWeight)["kernel"].keys()) == {
        "planes", "scales", "codebook", "tensor_scale"}
    assert ("bias" in nnx.state(layer, nnx.Param)) == use_bias
    assert state["kernel"]["planes"].get_value().dtype == jnp.uint32


@pytest.mark.parametrize("use_bias", [False, True])
def test_kbit_linear_glu(rng, use_bias):
    """layer(x, glu=...) is act(y[..., 0::2]) * y[..., 1::2] of the layer's output (bias added
    before the gate): in the kernel without a bias, in JAX with one."""
    layer = knn.KbitLinear(96, 40, use_bias=use_bias, rngs=nnx.Rngs(0), kernel_init=np_init(rng),
                           bias_init=np_init(rng, 1.0))
    x = jnp.asarray(rng.standard_normal((3, 96)), jnp.float32)
    y_dense = np.asarray(dense_twin(layer)(x), np.float64)
    for glu in ("silu", "gelu_tanh"):
        y = layer(x, glu=glu)
        assert y.shape == (3, 20)
        ref = kj.reference.apply_glu(jnp.asarray(y_dense, jnp.float32), glu)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
    with pytest.raises(ValueError, match="glu must be None"):
        layer(x, glu="swish")


def test_kbit_linear_dtype_promotion_like_nnx_linear(rng):
    layer = knn.KbitLinear(64, 32, rngs=nnx.Rngs(0), kernel_init=np_init(rng), bias_init=np_init(rng, 1.0))
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.bfloat16)
    # dtype=None promotes input, param_dtype and bias, as nnx.Linear does: bf16 x f32 -> f32.
    ref = dense_twin(layer)
    assert layer(x).dtype == ref(x).dtype == jnp.float32
    np.testing.assert_allclose(layer(x), ref(x), rtol=1e-5, atol=1e-5)
    # An explicit dtype is the computation dtype.
    layer16 = knn.KbitLinear(64, 32, dtype=jnp.bfloat16, rngs=nnx.Rngs(0), kernel_init=np_init(rng))
    y = layer16(x.astype(jnp.float32))
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, dense_twin(layer16)(x.astype(jnp.float32)).astype(jnp.float32)) < 2e-2
    # bf16 params (no bias): bf16 in, bf16 out.
    layer_bf = knn.KbitLinear(64, 32, use_bias=False, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0),
                              kernel_init=np_init(rng))
    assert layer_bf(x).dtype == jnp.bfloat16


def test_from_linear(rng):
    lin = nnx.Linear(64, 48, rngs=nnx.Rngs(3), kernel_init=np_init(rng), bias_init=np_init(rng, 1.0))
    q = knn.KbitLinear.from_linear(lin, bits=3, codebook="lloyd_max")
    w_q = kj.quantize(lin.kernel.get_value(), 3, "lloyd_max")
    for a, b in zip(jax.tree.leaves(q.weight), jax.tree.leaves(w_q)):
        np.testing.assert_array_equal(a, b)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)
    np.testing.assert_array_equal(q(x), kj.matmul(x, w_q) + lin.bias.get_value())
    # Dense accuracy: within the 3-bit Lloyd-Max error of the dense layer.
    assert rel_err(q(x) - lin.bias.get_value(), x @ lin.kernel.get_value()) < 3 * 10 ** (-15.4 / 20)
    # The bias is copied, not shared.
    assert q.bias is not lin.bias
    np.testing.assert_array_equal(q.bias.get_value(), lin.bias.get_value())
    assert (q.in_features, q.out_features, q.bits, q.dtype, q.param_dtype) == (64, 48, 3, None, jnp.float32)

    # A stacked nnx.Linear (from nnx.vmap) becomes a stacked KbitLinear.
    stacked = nnx.vmap(lambda k: nnx.Linear(64, 64, rngs=nnx.Rngs(k), kernel_init=nnx.initializers.normal(0.1)))(
        jax.random.split(jax.random.key(0), 3))
    qs = knn.KbitLinear.from_linear(stacked, bits=4)
    assert qs.weight.batch_shape == (3,) and qs.bias.get_value().shape == (3, 64)


def test_bad_configs_raise():
    zeros = nnx.initializers.zeros_init()
    with pytest.raises(ValueError, match="in_features"):
        knn.KbitLinear(48, 32, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="out_features"):
        knn.KbitLinear(64, 0, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="codebook"):
        knn.KbitLinear(64, 32, codebook="nf7", rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="codebook"):
        knn.KbitLinear(64, 32, bits=3, codebook=np.linspace(-1, 1, 16), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="bits"):
        knn.KbitLinear(64, 32, bits=6, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features"):
        knn.KbitLinear.from_linear(nnx.Linear(40, 32, rngs=nnx.Rngs(0), kernel_init=zeros))
    with pytest.raises(ValueError, match="codebook"):
        knn.quantize_model(nnx.Linear(64, 32, rngs=nnx.Rngs(0), kernel_init=zeros), codebook="bogus")
    with pytest.raises(ValueError, match="in_features"):
        linen.Sequential([knn.KbitDense(8)]).init(jax.random.key(0), jnp.ones((1, 20)))


def test_sharding_metadata(rng):
    init = np_init(rng)
    n = len(jax.devices())
    shape = (2, 4) if n >= 8 else (1, 1)
    mesh = jax.make_mesh(shape, ("a", "b"), devices=jax.devices()[:math.prod(shape)],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    expected = {"planes": ("a", "b", None), "scales": ("a", "b"), "codebook": (None,), "tensor_scale": ()}
    P = jax.sharding.PartitionSpec
    with jax.set_mesh(mesh):
        layers = [
            knn.KbitLinear(64, 64, sharding=("a", "b"), kernel_init=init, rngs=nnx.Rngs(0)),
            knn.KbitLinear(64, 64, kernel_metadata={"out_sharding": ("a", "b")}, kernel_init=init,
                           rngs=nnx.Rngs(0)),
            knn.KbitLinear(64, 64, kernel_init=nnx.with_partitioning(init, ("a", "b")), rngs=nnx.Rngs(0)),
            knn.KbitLinear.from_linear(nnx.Linear(64, 64, kernel_metadata={"out_sharding": ("a", "b")},
                                                  kernel_init=init, rngs=nnx.Rngs(0))),
        ]
    for layer in layers:
        specs = nnx.get_partition_spec(nnx.state(layer))
        for name, names in expected.items():
            var = getattr(layer.kernel, name)
            assert var.get_metadata()["out_sharding"] == names
            assert specs["kernel"][name].get_value() == P(*names)
            # Created under the mesh: placed eagerly, like an annotated nnx.Linear kernel.
            assert var.get_value().sharding.spec == P(*names)
        assert layers[0].weight.planes.shape == layer.weight.planes.shape
    # Logical names with a stacked-layer axis in front.
    assert knn.leaf_sharding(("layers", "embed", "mlp"))["tensor_scale"] == ("layers",)


# -- NNX transforms -------------------------------------------------------------------------------
def test_split_merge_jit_grad(rng):
    layer = knn.KbitLinear(64, 32, rngs=nnx.Rngs(1), kernel_init=np_init(rng), bias_init=np_init(rng, 1.0))
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    graphdef, state = nnx.split(layer)
    np.testing.assert_array_equal(nnx.merge(graphdef, state)(x), layer(x))
    np.testing.assert_allclose(nnx.jit(lambda m, x: m(x))(layer, x), layer(x), rtol=1e-6, atol=1e-6)
    # Only the bias is a Param; gradients flow to it and to the input through the kernel.
    grads = nnx.grad(lambda m: jnp.sum(m(x) ** 2))(layer)
    assert set(grads.keys()) == {"bias"}
    np.testing.assert_allclose(grads["bias"].get_value(), 2 * layer(x).sum(0), rtol=1e-5, atol=1e-5)
    gx = jax.grad(lambda x: jnp.sum(layer(x)))(x)
    np.testing.assert_allclose(gx, np.broadcast_to(layer.dequantized_kernel().sum(1), x.shape), rtol=1e-5, atol=1e-5)


def test_scan_and_vmap_over_stacked_layers(rng):
    n_layers = 3

    @nnx.vmap(in_axes=0, out_axes=0)
    def make(key):
        return knn.KbitLinear(64, 64, bits=4, rngs=nnx.Rngs(key), kernel_init=nnx.initializers.normal(0.1),
                              bias_init=nnx.initializers.normal(0.1))

    stack = make(jax.random.split(jax.random.key(int(rng.integers(1 << 30))), n_layers))
    assert stack.weight.batch_shape == (n_layers,) and stack.weight.planes.shape == (n_layers, 2, 64, 4)
    layers = [knn.KbitLinear.from_weight(stack.weight[i], stack.bias.get_value()[i]) for i in range(n_layers)]
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.float32)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(h, layer):
        return jnp.tanh(layer(h))

    h = x
    for layer in layers:
        h = jnp.tanh(layer(h))
    np.testing.assert_allclose(nnx.jit(forward)(x, stack), h, rtol=1e-5, atol=1e-6)

    ys = nnx.vmap(lambda m, x: m(x), in_axes=(0, None))(stack, x)
    np.testing.assert_allclose(ys, np.stack([layer(x) for layer in layers]), rtol=1e-5, atol=1e-6)


# -- quantize_model on the tiny Llama ----------------------------------------------------------
PROJECTIONS = ("attn/qkv_proj", "attn/o_proj", "mlp/gate_up_proj", "mlp/down_proj")


@pytest.fixture(scope="module")
def tiny():
    model = numpy_llama(llama.TINY, seed=0)
    tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, llama.TINY.vocab_size)
    return model, tokens


@nnx.jit
def forward(model, tokens):
    cache = llama.init_cache(model.config, tokens.shape[0], tokens.shape[1], jnp.float32)
    return model(tokens, cache, 0)[0]


def test_quantize_model_replaces_exactly_the_intended_layers(tiny):
    model, _ = tiny
    q = nnx.clone(model)
    report = knn.quantize_model(q, bits=4, progress=False)
    expected = [f"layers/{i}/{p}" for i in range(llama.TINY.n_layers) for p in PROJECTIONS]
    assert sorted(report.replaced) == sorted(expected)
    assert [p for p, _ in report.skipped] == ["lm_head"]
    linears = {"/".join(map(str, p)): type(m) for p, m in nnx.iter_graph(q)
               if isinstance(m, (nnx.Linear, knn.KbitLinear))}
    assert linears == {**{p: knn.KbitLinear for p in expected}, "lm_head": nnx.Linear}
    assert isinstance(q.embed, nnx.Embed)
    # The original model is untouched; the quantized one is smaller.
    assert all(type(m) is not knn.KbitLinear for _, m in nnx.iter_graph(model))
    assert report.bytes_after < report.bytes_before
    assert report.bytes_before == sum(x.nbytes for x in jax.tree.leaves(nnx.state(model)))
    assert report.bytes_after == sum(x.nbytes for x in jax.tree.leaves(nnx.state(q)))
    assert report.replaced_bytes_after < report.replaced_bytes_before / 6
    assert f"replaced {len(expected)} layers" in str(report)


def test_quantized_logits_close_to_dense(tiny):
    """Each quantized layer perturbs its output by a relative error eps = 10^(-SQNR/20);
    independent perturbations along the n quantized layers (8: four per block) add roughly
    in quadrature, so the logits' relative error should be about eps * sqrt(n). Allow twice
    that, require
    it to shrink with every extra bit, and to be visibly nonzero (quantization happened)."""
    model, tokens = tiny
    dense = forward(model, tokens)
    n_quantized = llama.TINY.n_layers * len(PROJECTIONS)
    errors = {}
    for bits in (2, 3, 4, 5):
        q = nnx.clone(model)
        knn.quantize_model(q, bits=bits, progress=False)
        errors[bits] = rel_err(forward(q, tokens), dense)
        eps = 10 ** (-SQNR_DB[bits] / 20)
        assert 0.25 * eps < errors[bits] < 2 * eps * math.sqrt(n_quantized), (bits, errors)
    assert errors[2] > errors[3] > errors[4] > errors[5], errors


def test_quantize_model_filter_shared_and_errors(rng):
    class Net(nnx.Module):
        def __init__(self, rngs):
            init = np_init(rng)
            self.blocks = nnx.List([nnx.Linear(64, 64, kernel_init=init, rngs=rngs) for _ in range(3)])
            self.tied = self.blocks[1]
            self.odd = nnx.Linear(40, 64, kernel_init=init, rngs=rngs)
            self.head = nnx.Linear(64, 8, kernel_init=init, rngs=rngs)

    net = Net(nnx.Rngs(0))
    report = knn.quantize_model(net, bits=2, progress=False)
    assert report.replaced == ["blocks/0", "blocks/1", "blocks/2"]
    assert dict(report.skipped) == {"head": "excluded by the default filter",
                                    "odd": "in_features=40 is not a multiple of 32"}
    assert net.tied is net.blocks[1] and isinstance(net.tied, knn.KbitLinear)  # sharing kept

    net = Net(nnx.Rngs(0))
    report = knn.quantize_model(net, bits=3, filter=lambda path, m: path[0] == "head", progress=False)
    assert report.replaced == ["head"] and isinstance(net.head, knn.KbitLinear)
    assert isinstance(net.blocks[0], nnx.Linear)
    with pytest.raises(ValueError, match="in_features"):
        knn.quantize_model(Net(nnx.Rngs(0)), filter=lambda path, m: True, progress=False)


# -- generation ---------------------------------------------------------------------------------
def test_greedy_generation_deterministic_and_cache_consistent(tiny):
    model, tokens = tiny
    model = nnx.clone(model)
    knn.quantize_model(model, bits=4, progress=False)
    prompt, n_new = tokens[:, :8], 6
    out = llama.generate(model, prompt, n_new)
    assert out.shape == (2, n_new) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out, llama.generate(model, prompt, n_new))
    # KV cache: the greedy tokens are the argmax of one uncached forward over prompt + output.
    logits = forward(model, jnp.concatenate([prompt, out], axis=1))
    np.testing.assert_array_equal(jnp.argmax(logits[:, 7:7 + n_new], -1), out)


@pytest.mark.parametrize("quantize_head", [True, False])
def test_build_model_quantizes_while_building(tiny, quantize_head):
    """build_model(bits=...) quantizes block by block as it builds: same layers, same state
    layout and the same report as quantize_model on the finished dense model, lm_head included
    unless quantize_head=False (abstractly: nnx.eval_shape runs the real construction code
    without allocating)."""
    model, _ = tiny
    ref = nnx.clone(model)
    with_head = lambda path, linear: knn.default_filter(path, linear) or path == ("lm_head",)
    ref_report = knn.quantize_model(ref, bits=4, filter=with_head if quantize_head else None, progress=False)
    reports = []

    def build():
        m, r = llama.build_model(llama.TINY, bits=4, param_dtype=jnp.float32, quantize_head=quantize_head)
        reports.append(r)
        return m

    built = nnx.eval_shape(build)
    report = reports[0]
    assert report.replaced == ref_report.replaced
    assert ("lm_head" in report.replaced) == quantize_head
    assert [p for p, _ in report.skipped] == [p for p, _ in ref_report.skipped]
    if not quantize_head:
        assert report.skipped == [("lm_head", "kept dense (quantize_head=False)")]
    assert (report.bytes_before, report.bytes_after) == (ref_report.bytes_before, ref_report.bytes_after)
    shapes = lambda m: jax.tree.map(lambda x: (x.shape, x.dtype), nnx.state(m))
    assert shapes(built) == shapes(ref)
    assert nnx.graphdef(built) == nnx.graphdef(ref)


# -- Orbax -----------------------------------------------------------------------------------------
def test_orbax_round_trip_exact(tiny, tmp_path, rng):
    w = kj.quantize(jnp.asarray(rng.standard_normal((2, 64, 48)), jnp.float32), 3, "uniform")
    tree = {"w": w, "b": jnp.arange(5.0)}
    knn.save_checkpoint(tmp_path / "tree", tree)
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    restored = knn.restore_checkpoint(tmp_path / "tree", target)
    assert isinstance(restored["w"], kj.KbitWeight) and restored["w"].layout == w.layout
    for a, b in zip(jax.tree.leaves(tree), jax.tree.leaves(restored)):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)

    # A quantized model: save its state, restore into an abstract twin (no re-quantization).
    model, tokens = tiny
    q = nnx.clone(model)
    knn.quantize_model(q, bits=5, progress=False)
    knn.save_checkpoint(tmp_path / "model", q)

    def make():
        m, _ = llama.build_model(llama.TINY, bits=5, param_dtype=jnp.float32, seed=1, quantize_head=False)
        return m

    abstract = nnx.eval_shape(make)
    graphdef, abstract_state = nnx.split(abstract)
    state = knn.restore_checkpoint(tmp_path / "model", abstract_state)
    restored_model = nnx.merge(graphdef, state)
    for a, b in zip(jax.tree.leaves(nnx.state(q)), jax.tree.leaves(nnx.state(restored_model))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(forward(restored_model, tokens), forward(q, tokens))
    # Or restore straight into a module (a differently seeded one) in place.
    other = numpy_llama(llama.TINY, seed=2)
    knn.quantize_model(other, bits=5, progress=False)
    assert knn.restore_checkpoint(tmp_path / "model", other) is other
    np.testing.assert_array_equal(forward(other, tokens), forward(q, tokens))


# -- Linen -----------------------------------------------------------------------------------------
class MLP(linen.Module):
    """Layers named explicitly: Linen auto-names by class (Dense_0 vs KbitDense_0)."""
    dense: type = linen.Dense
    bits: int = 4
    kinit: Any = linen.initializers.lecun_normal()

    @linen.compact
    def __call__(self, x):
        kw = {"kernel_init": self.kinit} | ({} if self.dense is linen.Dense else {"bits": self.bits})
        x = jax.nn.gelu(self.dense(96, name="fc1", **kw)(x))
        x = jax.nn.gelu(self.dense(64, name="fc2", **kw)(x))
        return linen.Dense(10, name="head", kernel_init=self.kinit)(x)


def test_linen_kbit_dense_and_quantize_params(rng):
    x = jnp.asarray(rng.standard_normal((4, 64)), jnp.float32)
    params = MLP(kinit=np_init(rng)).init(jax.random.key(0), x)["params"]
    qparams, report = knn.quantize_params(params, bits=4, with_report=True)
    assert sorted(report.replaced) == ["fc1/kernel", "fc2/kernel"]
    assert isinstance(qparams["fc1"]["kernel"], kj.KbitWeight)
    assert not isinstance(qparams["head"]["kernel"], kj.KbitWeight)
    assert report.bytes_after < report.bytes_before

    # The converted tree applies to the same model with Dense -> KbitDense ...
    y = MLP(dense=knn.KbitDense).apply({"params": qparams}, x)
    # ... and equals the dense model holding the dequantized kernels.
    deq = jax.tree.map(lambda p: kj.dequantize(p) if isinstance(p, kj.KbitWeight) else p, qparams,
                       is_leaf=lambda p: isinstance(p, kj.KbitWeight))
    np.testing.assert_allclose(y, MLP().apply({"params": deq}, x), rtol=1e-5, atol=1e-5)
    assert rel_err(y, MLP().apply({"params": params}, x)) < 3 * 10 ** (-SQNR_DB[4] / 20) * math.sqrt(2)
    np.testing.assert_allclose(jax.jit(MLP(dense=knn.KbitDense).apply)({"params": qparams}, x), y, rtol=1e-5, atol=1e-6)

    # KbitDense initializes its own quantized kernel; a bits mismatch is a shape error.
    fresh = MLP(dense=knn.KbitDense, bits=3, kinit=np_init(rng)).init(jax.random.key(0), x)["params"]
    assert fresh["fc2"]["kernel"].bits == 3
    with pytest.raises(Exception, match="kernel"):
        MLP(dense=knn.KbitDense, bits=3).apply({"params": qparams}, x)
    # A custom filter; the whole variables dict also works.
    only = knn.quantize_params({"params": params}, bits=2, filter=lambda path, a: path[-2:] == ("fc2", "kernel"))
    assert isinstance(only["params"]["fc2"]["kernel"], kj.KbitWeight)
    assert not isinstance(only["params"]["fc1"]["kernel"], kj.KbitWeight)


def test_fused_projections_match_separate_kernels(rng):
    """fuse_qkv / fuse_gate_up put separate q/k/v and gate/up kernels in the column orders the
    example's Attention and MLP read: the fused layers compute exactly the separate products."""
    cfg = llama.TINY_TP
    d, h, kvh, hd, f = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim
    q, k, v = (rng.standard_normal((d, n * hd)).astype(np.float32) for n in (h, kvh, kvh))
    gate, up = (rng.standard_normal((d, f)).astype(np.float32) for _ in range(2))
    x = rng.standard_normal((2, 3, d)).astype(np.float32)

    attn = llama.Attention(cfg, jnp.float32, nnx.Rngs(0))
    attn.qkv_proj.kernel.set_value(llama.fuse_qkv(q, k, v, kvh))
    qkv = np.asarray(attn.qkv_proj(x)).reshape(2, 3, kvh, h // kvh + 2, hd)
    np.testing.assert_allclose(qkv[:, :, :, :-2].reshape(2, 3, h * hd), x @ q, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(qkv[:, :, :, -2].reshape(2, 3, kvh * hd), x @ k, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(qkv[:, :, :, -1].reshape(2, 3, kvh * hd), x @ v, rtol=1e-5, atol=1e-4)

    mlp = llama.MLP(cfg, jnp.float32, nnx.Rngs(0))
    mlp.gate_up_proj.kernel.set_value(llama.fuse_gate_up(gate, up))
    down = np.asarray(mlp.down_proj.kernel.get_value())
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    np.testing.assert_allclose(mlp(x), (silu(x @ gate) * (x @ up)) @ down, rtol=1e-4, atol=1e-3)
    # Quantized, the MLP gates inside the kbit kernel (matmul(..., glu="silu")): the same as
    # gating the quantized layer's plain output.
    knn.quantize_model(mlp, bits=4, progress=False)
    assert isinstance(mlp.gate_up_proj, knn.KbitLinear)
    gate_up = np.asarray(mlp.gate_up_proj(x), np.float64)
    down = np.asarray(mlp.down_proj.dequantized_kernel(), np.float64)
    expected = (silu(gate_up[..., 0::2]) * gate_up[..., 1::2]) @ down
    np.testing.assert_allclose(mlp(x), expected, rtol=1e-4, atol=1e-3)
    mlp.gate = "xla"
    np.testing.assert_allclose(mlp(x), expected, rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="mlp_gate='kernel'"):
        llama.MLP(cfg, jnp.float32, nnx.Rngs(0), gate="kernel")


# -- underflow report ------------------------------------------------------------------------------
def _wide_range_kernel():
    """[64, 41]: columns 1e-20 .. 1e20; 35 of them (70 blocks) lie below E4M4's range."""
    return np.ones((64, 41), np.float32) * np.logspace(-20, 20, 41, dtype=np.float32)


def test_quantize_params_reports_underflowed_blocks(rng):
    params = {"fc": {"kernel": jnp.asarray(_wide_range_kernel())},
              "out": {"kernel": jnp.asarray(rng.standard_normal((64, 8)), jnp.float32)}}
    with pytest.warns(kj.ops.ScaleUnderflowWarning, match="70 nonzero blocks in 1 layers") as caught:
        _, report = knn.quantize_params(params, 4, with_report=True)
    assert len(caught) == 1      # one summary, not one per layer
    assert report.underflowed_blocks == 70 and report.underflowed == [("fc/kernel", 70)]
    assert "70 nonzero blocks in 1 layers underflowed to zero" in str(report)


def test_quantize_model_reports_underflowed_blocks(rng):
    class Net(nnx.Module):
        def __init__(self):
            self.a = nnx.Linear(64, 41, rngs=nnx.Rngs(0))
            self.b = nnx.Linear(64, 8, rngs=nnx.Rngs(1))
            self.a.kernel.set_value(jnp.asarray(_wide_range_kernel()))

    net = Net()
    with pytest.warns(kj.ops.ScaleUnderflowWarning, match="70 nonzero blocks"):
        report = knn.quantize_model(net, 4, progress=False)
    assert report.underflowed_blocks == 70 and report.underflowed == [("a", 70)]
    clean = knn.quantize_model(nnx.Sequential(nnx.Linear(64, 8, rngs=nnx.Rngs(2))), 4, progress=False)
    assert clean.underflowed_blocks == 0 and "underflowed" not in str(clean)
