"""benchmarks/ksplit_fit.py: its mirror of the launcher's k-split choice must pick what the
launcher picked (the committed sweep log was taken with the earlier flat item-end cost), and the
cost model now in the launcher must score as its comment says."""

import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import ksplit_fit  # noqa: E402

LOG = os.path.join(ROOT, "benchmarks", "results", "kernel_sweep_h200.log")


def flat(ks):
    return 0.5 if ks == 1 else 1.0


def current(ks):  # Launcher::launch in cpp/cuda/matmul_fused.cuh (warp-specialized kernel)
    return 0.5 if ks == 1 else 1.0 + 0.5 * ks


def test_mirror_reproduces_the_launcher_that_took_the_log():
    cases, resident = ksplit_fit.parse(LOG)
    assert len(cases) == 102 and resident[1] == 132 and resident[2] == 66
    for k, n, bits, m, name, default_ks, _ in cases:
        assert ksplit_fit.choose(k, n, bits, m, resident, flat) == default_ks, (name, bits, m)


def test_current_model_scores_as_documented():
    cases, resident = ksplit_fit.parse(LOG)
    mean_flat, worst_flat, _ = ksplit_fit.score(cases, resident, flat)
    mean, worst, _ = ksplit_fit.score(cases, resident, current)
    assert 1.019 < mean_flat < 1.021 and 1.41 < worst_flat < 1.42
    assert mean < 1.001 and worst < 1.033


def test_choose_skips_sizes_that_leave_a_rank_empty(tmp_path):
    # K = 10240: 320 k-blocks, 20 chunks; size 8 would give ranks 48 k-blocks (3 chunks) and
    # leave the eighth empty, so it is never picked, however cheap the model makes it.
    resident = {ks: 132 // ks for ks in range(1, 9)}
    picked = ksplit_fit.choose(10240, 2048, 4, 1, resident, lambda ks: 0.0)
    assert picked != 8
    log = tmp_path / "sweep.log"
    log.write_text("device: x\nSWEEP s 10240 2048 4 1 9.00 4 128 " +
                   " ".join(f"{10 - ks}.00/{ks if ks != 8 else 1}/{ks * 32}" for ks in range(1, 9)) + "\n")
    cases, res = ksplit_fit.parse(str(log))
    assert 8 not in cases[0][6] and cases[0][6][7] == 3.0 and res[4] == 32


def test_parse_leaves_out_rows_above_the_mirrored_launcher(tmp_path):
    # a sweep at M = 256 (KBIT_HARNESS_SWEEP_M) times the wgmma kernel, which the mirror does not model
    sizes = " ".join(f"{10.0 + ks:.2f}/{ks}/{132 // ks * ks}" for ks in range(1, 9))
    log = tmp_path / "sweep.log"
    log.write_text(f"SWEEP a 4096 4096 4 16 9.00 2 128 {sizes}\nSWEEP a 4096 4096 4 256 90.00 1 64 {sizes}\n")
    cases, _ = ksplit_fit.parse(str(log))
    assert [c[3] for c in cases] == [16]


def test_main_without_rows_it_models(tmp_path, monkeypatch, capsys):
    # a sweep of larger M only (the wgmma kernel's) leaves nothing to score: a message, no error
    sizes = " ".join(f"{10.0 + ks:.2f}/{ks}/{132 // ks * ks}" for ks in range(1, 9))
    log = tmp_path / "sweep.log"
    log.write_text(f"SWEEP a 4096 4096 4 128 30.00 2 64 {sizes} fused 40.00 tiles 2\n")
    monkeypatch.setattr("sys.argv", ["ksplit_fit.py", str(log)])
    ksplit_fit.main()
    assert "no SWEEP rows with M <= 16" in capsys.readouterr().out
