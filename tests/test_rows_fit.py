"""benchmarks/rows_fit.py: its mirror of the launcher's choice between the 16-row tilings and the
N-split tiling must score the prices in Config::chunk_cost (cpp/cuda/matmul_fused.cuh) as that
comment says, on the committed "rows" logs."""

import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import ksplit_fit  # noqa: E402
import rows_fit  # noqa: E402

RESULTS = os.path.join(ROOT, "benchmarks", "results")
# Config::chunk_cost: 32- and 64-row blocks 1.0 and 1.3 (x 0.6 at bits 5)
LAUNCHER = ({4: 1.0, 8: 1.3}, {5: 0.6})
# 16-row blocks, sessions 28-49: 0.6, bits 3 0.8, against V1's chunk at 1.4. Session 50 refitted
# bits 2 and 4 at 16 rows together with V1's price (tests/test_tiles_price_fit.py); rows_fit.py
# mirrors the launcher before that.
SESSION28_16 = ({2: 0.6}, {3: 0.8 / 0.6})


def load(name):
    cases = rows_fit.parse(os.path.join(RESULTS, name))
    return cases, rows_fit.plan_costs(cases, ksplit_fit.parse(rows_fit.SWEEP_LOG)[1])


def test_blocks_of_rows_follow_the_launcher():
    assert [rows_fit.m_tiles(m) for m in (1, 9, 16, 17, 32, 33, 128)] == [2, 2, 2, 4, 4, 8, 8]


def test_prices_above_16_rows_are_the_best_fit():
    cases, costs = load("kernel_rows_nsplit_h200.log")
    (mean, _), factors, modifiers = rows_fit.fit(cases, costs)[0]
    assert (factors, modifiers) == LAUNCHER
    assert 1.006 < mean < 1.007


def test_prices_at_16_rows_take_the_n_split_only_on_wide_gate_up_layers():
    cases, costs = load("nsplit_rows16_h100_s28.log")
    assert len(cases) == 160
    best = rows_fit.fit(cases, costs)[0][0][0]
    mean, _ = rows_fit.score(cases, costs, *SESSION28_16)
    assert mean < 1.001 and abs(mean - best) < 1e-9
    picked = {(c[0], c[3], c[4]) for c, cost in zip(cases, costs) if rows_fit.picks_nsplit(c, cost, *SESSION28_16)}
    assert picked == {(s, bits, 16) for s in ("llama3-8b.gate_up", "llama3-70b.gate_up", "glm4.7.gate_up")
                      for bits in (2, 4)}
    # the measured times agree: 0.88-0.98x the 16-row tilings' where it is taken
    for c in cases:
        if (c[0], c[3], c[4]) in picked:
            assert 0.87 < c[6] / c[5] < 0.99, c
