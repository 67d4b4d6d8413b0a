"""benchmarks/bench_decode.py's driver logic without a GPU: the exclusive split of a profiled
step (products / all-reduces / glue / idle) and the concurrent scheduling of workers on
disjoint GPUs (with stand-in workers), and its argument checks."""

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_decode  # noqa: E402
import profile_summary  # noqa: E402


def test_time_split_counts_each_instant_once(rng):
    names = {"products": "kbit_matmul_ws_kernel<4>", "all-reduces": "ncclDevKernel_AllReduce_Sum_bf16",
             "glue": "loop_multiply_fusion", "xla collective": "one_shot_all_reduce_kernel"}
    # Random kernels on a timeline; the split must sum to the span, and an instant covered by
    # several kernels goes to the one that started first.
    kernels, t = [], 0.0
    for _ in range(200):
        t += float(rng.uniform(0, 5))
        kernels.append((t, t + float(rng.uniform(0.1, 8)), names[rng.choice(list(names))]))
    kernels.sort()
    split = bench_decode.time_split(kernels, profile_summary.category)
    span = max(e for _, e, _ in kernels) - kernels[0][0]
    assert sum(split.values()) == pytest.approx(span)
    assert split["idle"] == pytest.approx(span - profile_summary.busy_us(kernels))

    # A hand-made step: matmul 0-10 with a dependent fusion launched at 8 (ends 12), a gap,
    # an all-reduce 14-16 (NCCL) and XLA's own all-reduce kernel 16-17, glue 17-20.
    step = [(0.0, 10.0, names["products"]), (8.0, 12.0, names["glue"]), (14.0, 16.0, names["all-reduces"]),
            (16.0, 17.0, names["xla collective"]), (17.0, 20.0, names["glue"])]
    assert bench_decode.time_split(step, profile_summary.category) == {
        "products": 10.0, "all-reduces": 3.0, "glue": 5.0, "idle": 2.0}
    assert bench_decode.time_split([], profile_summary.category) == dict.fromkeys(
        ("products", "all-reduces", "glue", "idle"), 0.0)


class FakeProc:
    """A worker that 'runs' for `seconds` of wall time."""

    def __init__(self, seconds):
        self.end = time.monotonic() + seconds
        self.returncode = None

    def poll(self):
        if time.monotonic() >= self.end:
            self.returncode = 0
        return self.returncode


def test_concurrent_workers_never_share_a_gpu(monkeypatch):
    running, log = {}, []

    def start(args, config, weights, tp, modes, xla_flags="", gpus=None):
        assert len(gpus) == min(tp, 4)
        busy = {g for w in running.values() for g in w["gpus"]}      # started, not finished
        assert not busy & set(gpus), (gpus, busy)
        worker = {"proc": FakeProc(0.05 * tp), "gpus": gpus, "job": (weights, tp)}
        running[id(worker)] = worker
        log.append((weights, tp, tuple(gpus)))
        return worker

    def finish(worker):
        del running[id(worker)]
        weights, tp = worker["job"]
        return [{"weights": weights, "tp": tp, "gpus": worker["gpus"], "status": "ok"}]

    monkeypatch.setattr(bench_decode, "start_worker", start)
    monkeypatch.setattr(bench_decode, "finish_worker", finish)
    modes = {"attention": "auto", "norm": "auto", "mlp_gate": "auto"}
    jobs = [("llama3-70b", w, tp, modes, "") for tp in (1, 2, 4) for w in ("bf16", "4", "2")]
    jobs.append(("llama3-70b", "4", 8, modes, ""))      # more than the machine has
    rows = bench_decode.run_concurrent(None, jobs, ["0", "1", "2", "3"])
    # Rows come back in the order of the jobs, each once, marked concurrent.
    assert [(r["weights"], r["tp"]) for r in rows] == [(w, tp) for _, w, tp, _, _ in jobs]
    assert all(r["concurrent"] for r in rows)
    # The largest tp starts first; tp 4 (and 8, capped) hold all four GPUs.
    assert log[0][1] == 8 and log[0][2] == ("0", "1", "2", "3")
    assert all(len(g) == 4 for _, tp, g in log if tp >= 4)


