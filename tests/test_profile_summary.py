"""benchmarks/profile_summary.py on a synthetic GPU trace: bench_matmul.py's busy times and
bench_decode.py's profile summaries come from it, so its interval arithmetic and kernel
categories are checked here."""

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
        by_category = text.split("kernel time by category:")[1].split("idle time before")[0]
        (row,) = [line for line in by_category.splitlines() if line.strip().startswith(label)]
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


def test_idle_gaps_by_following_kernel_and_kbit_positions():
    kbit = "void kbit::cuda::fused::kbit_matmul_ws_kernel<4, ...>"
    t = trace([
        (10, 0.0, 10.0, kbit),                   # position 0
        (10, 12.0, 4.0, kbit),                   # position 1, 2 us gap before it
        (10, 16.0, 2.0, "loop_add_fusion"),      # no gap
        (10, 21.0, 12.0, kbit),                  # position 0, 3 us gap
        (10, 33.0, 6.0, kbit),                   # position 1
    ])
    text = profile_summary.summarize(profile_summary.kernel_events(t), steps=1, period=2)
    (gaps,) = [line for line in text.splitlines() if line.strip().startswith("kbit fused matmul")
               and "gaps" in line]
    assert gaps.split()[3] == "5.0" and "2.0 gaps, mean 2.5 us" in gaps
    pos = [line.split() for line in text.splitlines() if line.strip().startswith("position")]
    # medians of (10, 12) and (4, 6): the upper middle of two
    assert [p[2] for p in pos] == ["12.0", "6.0"] and [p[3] for p in pos] == ["10.0", "4.0"]
    odd = profile_summary.summarize(profile_summary.kernel_events(t), steps=1, period=3)
    assert "not a multiple of 3" in odd


def test_host_summary_groups_instances_and_skips_python_frames():
    t = trace([])
    t["traceEvents"] += [{"ph": "X", "pid": 1, "tid": 2, "ts": 0.0, "dur": d, "name": n}
                         for n, d in (("custom-call.3", 6.0), ("custom-call.7", 4.0), ("$python frame", 99.0),
                                      ("end: custom-call.3", 1.0), ("fusion.1", 2.0))]
    text = profile_summary.host_summary(t, steps=2)
    rows = [line.split() for line in text.splitlines()[1:]]
    assert rows[0] == ["5.0", "x", "1.0", "5.0", "custom-call"] and rows[1][-1] == "fusion"
    assert "python" not in text


def test_layer_sequence_lists_one_period_from_the_middle_with_gaps():
    kbit = "void kbit::cuda::fused::kbit_matmul_ws_kernel<4, ...>"
    events, t = [], 0.0
    for layer in range(4):  # period 2: kbit, psum (3 us after), kbit
        for name, dur, gap in ((kbit, 10.0, 1.0), (f"psum_{layer}_fusion", 5.0, 3.0), (kbit, 4.0, 0.5)):
            t += gap
            events.append((10, t, dur, name))
            t += dur
    text = profile_summary.layer_sequence(profile_summary.kernel_events(trace(events)), period=2)
    lines = text.splitlines()
    assert lines[0].startswith("one layer's kernels (3)")
    rows = [line.split(None, 3) for line in lines[1:]]
    # the middle layer (index 2 of 4) starts at its first kbit call
    assert [r[3] for r in rows] == [kbit[:90], "psum_2_fusion", kbit[:90]]
    assert [r[0] for r in rows] == ["0.0", "13.0", "18.5"] and [r[1] for r in rows] == ["0.0", "3.0", "0.5"]
    assert "fewer than two periods" in profile_summary.layer_sequence(profile_summary.kernel_events(trace(events[:3])), 2)
