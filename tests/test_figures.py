"""Every figure script runs end to end in its smoke mode (seconds-long runs) and writes its PNG,
markdown table and JSON with the command; the scripts share one run cache, as in real use."""

import argparse
import dataclasses
import filecmp
import json
import os
import re
import shutil

import jax
import numpy as np
import pytest
from compile_cache import compile_cache_in_process

from experiments.figures import (
    calibrate_task,
    fig_b_budget,
    fig_c_policies,
    fig_d_corrections,
    fig_e_robustness,
    fig_f_throughput,
    fig_qurl,
    fig_sortedrl,
    fig_tail,
    memo_choice,
    warm_start_spread,
)
from experiments.lib import curves as fig_a_curves
from experiments.lib import default_experiment, figlib
from experiments.real import rl as real_rl
from sparserl_jax.config import load_config

pytestmark = pytest.mark.xdist_group("figures")
jax.devices()  # the backend runs: Study.train_all trains here (no worker start-up)


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """Every arm trains in a fresh trainer whose programs mostly repeat another arm's: with the
    session's compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("runs"))


def _outputs(out, png, arms=True):
    """The scaffold's outputs: results.md with the command and its provenance, results.json with
    both, the PNG, and (scripts that train) arms.json with every run's resolved config."""
    for name in ("results.md", "results.json", f"{png}.png") + (("arms.json", "config.yaml") if arms else ()):
        assert (out / name).stat().st_size > 0, name
    saved = json.loads((out / "results.json").read_text())
    assert re.match(r"(taskset -c [\d,]+ )?python ", saved["command"])
    md = (out / "results.md").read_text()
    assert f"Command: `{saved['command']}`" in md
    prov = saved["provenance"]
    assert prov["portable_cpu"] is True and prov["jax"] == jax.__version__ and prov["cpu"]
    assert f"Provenance: commit {prov['commit']}" in md and prov["cpu"] in md
    if arms:
        assert "[arms.json](arms.json)" in md
        resolved = json.loads((out / "arms.json").read_text())["arms"]
        assert resolved and all(a["config"]["train"]["iterations"] >= 0 for a in resolved.values())
    return saved


def _acc_ok(x):
    return all(0.0 <= v <= 1.0 for v in (x if isinstance(x, list) else [x]))


def test_fig_a_curves(runs_dir, tmp_path):
    """Figure a (one warm start; tests/test_experiments.py runs the same code over two): rows carry
    their warm start and seed, both collapse rules are in the table, the tie rule's verdicts."""
    data = fig_a_curves.main(["--smoke", "--seeds", "0", "--out", str(tmp_path), "--runs-dir", runs_dir])
    saved = _outputs(tmp_path, "curves")
    assert set(saved["per_seed"]) == {"dense", "naive_sparse", "sparse_rl"} and set(saved["warm_starts"]) == {"0"}
    for arm, rows in data["per_seed"].items():
        assert [(r["warm_start"], r["seed"]) for r in rows] == [(0, 0)]
        assert all(_acc_ok(r["dense_acc"]) and _acc_ok(r["sparse_acc"]) for r in rows)
        assert all((r["train_kv_saving"] > 0.2) == (arm != "dense") for r in rows)
    assert all(len(h) == 2 for h in data["histories"]["sparse_rl"])
    # smoke runs evaluate on the held-out prompts every iteration (--eval-every, default 10)
    assert all(_acc_ok(row["eval/accuracy"]) for h in data["histories"]["sparse_rl"] for row in h)
    md = (tmp_path / "results.md").read_text()
    assert "| sparse_rl |" in md and " of 1 | 0 of 1 (at -) |" in md  # both collapse rules
    assert "| sparse_rl - naive_sparse | dense inference |" in md and "verdict (tie rule)" in md
    assert "lines with dots, held-out accuracy logged during training" in md  # the caption
    assert (tmp_path / "diagnostics.png").stat().st_size > 0
    assert "loop fraction" in md
    assert all(np.isfinite(d["diag/loop_fraction"]) for d in saved["diagnostics"]["sparse_rl"])
    arms = json.loads((tmp_path / "arms.json").read_text())["arms"]
    assert arms["sparse_rl/seed0"]["config"]["model"]["init_from"].endswith(arms["warm_start0/sft"]["run"])


