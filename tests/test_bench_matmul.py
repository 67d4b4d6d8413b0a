"""benchmarks/bench_matmul.py on the CPU: it refuses the busy time (--time busy), which needs a
profile with kernel intervals, and a pass cap below one; its default file names come from the
device, whatever the shapes. (A whole CPU run copies 2 GiB to measure the copy bandwidth, too
slow for CI: the run here gets a stand-in bandwidth.)"""

import os
import sys

import jax
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_matmul  # noqa: E402

cpu_only = pytest.mark.skipif(jax.devices()[0].platform != "cpu", reason="the CPU backend's behaviour")


@cpu_only
def test_busy_time_needs_a_gpu(capsys):
    with pytest.raises(SystemExit):
        bench_matmul.main(["--kn", "64", "128", "--m", "1", "--bits", "4", "--time", "busy"])
    assert "--time busy needs a GPU" in capsys.readouterr().err


@cpu_only
def test_max_passes_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        bench_matmul.main(["--kn", "64", "128", "--m", "1", "--bits", "4", "--max-passes", "0"])
    assert "--max-passes must be at least 1" in capsys.readouterr().err


@cpu_only
def test_results_are_named_after_the_device_not_the_last_shape(tmp_path, monkeypatch):
    monkeypatch.setattr(bench_matmul, "copy_bandwidth", lambda repeats: 1e11)
    monkeypatch.setattr(bench_matmul.render, "main", lambda argv: None)  # (no plot needed here)
    result = bench_matmul.main(["--kn", "64", "128", "--m", "1", "--bits", "4", "--repeats", "1",
                                "--warmup", "0", "--max-passes", "1", "--out", str(tmp_path)])
    assert sorted(os.listdir(tmp_path)) == ["matmul_cpu.json"]
    assert [row["shape"] for row in result["rows"]] == ["64x128"]


@pytest.mark.parametrize("kind, tag", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"),
                                       ("NVIDIA GeForce RTX 4090", "4090"), ("cpu", "cpu"), ("", "device")])
def test_device_tag_names_the_result_files(kind, tag):
    assert bench_matmul.device_tag(kind) == tag
