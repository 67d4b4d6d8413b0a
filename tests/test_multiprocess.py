"""Multi-process (multi-host style) runs on the CPU: 2 processes on localhost, 4 simulated CPU
devices each, joined by ``jax.distributed.initialize`` into one 8-device mesh (cross-process
collectives through gloo).

Each process runs the same program as ``docs/distributed.md``'s example:

- a column-parallel kbit product (weight placed with ``kbit_jax.column_parallel``) followed by
  a row-parallel one (weight assembled with ``jax.make_array_from_callback``, each process
  reading only the blocks of its own shards), under ``jit`` over the global mesh;
- greedy decoding with the example decoder placed tensor-parallel over all 8 devices
  (``llama.build_model(mesh=...)``), so both all-reduces of every layer cross the processes.

The test compares both processes' results with the single-device result computed here.
This file is also the worker: ``python tests/test_multiprocess.py PROCESS_ID PORT SEED``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np

RESULT = "RESULT "       # prefix of the worker's stdout line carrying its results as JSON
NUM_PROCESSES, LOCAL_DEVICES = 2, 4
TIMEOUT_S = 240          # per run of both workers (about 40 s on 2 busy cores)
M, D, H = 4, 256, 512    # MLP: x[M, D] @ W_up[D, H] (column-parallel) @ W_down[H, D] (row-parallel)
PROMPT_SHAPE, NEW_TOKENS = (2, 8), 4


def decoder_config():
    """8 kv heads and 32-element blocks per shard: tensor-parallel over all 8 devices."""
    from kbit_jax.examples import llama
    return llama.LlamaConfig(vocab_size=256, dim=256, n_layers=2, n_heads=8, n_kv_heads=8,
                             hidden_dim=512, rope_theta=10_000.0)


def inputs(seed):
    """(x, W_up, W_down, prompt) as numpy arrays, the same in every process."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((M, D)).astype(np.float32)
    w_up = (rng.standard_normal((D, H)) * rng.uniform(0.1, 2.0, H)).astype(np.float32)
    w_down = (rng.standard_normal((H, D)) * rng.uniform(0.1, 2.0, D)).astype(np.float32)
    prompt = rng.integers(0, 256, PROMPT_SHAPE).astype(np.int32)
    return x, w_up, w_down, prompt


# -- worker -----------------------------------------------------------------------------------
def worker(process_id: int, port: int, seed: int) -> dict:
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")   # cross-process on CPU
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}",
                               num_processes=NUM_PROCESSES, process_id=process_id,
                               initialization_timeout=TIMEOUT_S // 2)
    import jax.numpy as jnp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import kbit_jax as kj
    from kbit_jax.examples import llama

    mesh = jax.make_mesh((NUM_PROCESSES * LOCAL_DEVICES,), ("tp",))   # spans both processes
    x, w_up, w_down, prompt = inputs(seed)

    # Column-parallel: every process quantizes the whole weight, device_put keeps its shards.
    w_up_tp = kj.column_parallel(kj.quantize(w_up, 4), mesh)
    # Row-parallel: assembled from host leaves, each process reading only its own slices
    # (as it would from a memory-mapped checkpoint of the quantized weight).
    w_down_q = jax.tree.map(np.asarray, kj.quantize(w_down, 4))
    shardings = kj.sharding.weight_shardings(w_down_q, mesh, P("tp", None))
    blocks_read = set()

    def reader(leaf):
        def read(index):
            if leaf.ndim == 3:                       # planes [K/32, N, bits]: record the blocks
                blocks_read.update(range(*index[0].indices(leaf.shape[0])))
            return leaf[index]
        return read

    w_down_tp = jax.tree.map(lambda leaf, s: jax.make_array_from_callback(leaf.shape, s, reader(leaf)),
                             w_down_q, shardings)

    @jax.jit
    def mlp(x, w_up, w_down):
        h = kj.matmul(x, w_up)                       # [M, H], sharded on H: no collective
        return h, kj.matmul(h, w_down)               # K-sharded product + one all-reduce

    with jax.set_mesh(mesh):
        h, y = mlp(jax.device_put(x, NamedSharding(mesh, P())), w_up_tp, w_down_tp)
        hlo = mlp.lower(jax.device_put(x, NamedSharding(mesh, P())), w_up_tp, w_down_tp)
        collectives = kj.sharding.collective_counts(hlo.compile().as_text())
    h_all = multihost_utils.process_allgather(h, tiled=True)   # every process: the whole h

    model, _ = llama.build_model(decoder_config(), bits=4, param_dtype=jnp.float32, seed=seed,
                                 mesh=mesh)
    planes = model.layers[0].mlp.down_proj.kernel.planes.get_value()
    tokens = llama.generate(model, prompt, NEW_TOKENS)
    result = {
        "process_index": jax.process_index(), "process_count": jax.process_count(),
        "devices": jax.device_count(), "local_devices": jax.local_device_count(),
        "mesh_device_processes": [d.process_index for d in mesh.devices.flat],
        "h": np.asarray(h_all).tolist(), "y": np.asarray(y).tolist(),
        "y_replicated": y.is_fully_replicated, "mlp_collectives": collectives,
        "w_down_blocks_read": sorted(blocks_read),
        "decoder_weight_shards_here": len(planes.addressable_shards),
        "decoder_weight_fully_addressable": planes.is_fully_addressable,
        "tokens": np.asarray(tokens).tolist(),
    }
    jax.distributed.shutdown()
    return result


