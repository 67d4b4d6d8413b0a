"""benchmarks/nsplit_price_fit.py on the committed fp16 "rows" log of session 42, whose lines carry
the launcher's own plan costs: session 42's fp16 prices in Config::nsplit_price_f16 (cpp/cuda/
matmul_fused.cuh) score as that comment says, and each is inside the fit's best range."""

import os
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import nsplit_price_fit as fit  # noqa: E402

LOG = os.path.join(ROOT, "benchmarks", "results", "nsplit_f16_s42_h100_rows_base.log")
# Config::nsplit_price_f16 by (n8 tiles of the block of rows, bits), as session 42 fitted them;
# session 50 refitted (2, 2) and (2, 4) to 0.4 together with V1's price at 16 rows, on other data
# (tests/test_tiles_price_fit.py)
SESSION42_F16 = {(2, 2): 0.61, (2, 3): 0.8, (2, 4): 0.61, (2, 5): 0.95, (4, 2): 0.9, (4, 3): 0.9,
                (4, 4): 0.9, (4, 5): 0.9, (8, 2): 2.1, (8, 3): 1.7, (8, 4): 1.7, (8, 5): 1.6}
# before session 42: 0.9 at 32 rows, 2.1 at 64, no N-split tiling at M <= 16
BEFORE_F16 = {(t, b): p for t, p in ((4, 0.9), (8, 2.1)) for b in (2, 3, 4, 5)}


def test_session_42s_fp16_prices_score_as_documented():
    cases = fit.parse(LOG)
    assert len(cases) == 572
    mean, (worst, _) = fit.score(cases, SESSION42_F16)
    assert mean < 1.005 and worst < 1.14
    mean_before, (worst_before, where) = fit.score(cases, BEFORE_F16)
    assert 1.014 < mean_before < 1.015 and worst_before > 1.29 and where == "glm4.7.gate_up bits=5 M=64"


def test_each_fp16_price_is_as_good_as_the_best_on_its_cases():
    cases = fit.parse(LOG)
    best, _ = fit.fit(cases)
    for key, price in SESSION42_F16.items():
        sub = [c for c in cases if (fit.m_tiles(c[4]), c[3]) == key]
        ours, theirs = fit.score(sub, {key: price})[0], fit.score(sub, {key: best[key]})[0]
        # 32-row blocks keep the price before: the fit's 1.03-1.06 at bits 2-4 (0.4-0.9 % less on
        # average) makes GLM-4.7 gate/up 1.08-1.14x slower to speed up Llama-3-70B down
        assert ours <= theirs + (0.01 if key[0] == 4 else 1e-9), (key, ours, theirs)


def test_a_log_without_plan_costs_is_refused(tmp_path):
    old = tmp_path / "old.log"
    old.write_text("ROWS qwen3.q 2048 4096 4 16 10.0 11.0 10.0 20.0 1.000 v1/16\n")
    with pytest.raises(SystemExit, match="without the launcher's plan costs"):
        fit.parse(str(old))