WALK = os.path.join(figlib.HERE, "configs", "walk_memo.yaml")
WALK_SMOKE = ["--smoke", "--config", WALK, "rollout.max_new_tokens=48", "kv.budget=32"]


@pytest.mark.extended
def test_paper_regime_figure_a(runs_dir, tmp_path):
    """Figure a on the second regime (cycle_walk, uncompressed prompt, the response evicts its own
    early lines), written to its own results directory (b, d and e share a's code paths)."""
    a = fig_a_curves.main(WALK_SMOKE + ["--seeds", "0", "--out", str(tmp_path / "a"), "--runs-dir", runs_dir])
    _outputs(tmp_path / "a", "curves")
    warm = a["warm_starts"]["0"]
    assert np.isfinite(warm["mismatch_kl_k3"]) and warm["mismatch_kl_k3"] >= 0.0
    hist = a["histories"]["naive_sparse"][0]
    assert all(h["kv/saving"] > 0.0 for h in hist)  # 18-token prompt + 48 tokens > 32 + 16 slots
    assert "Task cycle_walk" in (tmp_path / "a" / "results.md").read_text()
    assert figlib.default_out("fig_a_curves", WALK).endswith(os.path.join("fig_a_curves", "walk_memo"))
    assert figlib.default_out("fig_a_curves", figlib.DEFAULT_CONFIG).endswith("fig_a_curves")


@pytest.mark.extended
def test_fig_tail_calibrates_a_schedule_and_trains_naive_with_it(runs_dir, tmp_path):
    """Figure tail (experiments/figures/fig_tail.py) at smoke size: the warm start's tail per bin for each fixed budget, the schedule
    calibrated sequentially from them (its own measured row), and naive sparse training at the base
    budget, the reference budget and the schedule, with the claims read at every run."""
    argv = ["--smoke", "--budgets", "32", "48", "--base", "32", "--reference", "48", "--seeds", "0"]
    data = fig_tail.main(
        [*argv, "--warm-starts", "0", "--every", "32", "--tail-prompts", "4"]
        + ["--out", str(tmp_path), "--runs-dir", runs_dir]
    )
    _outputs(tmp_path, "tail")
    cal = data["calibration"]
    assert set(data["schedule"]) <= {32, 48} and cal["schedule_row"]["arm"]["schedule"] == data["schedule"]
    assert [r["arm"]["budget"] for r in cal["fixed"]] == [32, 48]
    assert data["tau"] == cal["fixed"][1]["agreement_p5"] and 0.0 < data["tau"] <= 1.0
    assert cal["fixed"][0]["kv_saving"] > cal["fixed"][1]["kv_saving"]  # the smaller budget keeps fewer entries
    assert set(data["results"]) == {"base", "reference", "schedule"}
    assert f"kv.budget_schedule=[{','.join(map(str, data['schedule']))}]" in data["arm_overrides"]["schedule"]
    assert all(np.isfinite(r["agreement_p5"]) for rows in data["results"].values() for r in rows)  # logged in training
    md = (tmp_path / "results.md").read_text()
    assert "| the schedule not behind the reference budget (tie rule at each run) |" in md


def _table(md: str) -> list[str]:
    return [line for line in md.splitlines() if line.startswith("|")]


