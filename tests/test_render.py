"""benchmarks/render.py on synthetic bench_matmul results: --merge, --compare and the summary
table (no GPU)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import render  # noqa: E402


def row(shape, m, kbit_us, dense_us, bits=4):
    return {"shape": shape, "k": 4096, "n": 1024, "m": m, "bits": bits, "dtype": "bfloat16",
            "kbit_us": kbit_us, "dense_us": dense_us, "speedup": dense_us / kbit_us,
            "bw_fraction": 0.5, "floor_us": 1.0, "dense_other_us": dense_us}


def result(rows, device="NVIDIA H200", bw=4.2):
    return {"device": device, "jax": "0.11.2", "date": "2026-11-25", "copy_bandwidth_tbs": bw,
            "method": "auto", "rows": rows}


def test_compare_pairs_rows_and_reports_the_median_ratio():
    base = result([row("a", 1, 10.0, 20.0), row("a", 16, 20.0, 25.0), row("b", 1, 8.0, 9.0)])
    new = result([row("a", 16, 15.0, 25.0), row("a", 1, 11.0, 20.0), row("a", 1, 9.0, 20.0, bits=2)])
    text = render.compare(base, new)
    lines = text.splitlines()
    assert lines[2] == "| a (4096x1024) | bfloat16 | 16 | 4 | 20.0 | 15.0 | 0.750 | 25.0 / 25.0 | 1.67x |"
    assert lines[3] == "| a (4096x1024) | bfloat16 | 1 | 4 | 10.0 | 11.0 | 1.100 | 20.0 / 20.0 | 1.82x |"
    assert "median 0.925 (0.750 .. 1.100) over 2 rows" in text
    assert "(1 rows of the new run have no partner in the base run)" in text  # the bits-2 row


def test_compare_refuses_runs_of_two_devices():
    with pytest.raises(SystemExit, match="different devices"):
        render.compare(result([], device="NVIDIA H200"), result([], device="NVIDIA H100 80GB HBM3"))


def test_merge_keeps_every_row_and_each_part_header(tmp_path):
    paths = []
    for i, rows in enumerate([[row("a", 1, 10.0, 20.0)], [row("b", 1, 8.0, 9.0)]]):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(result(rows, bw=(4.1, 4.2)[i])))
    merged = render.merge([str(p) for p in paths])
    assert [r["shape"] for r in merged["rows"]] == ["a", "b"]
    assert [p["copy_bandwidth_tbs"] for p in merged["parts"]] == [4.1, 4.2]
    assert "2 runs merged" in render.markdown(merged)


def test_merge_lets_a_later_part_replace_a_row_in_its_place(tmp_path):
    parts = [[row("a", 1, 10.0, 20.0), row("a", 16, 30.0, 40.0), row("b", 1, 8.0, 9.0)],
             [row("a", 16, 25.0, 39.0), row("c", 1, 5.0, 6.0)]]
    paths = []
    for i, rows in enumerate(parts):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(result(rows)))
    merged = render.merge([str(p) for p in paths])
    assert [(r["shape"], r["m"], r["kbit_us"], r["part"]) for r in merged["rows"]] == [
        ("a", 1, 10.0, 0), ("a", 16, 25.0, 1), ("b", 1, 8.0, 0), ("c", 1, 5.0, 1)]


def test_merge_of_a_merge_keeps_its_parts(tmp_path):
    paths = []
    for i, rows in enumerate([[row("a", 1, 10.0, 20.0)], [row("b", 1, 8.0, 9.0)], [row("a", 1, 7.0, 19.0)]]):
        paths.append(tmp_path / f"part{i}.json")
        paths[-1].write_text(json.dumps(result(rows, bw=(4.1, 4.2, 4.3)[i])))
    first = tmp_path / "first.json"
    first.write_text(json.dumps(render.merge([str(paths[0]), str(paths[1])])))
    merged = render.merge([str(first), str(paths[2])])
    assert [p["copy_bandwidth_tbs"] for p in merged["parts"]] == [4.1, 4.2, 4.3]
    assert [(r["shape"], r["kbit_us"], r["part"]) for r in merged["rows"]] == [("a", 7.0, 2), ("b", 8.0, 1)]
    assert "3 runs merged" in render.markdown(merged)


def test_main_compare_prints_the_table(tmp_path, capsys):
    for name, t in (("base", 10.0), ("new", 5.0)):
        (tmp_path / f"{name}.json").write_text(json.dumps(result([row("a", 1, t, 20.0)])))
    render.main(["--compare", str(tmp_path / "base.json"), str(tmp_path / "new.json")])
    assert "| 10.0 | 5.0 | 0.500 |" in capsys.readouterr().out


def test_a_busy_timed_run_says_so_and_marks_no_row(tmp_path):
    host_bound = dict(row("a", 1, 5.0, 6.0), host_bound=True, kbit_call_us=11.0)
    call_timed = result([host_bound])
    assert "| 5.0* |" in render.markdown(call_timed)       # the busy time stood in for the call's
    busy_timed = dict(result([host_bound]), timing="busy")
    text = render.markdown(busy_timed)
    assert "Every kbit and dense time is the device's busy time" in text and "*" not in text.split("|---")[-1]


def test_merge_refuses_runs_of_two_timings_and_compare_names_them(tmp_path):
    paths = [tmp_path / "call.json", tmp_path / "busy.json"]
    paths[0].write_text(json.dumps(result([row("a", 1, 10.0, 20.0)])))               # before --time: call
    paths[1].write_text(json.dumps(dict(result([row("b", 1, 8.0, 9.0)]), timing="busy")))
    with pytest.raises(SystemExit, match="different timings"):
        render.merge([str(p) for p in paths])
    text = render.compare(result([row("a", 1, 10.0, 20.0)]), dict(result([row("a", 1, 9.0, 20.0)]), timing="busy"))
    assert text.startswith("(base times are call times, new times busy times")


def test_summary_gives_the_geometric_mean_and_range_by_m_and_bits():
    rows = [row("a", 1, 10.0, 20.0), row("b", 1, 10.0, 80.0), row("a", 16, 10.0, 10.0),
            row("a", 1, 10.0, 30.0, bits=2), dict(row("a", 1, 1.0, 100.0), dtype="float16")]
    lines = render.summary(result(rows)).splitlines()
    assert lines[0] == "Speedup over the dense bfloat16 dot, geometric mean over 2 shapes (lowest-highest):"
    assert lines[2] == "| M | bits 2 | bits 4 |"
    assert lines[4] == "| 1 | 3.00x (3.00-3.00) | 4.00x (2.00-8.00) |"   # sqrt(2 * 8); fp16 row left out
    assert lines[5] == "| 16 |  | 1.00x (1.00-1.00) |"
    assert render.summary(result([])) == ""
    assert "| 1 | 3.00x (3.00-3.00) | 4.00x (2.00-8.00) |" in render.markdown(result(rows))
