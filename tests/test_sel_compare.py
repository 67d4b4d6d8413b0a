"""benchmarks/sel_compare.py on synthetic harness logs: the kernel before/after table in
benchmarks/results/kernel_sel_h200.md comes from it."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import sel_compare  # noqa: E402


def sel_line(shape, k, n, bits, m, us, pct):
    return f"SEL {shape:18s} {k:5d} {n:6d} {bits} {m:2d} {us + 1:8.2f} {us:8.2f} {us:8.2f} {1000:6.0f} {pct:5.1f}"


LOG_A = "\n".join([
    "device: NVIDIA H200; device-to-device copy: 4242 GB/s",
    sel_line("big", 8192, 28672, 4, 1, 50.0, 50.0),
    sel_line("big", 8192, 28672, 4, 16, 120.0, 20.0),
    "  ERROR something that is not a row",
    sel_line("new_shape", 2048, 4096, 2, 1, 9.0, 6.0),
])


def test_parse_keeps_rows_in_order_and_skips_other_lines():
    rows = sel_compare.parse_sel(LOG_A)
    assert list(rows) == [("big", 4, 1), ("big", 4, 16), ("new_shape", 2, 1)]
    r = rows[("big", 4, 1)]
    assert (r.k, r.n, r.us, r.pct_copy) == (8192, 28672, 50.0, 50.0)


def test_median_over_runs_and_ratio_groups():
    runs = [sel_compare.parse_sel("\n".join([sel_line("big", 8192, 28672, 4, 1, us, 1.0),
                                             sel_line("big", 8192, 28672, 4, 16, 2 * us, 1.0)]))
            for us in (40.0, 100.0, 60.0)]
    med = sel_compare.median_rows(runs)
    assert med[("big", 4, 1)].us == 60.0 and med[("big", 4, 16)].us == 120.0
    after = sel_compare.parse_sel(LOG_A)
    summary = sel_compare.ratio_summary(after, med)
    # new_shape has no baseline and is left out of the ratios
    assert summary["M<=8"] == (50.0 / 60.0,) * 3
    assert summary["M=16"] == (1.0,) * 3


def test_markdown_table_leaves_missing_baselines_empty():
    after = sel_compare.parse_sel(LOG_A)
    before = {k: v for k, v in after.items() if k[0] == "big"}
    table = sel_compare.markdown_table(after, before).splitlines()
    assert table[0].startswith("| shape (K x N) | bits | M | before us | after us |")
    assert table[2] == "| big (8192 x 28672) | 4 | 1 | 50.0 | 50.0 | 50.0 |"
    assert table[4] == "| new_shape (2048 x 4096) | 2 | 1 |  | 9.0 | 6.0 |"