@pytest.mark.parametrize(
    "script, results_dir, pngs",
    [
        (fig_a_curves, "fig_a_curves/walk_key", ("curves", "diagnostics")),
        (fig_d_corrections, "fig_d_corrections/walk_key_rkv", ("corrections",)),
        (fig_e_robustness, "fig_e_robustness/walk_key", ("robustness",)),
        (fig_qurl, "fig_qurl", ("qurl",)),
        (fig_b_budget, "fig_b_budget/walk_key", ("budget",)),
        (fig_c_policies, "fig_c_policies", ("policies",)),
        (fig_f_throughput, "fig_f_throughput", ("throughput",)),
        (default_experiment, "default", ("curves",)),
        (memo_choice, "memo_choice/walk_memo", ("memo_choice",)),
        (calibrate_task, "calibration/walk_key", ("calibration",)),
        (warm_start_spread, "warm_start_spread", ("spread",)),
        (fig_sortedrl, "fig_sortedrl", ("sortedrl",)),
        (real_rl, "real/rl", ("real_rl",)),
    ],
)
def test_replot_keeps_the_committed_numbers(script, results_dir, pngs, tmp_path):
    """--replot re-renders a committed result from its results.json and config.yaml, trains
    nothing, and writes the same tables (with a caption) as the committed results.md."""
    src = os.path.join(figlib.HERE, "results", results_dir)
    for name in ("results.json", "config.yaml", "results.md"):
        if os.path.exists(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), tmp_path / name)
    if os.path.isdir(os.path.join(src, "replicates")):  # the default's replicates on other machines
        shutil.copytree(os.path.join(src, "replicates"), tmp_path / "replicates")
    script.main(["--replot", str(tmp_path)])
    md = (tmp_path / "results.md").read_text()
    committed = open(os.path.join(src, "results.md")).read()
    assert _table(md) == _table(committed) and _table(md)
    assert "Figure: " in md
    assert md.splitlines()[2] == committed.splitlines()[2]  # the command that produced the numbers
    assert md.splitlines()[4].startswith("Provenance: ")
    for png in pngs:
        assert (tmp_path / f"{png}.png").stat().st_size > 0
    assert filecmp.cmp(tmp_path / "results.json", os.path.join(src, "results.json"), shallow=False)
    with pytest.raises(ValueError, match="trains nothing"):
        figlib.study_from_args(argparse.Namespace(replot=str(tmp_path)))


def test_the_collapse_rules():
    """figlib.collapsed: below half the warm start's dense accuracy; the reward rule: the first
    iteration whose 5-iteration moving average is below half the first window's."""
    assert figlib.collapsed(0.47, 0.953) and not figlib.collapsed(0.48, 0.953)
    assert not figlib.collapsed(0.0, 0.0)  # a warm start at 0 has nothing to lose
    flat = [{"reward/mean": 0.6}] * 20
    assert figlib.reward_collapse_iteration(flat) is None
    assert figlib.reward_collapse_iteration(flat[:9]) is None  # shorter than two windows
    falling = [{"reward/mean": r} for r in [0.6] * 5 + [0.0] * 15]
    # averages over the 5 iterations ending at iteration 5, 6, 7, 8: 0.6, 0.48, 0.36, 0.24 (< 0.3)
    assert figlib.reward_collapse_iteration(falling) == 8
    rows = [{"dense_acc": 0.9, "collapse_iteration": None}, {"dense_acc": 0.1, "collapse_iteration": 12}]
    assert figlib.collapse_cells(rows, [0.95, 0.95]) == ("1 of 2", "1 of 2 (at -, 12)")
    assert figlib.collapse_cells(rows, [None, 0.95])[0] == "-"  # a warm start not recorded
    assert figlib.collapse_cells([{"dense_acc": 0.5}], [0.95])[1] == "-"  # no history kept


