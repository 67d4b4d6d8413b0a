"""Device-time benchmark of kbit_jax.matmul against the dense jnp.dot.

Timing: each measurement jits one function that runs the product over R different weight
buffers (R chosen so their bytes exceed the 60 MB L2 at least four times, so weights come
from HBM as in decoding), in P passes with P copies of x, each pass after the previous one
(`kbit_jax.timing.passes_function`: otherwise XLA may merge or group one weight's products).

On a GPU (--time busy, the default there) every row reports the device's busy time per
product, kbit and dense alike: the union of the GPU's kernel intervals in a profile of
one-pass calls (`busy_seconds`), in which waits for the host drop out. Call times are recorded
beside it ("kbit_call_us", "dense_call_us"): they also hold the device's idle time between
calls, and on small layers the host's cost of queueing a call, so they are an upper bound.

--time call (the only mode on a CPU backend) reports call times instead: the function is
dispatched 10 times back to back without waiting (`kbit_jax.timing.median_call_seconds`), the
last result awaited, and time / (10 * P * R) is one sample; the median of the samples is
reported. P starts at 1 and doubles while queueing a call takes more than 0.7 of its time
(`kbit_jax.timing.products_seconds`, up to --max-passes); rows record P ("passes",
"dense_passes") and whether the host still set the pace ("host_bound", "dense_host_bound").

The dense bf16 and fp16 dots are measured in the same run (the other 16-bit dot's column is a
call time in either mode), and the bandwidth floor is bytes moved / copy bandwidth measured in
the same run: the faster of cudaMemcpy (through torch, where it is installed) and XLA's own
copy. With --out, <name>.json is rewritten after every row, and <name>.md and <name>.png
(`render.py`) are written at the end; the name defaults to matmul_<gpu>, e.g. matmul_h200.

    python benchmarks/bench_matmul.py --out benchmarks/results            # full table (GPU)
    python benchmarks/bench_matmul.py --shapes qwen3_q --m 1 16 --bits 4  # a subset
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
import kbit_jax as kj  # noqa: E402
from kbit_jax import reference  # noqa: E402
from kbit_jax.timing import median_call_seconds, passes_function, products_seconds  # noqa: E402
import render  # noqa: E402
from profile_summary import busy_us, trace_kernels  # noqa: E402
from shapes import BITS, M_VALUES, SHAPES  # noqa: E402

L2_BYTES = 60e6


def copy_bandwidth(repeats):
    """Bytes read + written per second by a large device copy (x + 1 over 2 GiB of bf16)."""
    x = jnp.ones((1 << 30,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)
    for _ in range(3):                  # let the clocks ramp up before the sample that counts
        t = median_call_seconds(f, (x,), repeats)
    return 2 * x.nbytes / t


def memcpy_bandwidth():
    """Bytes read + written per second by cudaMemcpy device to device (torch, in a subprocess so
    that it does not share the process with JAX's allocator), or None where torch or CUDA is
    missing. XLA's copy (copy_bandwidth) reads ~3.2 TB/s on the H200 where cudaMemcpy reaches
    ~4.2, so the floor and '% BW' use the faster of the two."""
    code = ("import torch\n"
            "a = torch.empty(1 << 31, dtype=torch.uint8, device='cuda'); b = torch.empty_like(a)\n"
            "s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)\n"
            "ts = []\n"
            "for _ in range(20):\n"
            "    s.record(); b.copy_(a); e.record(); e.synchronize(); ts.append(s.elapsed_time(e))\n"
            "print(2 * a.numel() / (sorted(ts)[len(ts) // 2] * 1e-3))\n")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return float(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def weight_copy(w_q):
    """A copy of a kbit weight in new device buffers (one of the rotation's cold weights)."""
    return jax.tree.map(lambda a: a + 0 if a.dtype != jnp.uint8 else a | 0, w_q)


def busy_seconds(product, x, weights, calls: int = 3) -> float:
    """Device busy seconds per product(x, w) over `weights`: the union of GPU 0's kernel
    intervals in a profile of `calls` one-pass calls, over their products. Where the host sets
    the pace of a call, the kernels wait for their launches and the call time is an upper bound;
    the busy time is what the device spent."""
    f = passes_function(product)
    kernels = trace_kernels(lambda: f([x], weights), calls)
    return busy_us(kernels) * 1e-6 / (calls * len(weights))


def rotation_count(weight_bytes):
    return int(min(64, max(4, np.ceil(4 * L2_BYTES / weight_bytes))))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--kn", nargs=2, type=int, metavar=("K", "N"),
                   help="benchmark this one K x N shape instead of --shapes")
    p.add_argument("--m", nargs="+", type=int, default=list(M_VALUES))
    p.add_argument("--bits", nargs="+", type=int, default=list(BITS))
    p.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float16"])
    p.add_argument("--method", default="auto", choices=["auto", "fused", "dequantize"])
    p.add_argument("--glu", default=None, choices=sorted(reference.GLU_ACTIVATIONS),
                   help="time gated products (a SwiGLU/GeGLU MLP's gate/up): act(y[..., 0::2]) * "
                        "y[..., 1::2]; kbit gates inside its kernel (kbit_jax.matmul(glu=...)), the "
                        "dense dots and 'kbit_xla_gate_us' (the same kbit product, gated by XLA) after")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--time", default=None, choices=["busy", "call"],
                   help="what each row reports: the device's busy time from a profile (default on a "
                        "GPU), or the call time, with the busy time only where the host set the pace")
    p.add_argument("--max-passes", type=int, default=None,
                   help="the most passes the call time's search may take (default: 8 with --time call, "
                        "1 with --time busy, where the call time is only recorded)")
    p.add_argument("--warmup", type=float, default=0.2,
                   help="seconds of untimed calls before each measurement's samples (clocks ramp up)")
    p.add_argument("--out", default=None, help="directory for <name>.json, .md and .png")
    p.add_argument("--name", default=None,
                   help="file name stem under --out (default: matmul_<gpu>, e.g. matmul_h200)")
    args = p.parse_args(argv)

    device = jax.devices()[0]
    name = args.name or f"matmul_{device_tag(device.device_kind)}"
    on_gpu = device.platform == "gpu"
    timing = args.time or ("busy" if on_gpu else "call")
    if timing == "busy" and not on_gpu:
        p.error("--time busy needs a GPU: the CPU backend's profile has no kernel intervals")
    max_passes = args.max_passes if args.max_passes is not None else 1 if timing == "busy" else 8
    if max_passes < 1:
        p.error("--max-passes must be at least 1")
    timed = functools.partial(products_seconds, repeats=args.repeats, max_passes=max_passes,
                              warmup_seconds=args.warmup)
    xla_gate = functools.partial(reference.apply_glu, kind=args.glu)
    memcpy_bw = memcpy_bandwidth() if on_gpu else None  # before JAX takes the GPU's memory
    xla_bw = copy_bandwidth(args.repeats)
    bw = max(xla_bw, memcpy_bw or 0.0)  # '% BW' and the floor use the faster of the two copies
    print(f"device {device.device_kind}, jax {jax.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s "
          f"(XLA copy {xla_bw / 1e12:.2f}, cudaMemcpy "
          f"{'n/a' if memcpy_bw is None else f'{memcpy_bw / 1e12:.2f}'}), build {kj.build_info()}; "
          f"times: {'busy time from a profile' if timing == 'busy' else 'call time'}", flush=True)
    result = dict(device=device.device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
                  copy_bandwidth_tbs=bw / 1e12, xla_copy_bandwidth_tbs=xla_bw / 1e12,
                  memcpy_bandwidth_tbs=None if memcpy_bw is None else memcpy_bw / 1e12,
                  build=kj.build_info(), method=args.method, glu=args.glu, warmup_s=args.warmup, timing=timing,
                  max_passes=max_passes, rows=[])
    rows = result["rows"]
    shapes = {f"{args.kn[0]}x{args.kn[1]}": tuple(args.kn)} if args.kn else {s: SHAPES[s] for s in args.shapes}
    for shape_name, (k, n) in shapes.items():
        key = jax.random.key(hash(shape_name) & 0xFFFF)
        w = jax.random.normal(key, (k, n), jnp.float32) * 0.02
        for dtype_name in args.dtype:
            dtype = jnp.dtype(dtype_name)
            dense = w.astype(dtype)
            dense_ws = [dense + 0 for _ in range(rotation_count(dense.nbytes))]
            quantized = {}
            for bits in args.bits:
                w_q = kj.quantize(w, bits)
                quantized[bits] = [weight_copy(w_q) for _ in range(rotation_count(w_q.nbytes))]
            for m in args.m:
                x = (jax.random.normal(jax.random.key(m), (m, k), jnp.float32)).astype(dtype)
                dot = jnp.dot          # what a user writes: XLA picks the GEMM (cuBLAS)
                if args.glu:
                    dot = lambda x, w: xla_gate(jnp.dot(x, w))  # noqa: E731
                t_dense, dense_passes, dense_host_bound = timed(dot, x, dense_ws)
                t_dense_call = t_dense
                if timing == "busy" or (dense_host_bound and on_gpu):
                    t_dense = busy_seconds(dot, x, dense_ws)
                # the other 16-bit dense baseline (fp16 for bf16 runs and vice versa)
                other = jnp.float16 if dtype == jnp.bfloat16 else jnp.bfloat16
                # (a reported call time, once per M: its pass search keeps the cap of 8)
                t_dense_other = timed(dot, x.astype(other), [d.astype(other) for d in dense_ws[:4]],
                                      max_passes=8)[0] if len(dense_ws) >= 4 else float("nan")
                passes = 1  # each bits value starts from the passes the previous one needed
                for bits in args.bits:
                    ws = quantized[bits]
                    product = lambda x, w: kj.matmul(x, w, method=args.method, glu=args.glu)  # noqa: E731
                    t, passes, host_bound = timed(product, x, ws, passes=passes)
                    t_call = t
                    if timing == "busy" or (host_bound and on_gpu):
                        t = busy_seconds(product, x, ws)
                    n_out = n // 2 if args.glu else n
                    moved = ws[0].planes.nbytes + ws[0].scales.nbytes + x.nbytes + m * n_out * dtype.itemsize
                    row = dict(shape=shape_name, k=k, n=n, m=m, bits=bits, dtype=dtype_name,
                               kbit_us=t * 1e6, dense_us=t_dense * 1e6, speedup=t_dense / t,
                               passes=passes, dense_passes=dense_passes,
                               host_bound=host_bound, dense_host_bound=dense_host_bound,
                               dense_other_us=t_dense_other * 1e6,
                               floor_us=moved / bw * 1e6, bw_fraction=moved / bw / t,
                               dense_bw_fraction=(dense.nbytes + x.nbytes + m * n * dtype.itemsize) / bw / t_dense)
                    if t != t_call:           # the busy time replaced the call time
                        row["kbit_call_us"] = t_call * 1e6
                    if t_dense != t_dense_call:
                        row["dense_call_us"] = t_dense_call * 1e6
                    if args.glu:   # the same product with XLA's gate after it: what the fusion saves
                        unfused = lambda x, w: xla_gate(kj.matmul(x, w, method=args.method))  # noqa: E731
                        row["glu"] = args.glu
                        row["kbit_xla_gate_us"] = timed(unfused, x, ws, passes=passes)[0] * 1e6
                    rows.append(row)
                    if args.out:  # after every row, so that a run cut short keeps what it measured
                        write_json(result, args.out, name)
                    print(f"{shape_name:22s} {dtype_name:8s} M={m:<5d} K={bits} kbit {t * 1e6:9.1f} us  "
                          f"dense {t_dense * 1e6:9.1f} us  x{t_dense / t:5.2f}  "
                          f"{100 * row['bw_fraction']:5.1f}% of copy BW  passes {passes}/{dense_passes}"
                          f"  (call {t_call * 1e6:.1f} / {t_dense_call * 1e6:.1f} us)"
                          f"{'  (host-bound call)' if host_bound or dense_host_bound else ''}"
                          + (f"  kbit + XLA gate {row['kbit_xla_gate_us']:7.1f} us" if args.glu else ""),
                          flush=True)
    if args.out:
        path = write_json(result, args.out, name)
        print(f"wrote {path}")
        render.main([path])
    return result


def device_tag(device_kind: str) -> str:
    """A short file-name tag for a device: its first word with a digit ("NVIDIA H100 80GB HBM3"
    -> "h100", "NVIDIA A100-SXM4-80GB" -> "a100"), else its first word ("cpu")."""
    words = [w for w in re.split(r"[^a-z0-9]+", device_kind.lower()) if w and w != "nvidia"]
    return next((w for w in words if any(c.isdigit() for c in w)), words[0] if words else "device")


def write_json(result, out_dir, name):
    """Write result to out_dir/<name>.json through a temporary file (never a half-written file)."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(result, f, indent=1)
    os.replace(path + ".tmp", path)
    return path


if __name__ == "__main__":
    main()