# -- test -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(seed: int) -> list[subprocess.Popen]:
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"}
    port = free_port()
    return [subprocess.Popen([sys.executable, os.path.abspath(__file__), str(i), str(port), str(seed)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for i in range(NUM_PROCESSES)]


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill whichever of these workers (only these) is still running."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.communicate()


def collect(procs: list[subprocess.Popen]) -> list[dict]:
    """The workers' results; fails with their stderr if one fails or they time out."""
    import pytest
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=TIMEOUT_S))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {NUM_PROCESSES} workers did not finish in {TIMEOUT_S} s")
    finally:
        stop(procs)
    results = []
    for i, (p, (out, err)) in enumerate(zip(procs, outputs)):
        lines = [l[len(RESULT):] for l in out.splitlines() if l.startswith(RESULT)]
        assert p.returncode == 0 and lines, f"worker {i} exit {p.returncode}:\n{err[-4000:]}"
        results.append(json.loads(lines[-1]))
    return results


def test_two_processes_equal_single_device(rng):
    import jax.numpy as jnp
    from helpers import dense64, matmul_error_bound

    import kbit_jax as kj
    from kbit_jax.examples import llama

    seed = int(rng.integers(0, 2 ** 31))
    procs = start_workers(seed)
    try:
        # Meanwhile, the single-device result of the same inputs.
        x, w_up, w_down, prompt = inputs(seed)
        q_up, q_down = kj.quantize(w_up, 4), kj.quantize(w_down, 4)
        h_ref, h_bound = matmul_error_bound(x, dense64(q_up), jnp.float32, jnp.float32)
        y_ref, y_bound = matmul_error_bound(h_ref, dense64(q_down), jnp.float32, jnp.float32)
        y_bound += h_bound @ np.abs(dense64(q_down))      # h's own error, carried through W_down
        model, _ = llama.build_model(decoder_config(), bits=4, param_dtype=jnp.float32, seed=seed)
        ref_tokens = np.asarray(llama.generate(model, prompt, NEW_TOKENS))
    except BaseException:
        stop(procs)
        raise
    results = collect(procs)

    for i, r in enumerate(results):
        assert (r["process_index"], r["process_count"]) == (i, NUM_PROCESSES)
        assert (r["devices"], r["local_devices"]) == (NUM_PROCESSES * LOCAL_DEVICES, LOCAL_DEVICES)
        # jax.make_mesh lays the devices out process by process: a mesh (processes, local)
        # keeps its last axis inside one process (docs/distributed.md relies on it).
        assert r["mesh_device_processes"] == sorted(list(range(NUM_PROCESSES)) * LOCAL_DEVICES)
        # Weights stay where they were placed: one all-reduce, nothing gathered.
        assert r["mlp_collectives"]["all-reduce"] == 1 and r["mlp_collectives"]["all-gather"] == 0
        # This process read only the K blocks of its own 4 shards (of 8, K/32 = 16 blocks).
        blocks = H // 32
        assert r["w_down_blocks_read"] == list(range(i * blocks // 2, (i + 1) * blocks // 2))
        assert r["decoder_weight_shards_here"] == LOCAL_DEVICES
        assert not r["decoder_weight_fully_addressable"]
        assert r["y_replicated"]
        assert np.all(np.abs(np.asarray(r["h"]) - h_ref) <= h_bound), f"process {i}: h"
        assert np.all(np.abs(np.asarray(r["y"]) - y_ref) <= y_bound), f"process {i}: y"
        np.testing.assert_array_equal(np.asarray(r["tokens"]), ref_tokens, err_msg=f"process {i}")


if __name__ == "__main__":
    process_id, port, seed = (int(a) for a in sys.argv[1:4])
    print(RESULT + json.dumps(worker(process_id, port, seed)), flush=True)