def test_the_tie_rule():
    """figlib.tie_verdict on crafted differences: a difference counts only beyond 2 SE at every pair."""
    np.testing.assert_allclose(figlib.diff_se(0.5, 100, 0.5, 100), np.sqrt(0.005))
    assert figlib.diff_se(0.0, 128, 1.0, 128) == 0.0
    assert figlib.tie_verdict([0.3, 0.2], [0.1, 0.05]) == 1
    assert figlib.tie_verdict([-0.3, -0.2], [0.1, 0.05]) == -1
    assert figlib.tie_verdict([0.3, 0.19], [0.1, 0.1]) == 0  # one pair within 2 SE
    assert figlib.tie_verdict([0.3, -0.3], [0.01, 0.01]) == 0  # signs disagree
    assert figlib.tie_verdict([0.0], [0.0]) == 0
    # issue 32's cases at 128 prompts: fig d R-KV, both vs IBR only, beats it at every seed ...
    both, ibr = [0.914, 0.859, 0.922], [0.750, 0.641, 0.812]
    rows = lambda v: [{"acc": x, "seed": i} for i, x in enumerate(v)]  # noqa: E731
    (c,) = figlib.compare("both", rows(both), "ibr_only", rows(ibr), "acc", 128)
    assert c.verdict == "**both ahead**" and c.units == ["w0 s0", "w0 s1", "w0 s2"]
    # ... and fig c's R-KV Sparse-RL vs naive (+0.172, -0.039, +0.023) is a tie
    (c,) = figlib.compare("sparse_rl", rows([0.531, 0.430, 0.469]), "naive", rows([0.359, 0.469, 0.445]), "acc", 128)
    assert c.verdict == "tie" and np.allclose(c.diffs, [0.172, -0.039, 0.024])
    m, se = c.mean_se()
    np.testing.assert_allclose([m, se], [np.mean(c.diffs), np.std(c.diffs, ddof=1) / np.sqrt(3)])
    # with warm starts: one verdict per warm start, then the pooled one; a warm start as one model
    a = [
        {"acc": x, "warm_start": w, "seed": s}
        for x, (w, s) in zip([0.9, 0.8, 0.5, 0.6], [(0, 0), (0, 1), (1, 0), (1, 1)])
    ]
    cs = figlib.compare("arm", a, "warm", {0: {"acc": 0.5}, 1: {"acc": 0.7}}, "acc", 512)
    assert [c.metric for c in cs] == ["acc, warm start 0", "acc, warm start 1", "acc"]
    assert [c.verdict for c in cs] == ["**arm ahead**", "**warm ahead**", "tie"]
    with pytest.raises(ValueError, match="not paired"):
        figlib.compare("a", a, "b", list(reversed(a)), "acc", 512)
    table = figlib.comparison_table(cs)
    assert table[2].startswith("| arm - warm | acc, warm start 0 | +0.400 (") and len(table) == 5


def test_symlog_axis_ticks_do_not_crowd():
    fig, ax = figlib.plt.subplots()
    figlib.symlog_axis(ax, [-5.7e-9, 2.4e-5, 0.87])
    ticks = ax.xaxis.get_major_locator()()
    assert len(ticks) <= 6 and ticks[0] == 0.0 and ax.get_xscale() == "symlog"
    figlib.plt.close(fig)


@pytest.mark.extended  # its runs are figure a's scaffold at two budgets (fig_b's evaluation)
def test_calibrate_task(runs_dir, tmp_path):
    data = calibrate_task.main(
        WALK_SMOKE + ["--policies", "snapkv", "--budgets", "16", "32", "--out", str(tmp_path), "--runs-dir", runs_dir]
    )
    _outputs(tmp_path, "calibration")
    assert set(data["sparse"]) == {"snapkv@16", "snapkv@32"}
    assert data["sparse"]["snapkv@16"]["kv_saving"] > data["sparse"]["snapkv@32"]["kv_saving"] > 0.0
    assert data["dense"]["kv_saving"] == 0.0 and _acc_ok(data["dense"]["accuracy"])
    assert data["first_sparse_rollout"]["mismatch/kl_k3"] >= 0.0


def test_arms_do_not_repeat_the_warm_start(runs_dir):
    """An arm starts from the shared warm start's weights: neither SFT phase runs again."""
    study = figlib.Study(WALK, [*WALK_SMOKE[3:], *figlib.smoke_overrides(WALK)], runs_dir, log=lambda *_: None)
    assert study.base.sft.steps and study.base.sft.curriculum.steps
    run = study.arm("x", mode="naive_sparse", policy="snapkv", extra=["train.iterations=0"])
    assert run.cfg.sft.steps == 0 and run.cfg.sft.curriculum.steps == 0
    assert run.cfg.model.init_from == study.warm_start_dir()


