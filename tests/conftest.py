"""Test session setup: 8 simulated CPU devices (set before JAX initializes) and GPU markers."""

import os

# The sharding, pmap and shard_map tests need several devices; on a CPU-only machine XLA
# simulates them. Must happen before jax initializes its backends.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
if "--xla_force_host_platform_device_count" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402


def gpu_devices():
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def pytest_xdist_auto_num_workers(config):
    """Workers for `-n auto` (the README's test command). Where JAX may use an NVIDIA GPU: one,
    since every worker process would claim most of the GPU's memory and the GPU tests time
    kernels. Otherwise one per core, at most 4: each worker holds its own XLA CPU client with 8
    simulated devices and its compiled programs (2 workers on 2 cores run the suite in 0.72x
    the time of one process; more were not measured)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    may_use_gpu = not platforms or any(p in platforms for p in ("cuda", "gpu"))
    if may_use_gpu and os.path.exists("/dev/nvidiactl"):
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cores or 1))


def pytest_collection_modifyitems(config, items):
    if gpu_devices():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (none found)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def rng(request):
    """A fresh numpy Generator per test, seeded from the test id and the clock, so every run
    draws new data; the seed is printed on failure (pytest shows captured stdout)."""
    seed = (hash(request.node.nodeid) ^ int.from_bytes(os.urandom(4), "little")) & 0xFFFFFFFF
    print(f"rng seed for {request.node.nodeid}: {seed}")
    return np.random.default_rng(seed)


# Devices the kernel tests run on: the CPU always, the GPU when present.
PLATFORMS = [
    pytest.param("cpu", id="cpu"),
    pytest.param("gpu", id="gpu", marks=pytest.mark.gpu),
]


@pytest.fixture(params=PLATFORMS)
def device(request):
    """The first device of the platform under test (GPU params are skipped without a GPU)."""
    return jax.devices(request.param)[0]
