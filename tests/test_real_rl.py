"""experiments/real/rl.py at smoke size on a tiny Llama checkpoint with the char tokenizer's chat
template: the arms that exercise every rollout path (dense, R-KV + Sparse-RL, int8 + QuRL, R-KV +
int8 + SortedRL), their table and figure, --replot, and the exact resume of a killed run."""

import json
import re

import jax
import numpy as np
import pytest
from compile_cache import compile_cache_in_process

from experiments.real import rl as real_rl
from sparserl_jax.metrics_log import read_metrics
from sparserl_jax.train import Trainer

jax.devices()  # the backend runs: the runs train in this process (no worker start-up, no pinning)

pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """Every arm and every resumed run is a fresh trainer repeating another's programs: with the
    session's compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    from hf_fixtures import make_tiny_hf_checkpoint

    from sparserl_jax.tokenizer import CharTokenizer

    ckpt = make_tiny_hf_checkpoint("llama", tmp_path_factory.mktemp("ckpt"))
    CharTokenizer().save(ckpt)
    return ckpt


def test_every_arm_has_a_registered_comparison():
    in_comparisons = {n for names, _ in real_rl.COMPARISONS.values() for n in names}
    assert in_comparisons == set(real_rl.ARMS)
    assert all(real_rl.ARMS[n].seeds >= 2 for n in ("dense", "naive_rkv", "sparse_rl_rkv", "int8_naive", "qurl"))


@pytest.mark.extended
@pytest.mark.slow
def test_smoke_arms_table_and_replot(tmp_path, tiny_checkpoint):
    arms = ["dense", "sparse_rl_rkv", "qurl", "stacked"]
    out = tmp_path / "out"
    data = real_rl.main(
        [
            "--smoke",
            "--arms",
            *arms,
            "--seeds",
            "0",
            "--runs-dir",
            str(tmp_path / "runs"),
            "--out",
            str(out),
            f"model.checkpoint={tiny_checkpoint}",
        ]
    )
    res, hist = data["results"], data["histories"]
    assert list(res) == arms and all(len(res[n]) == 1 and len(hist[n][0]) == 2 for n in arms)
    for name in arms:
        r = res[name][0]
        assert 0.0 <= r["dense_acc"] <= 1.0 and r["iterations"] == 2 and r["seconds_per_iteration"] > 0
        assert (r["train_kv_saving"] > 0) == (real_rl.ARMS[name].policy == "rkv")
    assert all("acr/active_frac" in h for h in hist["qurl"][0])
    assert all(h["rollout/bubble_wall"] >= 0 for h in hist["stacked"][0])
    assert 0.0 <= data["meta"]["untrained_dense_acc"] <= 1.0
    # every run is compared with the untrained model evaluated under its own seed's draws
    assert all(
        r["seed"] == 0 and r["untrained_acc"] == data["meta"]["untrained_by_seed"][0]
        for rows in res.values()
        for r in rows
    )
    md = (out / "results.md").read_text()
    assert (
        re.search(r"Command: `(taskset -c [\d,]+ )?python", md)
        and "| stacked (" in md
        and "**Sparse-RL**" in md
        and "paired: sparse_rl_rkv - dense:" in md
    )
    assert (out / "real_rl.png").stat().st_size > 0
    before = json.loads((out / "results.json").read_text())
    (out / "real_rl.png").unlink()
    real_rl.main(["--replot", str(out)])
    assert (out / "real_rl.png").exists() and json.loads((out / "results.json").read_text()) == before
    assert (out / "results.md").read_text() == md


def _numbers(metrics: list[dict]) -> list[dict]:
    """Metrics without wall-clock timings (SortedRL's wall-time bubble is one)."""
    return [
        {k: v for k, v in m.items() if not k.startswith(("time/", "throughput/", "rollout/bubble_wall"))}
        for m in metrics
    ]


def _trained(runs_dir) -> list:
    """The run directories with logged iterations (not the untrained model's)."""
    return [d for d in runs_dir.iterdir() if (d / "metrics.jsonl").exists() and read_metrics(str(d))]


@pytest.mark.extended
@pytest.mark.slow
def test_a_killed_run_resumes_exactly(tmp_path, tiny_checkpoint, monkeypatch):
    """The stacked arm (R-KV + int8 + SortedRL partial, two 2-batch groups) killed during its third
    iteration resumes from the checkpoint at 2 and ends with the uninterrupted run's metrics."""
    common = [
        "--smoke",
        "--arms",
        "stacked",
        "--seeds",
        "0",
        "--eval-prompts",
        "2",
        f"model.checkpoint={tiny_checkpoint}",
        "train.iterations=4",
        "train.save_every=2",
    ]
    real_rl.main([*common, "--runs-dir", str(tmp_path / "whole"), "--out", str(tmp_path / "o1")])

    step = Trainer.step

    def killed_at_3(self):
        if self.iteration == 2:
            raise KeyboardInterrupt("killed")
        return step(self)

    monkeypatch.setattr(Trainer, "step", killed_at_3)
    args = [*common, "--runs-dir", str(tmp_path / "killed"), "--out", str(tmp_path / "o2")]
    with pytest.raises(KeyboardInterrupt):
        real_rl.main(args)
    (run_dir,) = _trained(tmp_path / "killed")
    assert len(read_metrics(str(run_dir))) == 2 and not (run_dir / "done.json").exists()
    monkeypatch.setattr(Trainer, "step", step)
    real_rl.main(args)
    (whole_dir,) = _trained(tmp_path / "whole")
    a, b = _numbers(read_metrics(str(whole_dir))), _numbers(read_metrics(str(run_dir)))
    assert len(a) == 4 and a == b
    assert np.isfinite([m["update/loss"] for m in a]).all()