def test_walk_key_rkv_is_walk_key_with_rkv_rollouts():
    """The default experiment's config copies walk_key.yaml but for the eviction policy (and its
    output directory): the two must not drift apart."""
    configs = [
        load_config([os.path.join(figlib.HERE, "configs", f"{name}.yaml")], ["train.out_dir=x"])
        for name in ("walk_key", "walk_key_rkv")
    ]
    assert (configs[0].kv.policy, configs[1].kv.policy) == ("snapkv", "rkv")
    assert dataclasses.replace(configs[1], kv=configs[0].kv) == configs[0]


def test_runs_are_cached_and_shared(runs_dir):
    study = figlib.Study(figlib.DEFAULT_CONFIG, list(figlib.SMOKE_OVERRIDES), runs_dir, log=lambda *_: None)
    a = study.arm("x", mode="sparse_rl", policy="snapkv", seed=0)
    b = study.arm("y", mode="sparse_rl", policy="snapkv", seed=0)
    assert a.out_dir == b.out_dir and a.history == b.history
    c = study.arm("z", mode="sparse_rl", policy="snapkv", seed=1)
    assert c.out_dir != a.out_dir and c.history != a.history  # another seed is another run
    assert study.arms["y"]["config"]["rl"]["mode"] == "sparse_rl" and study.arms["y"]["run"] == os.path.basename(
        a.out_dir
    )


def test_mean_std_formatting():
    assert figlib.fmt([0.5]) == "0.500"
    assert figlib.fmt([0.4, 0.6]) == "0.500 ± 0.141"  # sample standard deviation
    assert figlib.mean_std([1.0, 3.0]) == (2.0, 2.0**0.5)


@pytest.mark.extended  # its cells are Study runs as fig a's arms; its rendering in the replot tests
def test_fig_b_budget(runs_dir, tmp_path):
    data = fig_b_budget.main(["--smoke", "--budgets", "16", "48", "--out", str(tmp_path), "--runs-dir", runs_dir])
    _outputs(tmp_path, "budget")
    (small,), (large,) = data["results"]["sparse_rl@16"], data["results"]["sparse_rl@48"]
    assert small["kv_saving"] > large["kv_saving"]  # a larger budget keeps more entries
    assert _acc_ok([small["sparse_acc"], large["sparse_acc"]])
    (dense,) = data["results"]["dense"]  # the dense-trained run, evaluated at every budget
    assert {"sparse_acc@16", "sparse_acc@48"} <= set(dense) and set(data["warm_starts"]["0"]) == {
        "dense_acc",
        "sparse_acc@16",
        "sparse_acc@48",
    }
    md = (tmp_path / "results.md").read_text()
    assert "| sparse_rl@48 not behind dense-trained, dense inference (tie rule at each run) |" in md


@pytest.mark.extended  # its cells are Study runs as fig a's arms; its rendering in the replot tests
def test_fig_c_policies(runs_dir, tmp_path):
    data = fig_c_policies.main(
        ["--smoke", "--policies", "none", "streaming", "--out", str(tmp_path), "--runs-dir", runs_dir]
    )
    _outputs(tmp_path, "policies")
    assert [(c["policy"], c["mode"]) for c in data["cells"]] == [
        ("none", "dense"),
        ("streaming", "naive_sparse"),
        ("streaming", "sparse_rl"),
    ]
    assert data["cells"][0]["per_seed"][0]["train_kv_saving"] == 0.0
    assert data["cells"][2]["per_seed"][0]["train_kv_saving"] > 0.2


@pytest.mark.extended  # its variants are Study runs as fig a's arms; its rendering in the replot tests
def test_fig_d_corrections(runs_dir, tmp_path):
    data = fig_d_corrections.main(
        [
            "--smoke",
            "--seeds",
            "0",
            "--variants",
            "none",
            "both",
            "both_geometric_level",
            "--out",
            str(tmp_path),
            "--runs-dir",
            runs_dir,
        ]
    )
    _outputs(tmp_path, "corrections")
    assert data["results"]["none"][0]["token_reject_rate"] == 0.0  # naive sparse rejects nothing
    assert set(data["results"]) == {"none", "both", "both_geometric_level"}


