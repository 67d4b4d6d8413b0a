"""benchmarks/targets.py: issue #3's targets scored on synthetic bench_matmul results."""

import json
import os
import random
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import targets  # noqa: E402
from shapes import BITS, M_VALUES, SHAPES  # noqa: E402


def random_result(rng, drop=()):
    """A bench_matmul result with every shape x M x bits row (bf16 and fp16), random speedups
    and copy fractions, less the (shape, m, bits) keys in `drop`."""
    rows = []
    for shape in SHAPES:
        for m in M_VALUES:
            for bits in BITS:
                for dtype in ("bfloat16", "float16"):
                    if dtype == "bfloat16" and (shape, m, bits) in drop:
                        continue
                    rows.append(dict(shape=shape, m=m, bits=bits, dtype=dtype, speedup=rng.uniform(0.5, 3.0),
                                     bw_fraction=rng.uniform(0.2, 0.95)))
    return dict(device="test GPU", date="today", rows=rows)


def expected_counts(result):
    """The three targets' (met, scored) counts, computed here from the definitions in the issue."""
    bf16 = {(r["shape"], r["m"], r["bits"]): r for r in result["rows"] if r["dtype"] == "bfloat16"}
    llama = [k for k in bf16 if k[0] in targets.LLAMA and k[1] in (1, 16)]
    small = [k for k in bf16 if k[0] in targets.SMALL and 1 <= k[1] <= 16 and k[2] == 4]
    return [(sum(bf16[k]["bw_fraction"] >= 0.70 for k in llama), len(llama)),
            (sum(bf16[k]["speedup"] >= 1.5 for k in small), len(small)),
            (sum(r["speedup"] >= 0.9 for r in bf16.values()), len(bf16))]


def test_counts_match_the_issue_definitions():
    rng = random.Random()
    result = random_result(rng)
    scored = targets.score(targets.bf16_rows(result))
    assert [(sum(ok for _, _, ok in t["rows"]), len(t["rows"])) for t in scored] == expected_counts(result)
    # 4 layers x M 1, 16 x bits 2..5; 6 layers x M 1, 4, 16 at K = 4; every bf16 row
    assert [len(t["rows"]) for t in scored] == [32, 18, len(SHAPES) * len(M_VALUES) * len(BITS)]
    assert all(not t["missing"] for t in scored)


def test_thresholds_are_inclusive():
    rows = {("llama3_8b_down", 1, 4): dict(bw_fraction=0.70, speedup=0.9),
            ("qwen3_q", 4, 4): dict(bw_fraction=0.1, speedup=1.5)}
    llama, small, every = targets.score(rows)
    assert [ok for _, _, ok in llama["rows"]] == [True]
    assert [ok for _, _, ok in small["rows"]] == [True]
    assert all(ok for _, _, ok in every["rows"])


def test_missing_rows_are_listed_not_scored(tmp_path, capsys):
    rng = random.Random()
    drop = {("llama3_70b_down", 16, 3), ("qwen3_o", 4, 4)}
    result = random_result(rng, drop)
    llama, small, every = targets.score(targets.bf16_rows(result))
    assert llama["missing"] == [("llama3_70b_down", 16, 3)] and len(llama["rows"]) == 31
    assert small["missing"] == [("qwen3_o", 4, 4)] and len(small["rows"]) == 17
    path = tmp_path / "matmul.json"
    path.write_text(json.dumps(result))
    targets.main([str(path)])
    out = capsys.readouterr().out
    assert "| llama3_70b_down | 16 | 3 | - | not measured |" in out
    assert "(1 not in the result)" in out
    # target 3 lists only its misses unless asked for every row
    misses = sum(1 for r in result["rows"] if r["dtype"] == "bfloat16" and r["speedup"] < 0.9)
    section = out.split("## Every row")[1]
    assert section.count("| no |") == misses and "| yes |" not in section
