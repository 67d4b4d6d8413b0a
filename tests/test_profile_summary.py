"""benchmarks/profile_summary.py on a synthetic GPU trace: bench_matmul.py's busy times and
bench_decode.py's profile summaries come from it, so its interval arithmetic and kernel
categories are checked here."""

import os
import sys

import numpy as np
import pytest

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
    assert lines[0].startswith("one layer's kernels (3, 2 kbit matmul calls; no attention kernel in the trace")
    rows = [line.split(None, 3) for line in lines[1:]]
    # the middle layer (index 2 of 4) starts at its first kbit call
    assert [r[3] for r in rows] == [kbit[:90], "psum_2_fusion", kbit[:90]]
    assert [r[0] for r in rows] == ["0.0", "13.0", "18.5"] and [r[1] for r in rows] == ["0.0", "3.0", "0.5"]
    assert "fewer than two periods" in profile_summary.layer_sequence(profile_summary.kernel_events(trace(events[:3])), 2)


KBIT = "void kbit::cuda::fused::kbit_matmul_ws_kernel<4, kbit::cuda::ActBF16, 1, 1>(kbit::cuda::fused::Params)"
#: One dense decoder layer's kernels as the Pallas path runs them: (name, duration us), the q/k/v
#: product first. Durations are a Llama-3-70B-like step's (H200, 4 bits, batch 1).
LAYER = [(KBIT, 19.6), ("decode_attention_step", 5.9), (KBIT, 13.2), ("add_rms_norm__1", 3.2),
         (KBIT, 70.8), (KBIT, 35.6), ("add_rms_norm__1", 3.3)]
ROLES = {0: "q/k/v", 2: "o_proj", 4: "gate/up", 5: "down"}


def decode_steps(steps, layers, head=(KBIT, 60.0), attention="decode_attention_step", jitter=0.0):
    """(start, end, name) of `steps` decode steps of a dense decoder: the embedding and rotary
    fusions, `layers` layers (`LAYER`), the final norm, the lm_head (None: none) and sampling;
    0.1 us between kernels. With `jitter` each product's time varies by up to that much, fresh
    per call."""
    rng = np.random.default_rng()
    out, t = [], 0.0
    def put(name, dur):
        nonlocal t
        t += 0.1
        out.append((t, t + dur, name))
        t += dur
    for _ in range(steps):
        put("loop_gather_fusion", 1.5)
        put("loop_cosine_fusion", 1.3)
        for _ in range(layers):
            for name, dur in LAYER:
                if name == "decode_attention_step":
                    name = attention
                put(name, dur + (rng.uniform(-jitter, jitter) if name == KBIT else 0.0))
        put("add_rms_norm", 2.7)
        if head:
            put(*head)
        put("input_reduce_fusion", 1.8)
    return out


def test_layer_sequence_starts_at_qkv_with_a_quantized_head():
    # 80 layers and a quantized head: 321 kbit calls per step, so a period of 4 from the first
    # call drifts off the layer; the listing starts at the product before the attention.
    kernels = decode_steps(steps=3, layers=80)
    text = profile_summary.layer_sequence(kernels, period=4)
    lines = text.splitlines()
    assert lines[0].startswith("one layer's kernels (7, from its q/k/v product)") and "role, name" in lines[0]
    rows = [line.split(None, 3) for line in lines[1:]]
    assert [float(r[2]) for r in rows] == [d for _, d in LAYER]
    for k, (name, _) in enumerate(LAYER):
        if k in ROLES:
            assert rows[k][3].split(None, 1) == [ROLES[k], KBIT[:90]]
        else:
            assert rows[k][3] == name
    assert "add_rms_norm " not in text and "input_reduce" not in text   # no step boundary in it


def test_kbit_by_position_from_qkv_with_the_head_counted_apart():
    steps, layers = 4, 10
    kernels = decode_steps(steps, layers, jitter=0.5)
    text = profile_summary.summarize(kernels, steps=steps, period=4)
    assert "not a multiple" not in text
    (header,) = [line for line in text.splitlines() if line.startswith("kbit matmul time by position")]
    # a step's last layer holds the head's call too: 9 whole layers per step
    assert "from the q/k/v product" in header and "9.0 whole layers per step" in header
    rows = {line.split(":")[0].strip(): line.split(":", 1)[1].split()
            for line in text.splitlines() if line.strip().split(":")[0] in ROLES.values()}
    assert list(rows) == ["q/k/v", "o_proj", "gate/up", "down"]
    kbit = [k for k in kernels if k[2] == KBIT]
    per_step = 4 * layers + 1
    for nth, role in enumerate(ROLES.values()):
        # the role's calls in whole layers: the nth product of every layer but a step's last
        times = sorted(kbit[s * per_step + 4 * j + nth][1] - kbit[s * per_step + 4 * j + nth][0]
                       for s in range(steps) for j in range(layers - 1))
        median, low, high, count = rows[role][:4]
        assert float(median) == pytest.approx(times[len(times) // 2], abs=0.06)
        assert float(low) == pytest.approx(times[0], abs=0.06) and float(high) == pytest.approx(times[-1], abs=0.06)
        assert count == "x9.0"
    (apart,) = [line for line in text.splitlines() if "outside whole layers" in line]
    # a step's last layer (four products) and the head, per step
    outside = sum(e - s for step in range(steps)
                  for s, e, _ in kbit[(step + 1) * per_step - 5:(step + 1) * per_step])
    assert apart.split(":")[1].split()[:4] == ["x5.0", "per", "step,", f"{outside / steps:.1f}"]
    (head,) = [line for line in text.splitlines() if "after a layer's 4 products" in line]
    assert head.split(":")[-1].split() == ["x1.0", "per", "step,", "median", "60.0", "us"]


def test_no_attention_kernel_falls_back_to_periods_from_the_first_call():
    # XLA attention: fusions between the products, no attention kernel to anchor a layer on.
    kernels = decode_steps(steps=2, layers=6, head=None, attention="loop_softmax_fusion")
    text = profile_summary.layer_sequence(kernels, period=4)
    assert "first product's role is unknown" in text.splitlines()[0]
    assert "q/k/v" not in text and "o_proj" not in text
    summary = profile_summary.summarize(kernels, steps=2, period=4)
    assert "the first product's role is unknown" in summary
    assert [line.split()[:2] for line in summary.splitlines() if line.strip().startswith("position")] == \
        [["position", f"{k}:"] for k in range(4)]
    # with the head the count is no multiple of the period, and nothing anchors the layers
    with_head = decode_steps(steps=2, layers=6, attention="loop_softmax_fusion")
    assert "not a multiple of 4 and no attention kernel" in profile_summary.summarize(with_head, 2, period=4)


def test_grouped_expert_products_keep_only_the_qkv_label():
    grouped = KBIT.replace("1, 1>", "1, 1, kbit::cuda::fused::GroupParams>")
    # the MLP's products (70.8 and 35.6 us) as grouped expert products
    kernels = [(s, e, grouped if name == KBIT and e - s > 30 else name)
               for s, e, name in decode_steps(steps=2, layers=6, head=None)]
    text = profile_summary.layer_sequence(kernels, period=4)
    assert "q/k/v" in text and "o_proj" not in text and "position 1" in text