def test_fig_qurl(runs_dir, tmp_path):
    data = fig_qurl.main(
        ["--smoke", "--seeds", "0", "--variants", "int8_acr", "--out", str(tmp_path), "--runs-dir", runs_dir]
    )
    saved = _outputs(tmp_path, "qurl")
    (q,) = data["results"]["int8_acr"]
    assert _acc_ok(q["dense_acc"]) and q["mismatch_kl_k3"] > 0.0  # int8 rollouts move pi_behav
    assert 0.0 <= q["acr_active"] <= 1.0 and q["rollout_tokens_per_s"] > 0
    assert saved["paper_gsm8k"] == {"int8_acr": 53.55}
    assert "| int8_acr | qurl |" in (tmp_path / "results.md").read_text()


def test_fig_e_robustness(runs_dir, tmp_path):
    data = fig_e_robustness.main(
        [
            "--smoke",
            "--policies",
            "streaming",
            "snapkv",
            "--budgets",
            "16",
            "--out",
            str(tmp_path),
            "--runs-dir",
            runs_dir,
        ]
    )
    _outputs(tmp_path, "robustness")
    assert set(data["grid"]) == {"warm start", "dense-trained", "sparse_rl-trained"}
    assert data["units"]["sparse_rl-trained"] == [[0, 0]] and data["units"]["warm start"] == [[0, 0]]
    assert set(data["grid"]["dense-trained"]) == {"dense", "streaming@16", "snapkv@16"}
    assert all(_acc_ok(v) for row in data["grid"].values() for v in row.values())


def test_fig_f_throughput(tmp_path):
    data = fig_f_throughput.main(["--smoke", "--out", str(tmp_path)])
    _outputs(tmp_path, "throughput", arms=False)
    assert {r["policy"] for r in data["rows"]} == {"none", "streaming", "snapkv"}
    assert data["kv_ratio_at_longest"]["none"] == 1.0
    assert data["kv_ratio_at_longest"]["snapkv"] < 1.0  # the sparse cache is smaller


def test_run_identity_ignores_defaults_and_locations():
    base = figlib.load_config([figlib.DEFAULT_CONFIG])
    key = figlib.config_key(base)
    # spelling out a default value, or moving the output, is the same run
    assert figlib.config_key(figlib.load_config([figlib.DEFAULT_CONFIG], ["rollout.top_k=0"])) == key
    assert figlib.config_key(figlib.load_config([figlib.DEFAULT_CONFIG], ["train.out_dir=/elsewhere"])) == key
    # a setting that changes the numbers is another run
    assert figlib.config_key(figlib.load_config([figlib.DEFAULT_CONFIG], ["kv.budget=16"])) != key
    a = figlib.load_config([figlib.DEFAULT_CONFIG], ["model.init_from=/x/abc123"])
    b = figlib.load_config([figlib.DEFAULT_CONFIG], ["model.init_from=/y/abc123/"])
    assert figlib.config_key(a) == figlib.config_key(b) != key


@pytest.mark.extended
def test_fig_sortedrl(runs_dir, tmp_path):
    data = fig_sortedrl.main(
        ["--smoke", "--seeds", "0", "--variants", "sorted_partial", "--out", str(tmp_path), "--runs-dir", runs_dir]
    )
    _outputs(tmp_path, "sortedrl")
    (r,) = data["results"]["sorted_partial"]
    assert 0.0 <= r["bubble_wall"] <= 1.0 and 0.0 <= r["bubble_slots"] <= 1.0
    assert r["rollout_tokens_per_s"] > 0 and r["staleness_mean"] >= 0.0
    assert "| sorted_partial | sparse_rl |" in (tmp_path / "results.md").read_text()


