"""Experiment scripts run end to end in their smoke mode and write their outputs."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from compile_cache import compile_cache_in_process

from experiments.lib import default_experiment

EXPERIMENTS = Path(__file__).parent.parent / "experiments"

jax.devices()  # the backend runs: workers.parallel_map runs the arms here (no worker start-up)


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """Every arm trains in a fresh trainer whose programs mostly repeat another arm's: with the
    session's compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


@pytest.mark.slow
def test_default_experiment_smoke(tmp_path):
    """`python experiments/default.py --smoke` over two warm starts x one seed, as a user runs it
    (its worker process, here on one core, portable CPU settings): figure a's arms, both collapse
    rules, verdicts per warm start and pooled, provenance, arms.json, and the fingerprint of warm
    start 0, which on the CPU model and jax version that committed it equals
    experiments/results/default/fingerprint_smoke.json bit for bit (what `python
    experiments/bench/fingerprint.py` computes in one process: the same run with one warm start)."""
    from experiments.bench import fingerprint

    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "SPARSERL_PORTABLE_CPU")}
    # on one core (the docs' taskset pinning): one worker process, every program compiled once
    taskset = shutil.which("taskset")
    pin = [taskset, "-c", str(min(os.sched_getaffinity(0)))] if taskset else []
    proc = subprocess.run(
        [
            *pin,
            sys.executable,
            os.path.join(EXPERIMENTS, "default.py"),
            "--smoke",
            "--seeds",
            "0",
            "--warm-starts",
            "0",
            "1",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=EXPERIMENTS,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("results.md", "results.json", "curves.png", "config.yaml", "arms.json"):
        assert (tmp_path / name).stat().st_size > 0, name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["histories"]) == {"dense", "naive_sparse", "sparse_rl"}
    assert all(len(h) == 2 and len(h[0]) == 2 for h in saved["histories"].values())  # runs x iterations
    assert set(saved["warm_starts"]) == {"0", "1"} and saved["provenance"]["portable_cpu"] is True
    md = (tmp_path / "results.md").read_text()
    assert "warm starts (SFT seeds) [0, 1], RL seeds [0] on each: 2 runs per arm" in md
    assert "| warm start 1 |" in md and "| sparse_rl |" in md and " of 2 (at " in md  # both rules
    assert "| sparse_rl - naive_sparse | dense inference, warm start 1 |" in md  # verdict per warm start
    assert "[arms.json](arms.json)" in md
    for arm, rows in saved["per_seed"].items():
        assert [(r["warm_start"], r["seed"]) for r in rows] == [(0, 0), (1, 0)]
        assert all(0.0 <= r["dense_acc"] <= 1.0 and 0.0 <= r["sparse_acc"] <= 1.0 for r in rows)
        assert all((r["train_kv_saving"] > 0.2) == (arm != "dense") for r in rows)  # the sparse arms evict
    arms = json.loads((tmp_path / "arms.json").read_text())["arms"]
    assert arms["sparse_rl/seed0"]["config"]["rl"]["mode"] == "sparse_rl"
    assert arms["naive_sparse/w1/seed0"]["config"]["kv"]["policy"] == "rkv"
    assert arms["dense/seed0"]["config"]["kv"]["policy"] == "none"
    assert arms["dense/w1/seed0"]["config"]["model"]["init_from"].endswith(arms["warm_start1/sft"]["run"])
    assert arms["warm_start1/sft"]["run"] != arms["warm_start0/sft"]["run"]  # two SFT draws
    assert os.path.isdir(tmp_path / "runs")  # a fresh experiment keeps its runs in <out>/runs
    mine = saved["fingerprint"]
    assert set(mine) == {
        "warm_start_params",
        "first_rollout_tokens",
        "first_rollout_logprobs",
        "first_rollout_kept",
        "metrics",
    }
    assert mine["metrics"] == default_experiment.metrics_fingerprint(saved)
    assert default_experiment.metrics_fingerprint(saved, warm=0) != mine["metrics"]  # warm start 1 counts
    committed = json.loads((EXPERIMENTS / "results/default/fingerprint_smoke.json").read_text())
    if (committed["jax"], committed["cpu"]) == (jax.__version__, fingerprint.cpu_model()):
        # bit for bit: the warm start, its first sparse rollout and every arm's metrics at warm start 0
        assert {**mine, "metrics": default_experiment.metrics_fingerprint(saved, warm=0)} == {
            k: committed[k] for k in mine
        }, proc.stdout[-2000:]


@pytest.mark.extended
def test_warm_start_spread_smoke(tmp_path):
    from experiments.figures import warm_start_spread

    out = warm_start_spread.main(
        [
            "--smoke",
            "--seeds",
            "0",
            "1",
            "--budgets",
            "48",
            "--out",
            str(tmp_path),
            "--runs-dir",
            str(tmp_path / "runs"),
            "train.eval_prompts=4",
        ]
    )
    rows = out["rows"]
    assert [r["seed"] for r in rows] == [0, 1]
    assert all(0.0 <= r["dense_acc"] <= 1.0 and 0.0 <= r["sparse_acc@48"] <= 1.0 for r in rows)
    assert all(r["kv_saving@48"] > 0.2 for r in rows)  # budget 48 really evicts
    md = (tmp_path / "results.md").read_text()
    assert "| mean ± std |" in md and "| 1 |" in md
    assert (tmp_path / "spread.png").stat().st_size > 0
