"""benchmarks/profile_summary.py on a synthetic GPU trace: the decode profile in the results
README comes from it, so its interval arithmetic and kernel categories are checked here."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import profile_summary  # noqa: E402


def trace(events):
    meta = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
        {"ph": "M", "pid": 7, "name": "process_name", "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "pid": 7, "tid": 10, "name": "thread_name", "args": {"name": "Stream #14(Compute)"}},
        {"ph": "M", "pid": 7, "tid": 11, "name": "thread_name", "args": {"name": "XLA Ops"}},
    ]
    return {"traceEvents": meta + [{"ph": "X", "pid": 7, "tid": tid, "ts": ts, "dur": dur, "name": name}
                                   for tid, ts, dur, name in events]}


def test_busy_idle_and_categories():
    t = trace([
        (10, 0.0, 10.0, "void kbit::cuda::fused::kbit_matmul_ws_kernel<4, ...>"),
        (10, 5.0, 10.0, "gemm_fusion_dot_12"),          # overlaps the first: busy is the union
        (10, 30.0, 5.0, "input_reduce_fusion_3"),       # 15 us gap before it
        (10, 40.0, 0.0, "zero-length marker"),          # ignored
        (11, 0.0, 40.0, "the same ops as annotations"),  # not a stream thread: ignored
        (10, 40.0, 10.0, "ncclDevKernel_AllReduce_Sum_bf16"),
    ])
    kernels = profile_summary.kernel_events(t)
    assert [k[2][:4] for k in kernels] == ["void", "gemm", "inpu", "nccl"]
    text = profile_summary.summarize(kernels, steps=2)
    lines = {line.split()[0]: line for line in text.splitlines()[1:4]}
    # span 0..50 = 50 us, busy = 15 (0..15) + 5 + 10 = 30 us, idle 20 us; halved per step.
    assert "25.0" in lines["span"] and "15.0" in lines["busy"] and "10.0" in lines["idle"]
    assert "(60.0 %)" in lines["busy"]
    for label, per_step in (("kbit fused matmul", "5.0"), ("cuBLAS / dense GEMM", "5.0"),
                            ("NCCL", "5.0"), (profile_summary.OTHER, "2.5")):
        (row,) = [line for line in text.splitlines() if line.strip().startswith(label)]
        assert row.strip()[len(label):].split()[0] == per_step, row
    assert profile_summary.category("void kbit::cuda::(anonymous namespace)::dequantize_kernel<4>") \
        == "kbit dequantize"


def test_no_gpu_process_is_a_clear_error():
    t = {"traceEvents": [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}}]}
    try:
        profile_summary.kernel_events(t)
    except SystemExit as e:
        assert "no GPU:0 process" in str(e)
    else:
        raise AssertionError("expected SystemExit")