@pytest.mark.extended  # its runs are figure a's arms on the walk task; its statistics are checked below
def test_memo_choice_smoke(runs_dir, tmp_path):
    rows = memo_choice.main(WALK_SMOKE + ["--seeds", "0", "--out", str(tmp_path), "--runs-dir", runs_dir])
    _outputs(tmp_path, "memo_choice")
    assert set(rows) == {"warm start", "dense", "naive_sparse", "sparse_rl"}
    assert all(0.0 <= r["entropy"] <= np.log(26) + 1e-9 for arm in rows.values() for r in arm)


def test_memo_choice_statistics_and_its_setting(runs_dir, tmp_path):
    stats = memo_choice.memo_statistics(["#P\n1", "#P\n2", "#Q\n3", "no memo", "#p\n"])
    assert stats["top_letter"] == "P" and stats["top_share"] == 0.4 and stats["no_memo"] == 0.4
    np.testing.assert_allclose(stats["entropy"], -(2 * 0.4 * np.log(0.4) + 0.2 * np.log(0.2)))
    with pytest.raises(ValueError, match="memo: true"):
        memo_choice.main(["--smoke", "--out", str(tmp_path / "x"), "--runs-dir", runs_dir])


def test_a_figure_trains_on_every_core_its_command_may_use(tmp_path, monkeypatch):
    """study_from_args counts the cores before it pins its own process to the first: train_all's
    workers get all of them (pinning first left one worker for the whole figure)."""
    from experiments.lib import workers

    cores = [0, 1, 2]
    monkeypatch.setattr(workers, "available_cores", lambda: list(cores))

    def pin(core=None):
        cores[1:] = []
        return True

    monkeypatch.setattr(workers, "pin_to_one_core", pin)
    seen = []
    monkeypatch.setattr(workers, "parallel_map", lambda fn, items, c=None: seen.append(c) or [])
    args = argparse.Namespace(
        config=figlib.DEFAULT_CONFIG, overrides=[], smoke=True, runs_dir=str(tmp_path), replot=None
    )
    study = figlib.study_from_args(args)
    study.train_all([])
    assert seen == [[0, 1, 2]] and study.cores == [0, 1, 2]


def test_a_figures_defaults_come_before_smoke_and_the_command_line(tmp_path):
    """Figure(defaults=...): the script's own overrides of its config, which --smoke's and then
    the command line's override (the default experiment's 40 iterations, smoke's 2, a user's 7)."""
    import argparse

    from experiments.lib import default_experiment

    args = argparse.Namespace(
        replot=None, smoke=True, config=default_experiment.CONFIG, overrides=["train.seed=3"], runs_dir=str(tmp_path)
    )
    study = figlib.study_from_args(args, [0], None, default_experiment.DEFAULT_OVERRIDES)
    assert study.overrides[0] == "train.iterations=40" and study.overrides[-1] == "train.seed=3"
    assert study.base.train.iterations == 2  # smoke's, after the default's
    args.smoke, args.overrides = False, ["train.iterations=7"]
    assert figlib.study_from_args(args, [0], None, default_experiment.DEFAULT_OVERRIDES).base.train.iterations == 7
    args.overrides = []
    assert figlib.study_from_args(args, [0], None, default_experiment.DEFAULT_OVERRIDES).base.train.iterations == 40


def test_a_refused_figure_loses_no_result(tmp_path):
    """write_results writes results.json before the figures: a figure the print check refuses
    (text past its edges) raises, and the data are already on disk for --replot."""
    fig, ax = figlib.plt.subplots(figsize=(figlib.COLUMN_W, 2))
    fig.text(0.9, 0.5, "a note that runs past the right edge")
    rendered = figlib.Rendered("T", "body", {"cut": fig}, "caption")
    with pytest.raises(ValueError, match="cut off"):
        figlib.write_results(str(tmp_path), rendered, {"command": "python x.py", "value": 1.5})
    assert json.loads((tmp_path / "results.json").read_text())["value"] == 1.5