def test_in_process_refuses_xla_flags_and_concurrency(capsys):
    for extra in (["--xla-flags=--xla_gpu_enable_latency_hiding_scheduler=true"], ["--concurrent"]):
        with pytest.raises(SystemExit):
            bench_decode.parse_args(["--in-process", *extra])
        assert "--in-process runs in this process" in capsys.readouterr().err
    args = bench_decode.parse_args(["--xla-flags=", "--xla-flags=--xla_a=1 --xla_b=2"])
    assert args.xla_flags == ["", "--xla_a=1 --xla_b=2"]


def test_moe_configs_fit_estimate_and_layers():
    """The fit check of the MoE-class configs on one 141 GB H200: the 80B class fits at K=4 and
    not in bf16, its 12-layer variant in bf16 with room; expert parallelism splits the experts."""
    from kbit_jax.models import config, decoder

    h200 = 141e9
    qcn = decoder.CONFIGS["qwen3-coder-next"]
    assert bench_decode.weight_bytes(qcn, 4) < 0.35 * h200 < h200 < bench_decode.weight_bytes(qcn, None)
    assert bench_decode.weight_bytes(decoder.CONFIGS["qwen3-coder-next-12l"], None) < 0.35 * h200
    assert bench_decode.weight_bytes(qcn, None, tp=2) < 0.6 * bench_decode.weight_bytes(qcn, None)
    for name in ("glm-4.7-flash", "qwen3-30b-a3b"):
        assert bench_decode.weight_bytes(decoder.CONFIGS[name], None) < 0.5 * h200
    # bf16 bytes of a model are its parameters times 2 (the estimate misses nothing).
    for cfg in (decoder.CONFIGS["tiny-moe"], decoder.LLAMA3_8B, qcn):
        assert bench_decode.weight_bytes(cfg, None) == 2 * cfg.num_params()
    assert set(bench_decode.DEFAULT_WEIGHTS) == set(decoder.CONFIGS)
    args = bench_decode.parse_args(["--configs", "qwen3-coder-next", "--layers", "12"])
    assert args.layers == 12 and config.with_layers(qcn, args.layers) == decoder.CONFIGS["qwen3-coder-next-12l"]
    row = {"config": "qwen3-coder-next", "layers": 12, "layers_override": True}
    assert bench_decode.config_cell(row) == "qwen3-coder-next (12 layers)"
    assert bench_decode.config_cell({**row, "layers_override": False}) == "qwen3-coder-next"


def test_attention_parallel_rows():
    """--attention-parallel: a comma list of placements (bad values refused); replicated
    attention keeps every device's copy of q/k/v/o (the estimate grows by the attention's
    other shards); the markdown cell shows what "auto" resolved to, and rows of runs before the
    option ran tensor-parallel attention."""
    from kbit_jax.models import decoder

    args = bench_decode.parse_args(["--attention-parallel", "replicated,tensor"])
    assert args.attention_parallel == "replicated,tensor"
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--attention-parallel", "heads"])
    qcn = decoder.CONFIGS["qwen3-coder-next"]
    attn = qcn.n_layers * qcn.dim * qcn.head_dim * (2 * qcn.n_heads + 2 * qcn.n_kv_heads)
    tensor = bench_decode.weight_bytes(qcn, 4, tp=2)
    replicated = bench_decode.weight_bytes(qcn, 4, tp=2, attention="replicated")
    assert replicated - tensor == pytest.approx(attn / 2 * 4.25 / 8)
    assert bench_decode.weight_bytes(qcn, 4, tp=1, attention="replicated") == bench_decode.weight_bytes(qcn, 4)
    row = {"attention_parallel": "auto", "attention_placement": "replicated"}
    assert bench_decode.mode_cell(row, "attention_parallel") == "auto (replicated)"
    assert bench_decode.mode_cell({"attention_parallel": "tensor"}, "attention_parallel") == "tensor"
    assert bench_decode.mode_cell({}, "attention_parallel") == "tensor"
    assert bench_decode.mode_cell({}, "norm") == "xla"


