"""benchmarks/bench_moe.py's results on synthetic rows (no GPU): --merge joins runs made in
parts into one table that names every part's command and the commit."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_moe  # noqa: E402


def row(shape, tokens, kbit_us, floor_us, dense_us=None, bits=4, routing="uniform"):
    return {"shape": shape, "routing": routing, "tokens": tokens, "m": 10 * tokens, "active": 10.0,
            "bits": bits, "kbit_us": kbit_us, "read_mb": 11.2, "pct_copy": 50.0,
            "bf16_floor_us": floor_us, "dense_us": dense_us, "lax_us": None}


def part(tmp_path, name, rows, bw, command):
    result = {"device": "NVIDIA H200", "time": "busy", "jax": "0.11.2", "date": "2026-11-28T00:00:00+00:00",
              "commit": "abc1234", "command": command, "copy_bandwidth_tbs": bw, "rows": rows}
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(result))
    return str(path)


def test_merge_joins_the_parts_rows_commands_and_lowest_bandwidth(tmp_path):
    a = part(tmp_path, "a", [row("qwen3_next_gate_up", 1, 18.0, 10.0), row("qwen3_next_gate_up", 16, 80.0, 140.0, 30.0)],
             4.2, "python benchmarks/bench_moe.py --shapes qwen3_next_gate_up --out a")
    b = part(tmp_path, "b", [row("glm47_flash_down", 1, 12.0, 6.0, bits=2)], 4.1,
             "python benchmarks/bench_moe.py --shapes glm47_flash_down --out b")
    out = str(tmp_path / "merged")
    result = bench_moe.merge(out, [a, b])
    assert [r["shape"] for r in result["rows"]] == ["qwen3_next_gate_up"] * 2 + ["glm47_flash_down"]
    assert result["copy_bandwidth_tbs"] == 4.1
    with open(out + ".json") as f:
        assert json.load(f)["rows"] == result["rows"]
    text = open(out + ".md").read()
    assert "commit abc1234" in text and "copy bandwidth 4.10 TB/s" in text
    assert "    python benchmarks/bench_moe.py --shapes qwen3_next_gate_up --out a\n" in text
    assert "    python benchmarks/bench_moe.py --shapes glm47_flash_down --out b\n" in text
    lines = [line for line in text.splitlines() if line.startswith("| qwen3_next_gate_up")]
    # floor / kbit and dense / kbit derived from the row's times
    assert lines[0].split(" | ")[10:13] == ["0.56", "-", "-"]
    assert lines[1].split(" | ")[10:13] == ["1.75", "30.0", "0.38"]
