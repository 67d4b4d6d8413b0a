"""kbit_jax.timing: the warm-up runs before the timed samples, and only for the time asked."""

import time

import jax.numpy as jnp

from kbit_jax.timing import median_call_seconds


def counted(sleep_s=0.0):
    calls = []

    def fn(x):
        calls.append(time.perf_counter())
        if sleep_s:
            time.sleep(sleep_s)
        return x + 1

    return fn, calls


def test_no_warmup_runs_compile_call_and_samples_only():
    fn, calls = counted()
    t = median_call_seconds(fn, (jnp.ones(4),), repeats=3, calls=5, warmup_seconds=0.0)
    assert len(calls) == 1 + 3 * 5 and t >= 0


def test_warmup_runs_whole_batches_for_at_least_the_time_asked():
    fn, calls = counted(sleep_s=0.002)
    median_call_seconds(fn, (jnp.ones(4),), repeats=2, calls=4, warmup_seconds=0.05)
    warm = len(calls) - 1 - 2 * 4
    assert warm >= 4 and warm % 4 == 0  # whole batches of `calls`
    assert calls[1 + warm - 1] - calls[1] >= 0.05 - 0.01  # the warm-up lasted about that long