def test_a_run_cut_short_keeps_the_rows_of_its_finished_workers(monkeypatch, tmp_path):
    """Workers run one after the other write the results after each of them: a run stopped
    during its second worker (a timeout, an out-of-memory kill) keeps the first one's row."""
    import json

    calls = []

    def worker(args, config, weights, tp, modes, xla_flags=""):
        calls.append(weights)
        if len(calls) == 2:
            raise KeyboardInterrupt   # the run is stopped while this worker runs
        return [{"config": config, "weights": weights, "tp": tp, "status": "ok", **modes}]

    monkeypatch.setattr(bench_decode, "run_subprocess", worker)
    monkeypatch.setattr(bench_decode, "environment", lambda: {"platform": "cpu"})
    monkeypatch.setattr(bench_decode, "to_markdown", lambda env, args, rows: f"{len(rows)} rows\n")
    with pytest.raises(KeyboardInterrupt):
        bench_decode.main(["--configs", "tiny", "--weights", "bf16,4", "--batches", "1",
                           "--out", str(tmp_path), "--name", "cut"])
    saved = json.loads((tmp_path / "cut.json").read_text())
    assert [r["weights"] for r in saved["results"]] == ["bf16"]
    assert (tmp_path / "cut.md").read_text() == "1 rows\n"


def test_moe_routing_rows(monkeypatch, tmp_path):
    """--moe-routing: a comma list of routing methods (bad values refused), each a row of the MoE
    configs and one row of a dense config; rows of runs before the option routed through XLA."""
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--moe-routing", "fast"])
    jobs = []

    def worker(args, config, weights, tp, modes, xla_flags=""):
        jobs.append((config, modes["moe_routing"]))
        return [{"config": config, "weights": weights, "tp": tp, "status": "ok", **modes}]

    monkeypatch.setattr(bench_decode, "run_subprocess", worker)
    monkeypatch.setattr(bench_decode, "environment", lambda: {"platform": "cpu"})
    monkeypatch.setattr(bench_decode, "to_markdown", lambda env, args, rows: f"{len(rows)} rows\n")
    bench_decode.main(["--configs", "tiny-moe,tiny", "--weights", "4", "--batches", "1",
                       "--moe-routing", "auto,compare", "--out", str(tmp_path), "--name", "routing"])
    assert jobs == [("tiny-moe", "auto"), ("tiny-moe", "compare"), ("tiny", "auto")]
    assert bench_decode.mode_cell({}, "moe_routing") == "auto (no kernel)"
    assert bench_decode.mode_cell({"moe_routing": "kernel"}, "moe_routing") == "kernel"


def test_head_quantized_unless_dense_head(monkeypatch):
    """The k-bit models' lm_head is quantized unless --dense-head: the flag reaches the
    worker's command line and the table's header, and the fit estimate counts the head at
    k bits (a tied embedding keeps its bf16 table and gets a k-bit copy as the head)."""
    from kbit_jax.models import config, decoder

    default, dense = bench_decode.parse_args([]), bench_decode.parse_args(["--dense-head"])
    assert not default.dense_head and dense.dense_head
    with pytest.raises(SystemExit):
        bench_decode.parse_args(["--quantize-head"])
    commands = []
    monkeypatch.setattr(bench_decode.subprocess, "Popen", lambda cmd, **kw: commands.append(cmd))
    modes = dict.fromkeys(bench_decode.MODES, "auto")
    for args in (default, dense):
        bench_decode.start_worker(args, "tiny", "4", 1, modes)
    assert "--dense-head" not in commands[0] and "--dense-head" in commands[1]
    assert "lm_head quantized;" in bench_decode.to_markdown({}, default, [])
    assert "lm_head bf16;" in bench_decode.to_markdown({}, dense, [])

    cfg = decoder.LLAMA3_8B
    head = cfg.dim * cfg.vocab_size
    k4 = bench_decode.weight_bytes(cfg, 4)
    assert bench_decode.weight_bytes(cfg, 4, quantize_head=False) - k4 == pytest.approx(head * (2 - 4.25 / 8))
    assert bench_decode.weight_bytes(cfg, None, quantize_head=True) == 2 * cfg.num_params()
    tied = config.DecoderConfig(**{**cfg.to_dict(), "tie_embeddings": True})
    assert bench_decode.weight_bytes(tied, 4) - bench_decode.weight_bytes(tied, 4, quantize_head=False) \
        == pytest.approx(head * 4.25 / 8)
