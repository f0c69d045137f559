"""Experiment scripts run end to end in their smoke mode and write their outputs."""

import json
import os
import sys

import jax

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))

import default as default_experiment  # noqa: E402

jax.devices()  # the backend runs: workers.parallel_map runs the arms here (no worker start-up)


def test_default_experiment_smoke(tmp_path):
    results = default_experiment.main(["--smoke", "--seeds", "0", "--out", str(tmp_path)])
    for name in ("results.md", "results.json", "curves.png", "config.yaml"):
        assert (tmp_path / name).stat().st_size > 0, name
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["histories"]) == {"dense", "naive_sparse", "sparse_rl"}
    assert all(len(h) == 1 and len(h[0]) == 2 for h in saved["histories"].values())  # seeds x iterations
    assert "over 1 seed(s) (train.seed 0;" in (tmp_path / "results.md").read_text()
    for arm in ("warm_start", "dense", "naive_sparse", "sparse_rl"):
        assert 0.0 <= results[arm]["dense_acc"] <= 1.0 and 0.0 <= results[arm]["sparse_acc"] <= 1.0
    assert results["dense"]["train_kv_saving"] == 0.0
    assert results["sparse_rl"]["train_kv_saving"] > 0.2  # the sparse arms really evict
    assert "| sparse_rl |" in (tmp_path / "results.md").read_text()
    assert " of 1 |" in (tmp_path / "results.md").read_text()  # collapsed seeds, k of n
    arms = json.loads((tmp_path / "arms.json").read_text())["arms"]
    assert arms["sparse_rl"][0]["config"]["rl"]["mode"] == "sparse_rl"
    assert arms["naive_sparse"][0]["config"]["kv"]["policy"] == "rkv"
    assert arms["dense"][0]["config"]["kv"]["policy"] == "none"
    assert set(results["fingerprint"]) == {"warm_start_params", "first_rollout_tokens",
                                           "first_rollout_logprobs", "first_rollout_kept", "metrics"}


def test_warm_start_spread_smoke(tmp_path):
    import warm_start_spread

    out = warm_start_spread.main(["--smoke", "--seeds", "0", "1", "--budgets", "48",
                                  "--out", str(tmp_path), "train.eval_prompts=4"])
    rows = out["rows"]
    assert [r["seed"] for r in rows] == [0, 1]
    assert all(0.0 <= r["dense_acc"] <= 1.0 and 0.0 <= r["sparse_acc@48"] <= 1.0 for r in rows)
    assert all(r["kv_saving@48"] > 0.2 for r in rows)  # budget 48 really evicts
    md = (tmp_path / "results.md").read_text()
    assert "| mean ± std |" in md and "| 1 |" in md
