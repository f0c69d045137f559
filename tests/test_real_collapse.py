"""experiments/real/collapse.py at smoke size on a tiny checkpoint: every arm and seed trains with
the dense periodic evaluation and leaves a record; the table, the rules' verdicts and the figure
are written from the records, --replot re-renders them from results.json alone, and a study with
some records present trains only the missing runs (a study continued on another machine)."""

import json
import os

import jax
import pytest
from compile_cache import compile_cache_in_process

from experiments.lib import run_records, run_replay
from experiments.real import collapse as real_collapse

jax.devices()  # the backend runs: the arms train in this process (no worker start-up)

pytest.importorskip("transformers")
pytestmark = pytest.mark.xdist_group("real_collapse")


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """The arms train one after the other in this process, each a fresh trainer repeating the
    others' programs: with the session's compilation cache they compile once
    (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


def test_records_round_trip_and_identity(tmp_path):
    rec = {
        "name": "naive/seed1",
        "config_key": "abc123",
        "history": [{"reward/mean": 0.25}],
        "evals": {"10": {"accuracy": 0.5, "n": 128}},
    }
    path = run_records.write(str(tmp_path), rec)
    assert os.path.basename(path) == "naive-seed1.json"
    assert run_records.read(str(tmp_path), "naive/seed1") == {"schema": run_records.SCHEMA, **rec}
    assert run_records.read(str(tmp_path), "naive/seed1", "abc123")["history"] == rec["history"]
    assert run_records.read(str(tmp_path), "naive/seed1", "another") is None  # another config: not reused
    assert run_records.read(str(tmp_path), "dense/seed1") is None
    assert run_records.missing(
        str(tmp_path), [("naive/seed1", "abc123"), ("dense/seed1", "x"), ("naive/seed1", "changed")]
    ) == ["dense/seed1", "naive/seed1"]
    with pytest.raises(ValueError, match="config_key"):
        run_records.write(str(tmp_path), {"name": "x"})
    stale = json.loads(open(path).read())
    stale["schema"] = 0
    open(path, "w").write(json.dumps(stale))
    with pytest.raises(ValueError, match="schema"):
        run_records.read(str(tmp_path), "naive/seed1")


def test_a_run_both_settings_plan_is_adopted_from_the_other_settings_records(tmp_path):
    """The dense arm and the untrained model do not depend on the eviction setting: a study under
    rkv48 copies rkv64's record of such a run (same name, same config) instead of training it,
    and never one of another config or one it already has."""
    rkv64, rkv48 = str(tmp_path / "rkv64" / "records"), str(tmp_path / "rkv48" / "records")
    run_records.write(rkv64, {"name": "dense/seed0", "config_key": "same", "history": [{"x": 1.0}]})
    run_records.write(rkv64, {"name": "naive/seed0", "config_key": "budget64", "history": []})
    run_records.write(rkv48, {"name": "untrained/seed0", "config_key": "u", "history": [{"x": 2.0}]})
    run_records.write(rkv64, {"name": "untrained/seed0", "config_key": "u", "history": [{"x": 3.0}]})
    planned = [("dense/seed0", "same"), ("naive/seed0", "budget48"), ("untrained/seed0", "u")]
    written = run_records.adopt(rkv48, planned, [rkv64, rkv48])
    assert [os.path.basename(p) for p in written] == ["dense-seed0.json"]
    dense = run_records.read(rkv48, "dense/seed0", "same")
    assert dense["history"] == [{"x": 1.0}] and dense["adopted_from"] == os.path.join(
        "..", "rkv64", "records", "dense-seed0.json"
    )
    assert run_records.read(rkv48, "untrained/seed0")["history"] == [{"x": 2.0}]  # its own kept
    assert run_records.missing(rkv48, planned) == ["naive/seed0"]
    assert run_records.adopt(rkv48, planned, [rkv64]) == []  # nothing more to adopt


def _untimed(results: dict) -> dict:
    return {
        arm: [{k: v for k, v in r.items() if k != "seconds_per_iteration"} for r in rows]
        for arm, rows in results.items()
    }


def _run_dirs(runs) -> set[str]:
    return {d.name for d in runs.iterdir() if d.is_dir()} if runs.exists() else set()


@pytest.mark.slow
def test_smoke_study_records_resume_and_replot(tmp_path):
    from hf_fixtures import make_tiny_hf_checkpoint

    from sparserl_jax.tokenizer import CharTokenizer

    ckpt = make_tiny_hf_checkpoint("llama", tmp_path / "ckpt")
    CharTokenizer().save(ckpt)
    out, runs = tmp_path / "out", tmp_path / "runs"
    argv = ["--smoke", "--seeds", "0", "--runs-dir", str(runs), "--out", str(out), f"model.checkpoint={ckpt}"]
    data = real_collapse.main(argv)
    res = data["results"]
    assert set(res) == set(real_collapse.ARMS) and all(len(rows) == 1 for rows in res.values())
    for arm, (_, sparse, _) in real_collapse.ARMS.items():
        r = res[arm][0]
        assert set(r["evals"]) == {"1", "2"} and r["dense_acc"] == r["evals"]["2"]
        assert (r["train_kv_saving"] > 0) == sparse
        assert r["collapsed"] == (r["dense_acc"] < 0.5 * r["untrained_acc"])
    planned = [name for name, _ in real_collapse.plan([0], real_collapse.SETTINGS[real_collapse.DEFAULT_SETTING])]
    assert data["planned_runs"] == data["recorded_runs"] == len(planned) == 4 and len(_run_dirs(runs)) == 4
    records = out / "records"
    for name in planned:  # every finished run left its record, with its provenance
        rec = run_records.read(str(records), name)
        assert rec["provenance"]["commit"] and rec["provenance"]["cpu"] and rec["config"]["train"]["out_dir"] is None
    md = (out / "results.md").read_text()
    assert "**Plan, fixed before the runs**" in md and "**Verdicts**" in md and "Provenance: commit" in md
    assert "**4 of 4 planned runs recorded**" in md and "Cost here" in md
    assert (out / "arms.json").exists() and (out / "collapse.png").stat().st_size > 0
    before = json.loads((out / "results.json").read_text())

    # another machine: no run directories, one record missing -> only that run trains
    import shutil

    shutil.rmtree(runs)
    (records / "naive-seed0.json").unlink()
    partial = real_collapse.main([*argv, "--render-only"])
    assert partial["recorded_runs"] == 3 and partial["results"]["naive"] == [] and not _run_dirs(runs)
    md = (out / "results.md").read_text()
    assert "**3 of 4 planned runs recorded**" in md and "**Verdicts**" not in md
    # --only trains the named missing runs and nothing else
    assert real_collapse.main([*argv, "--only", "dense/seed0"])["trained_now"] == []
    with pytest.raises(ValueError, match="--only naive/seed9: not a planned run"):
        real_collapse.main([*argv, "--only", "naive/seed9"])
    again = real_collapse.main([*argv, "--only", "naive/seed0"])
    assert again["trained_now"] == ["naive/seed0"] and len(_run_dirs(runs)) == 1
    assert _untimed(again["results"]) == _untimed(before["results"])  # the retrained run is the same run
    assert again["recorded_runs"] == 4 and "**Verdicts**" in (out / "results.md").read_text()

    written = (out / "results.json").read_text()
    (out / "collapse.png").unlink()
    real_collapse.main(["--replot", str(out)])
    assert (out / "collapse.png").exists() and (out / "results.json").read_text() == written

    # a replay: the recorded run's first iteration trained again from its start equals its record
    replayed = real_collapse.main([*argv, "--replay", "naive/seed0", "--replay-iterations", "1"])
    assert replayed["trained_now"] == [] and replayed["recorded_runs"] == 4
    (found,) = run_replay.replays(str(out))["replays"]
    assert found["name"] == "naive/seed0" and found["iterations"] == 1 and found["identical"], found
    assert found["values"] > 20 and "identical" in (out / "results.md").read_text().split("Replays")[1]
    with pytest.raises(ValueError, match="--replay-iterations 9"):
        real_collapse.main([*argv, "--replay", "naive/seed0", "--replay-iterations", "9"])
    with pytest.raises(FileNotFoundError, match="--replay naive/seed7: no record"):
        real_collapse.main([*argv, "--replay", "naive/seed7"])


def test_a_replay_compares_every_metric_but_clock_readings_exactly():
    recorded = [
        {"reward/mean": 0.5, "xi/p5": float("nan"), "time/update_s": 3.0, "rollout/bubble_wall": 0.4},
        {"reward/mean": 0.25, "xi/p5": 0.9, "time/update_s": 3.0},
    ]
    same = [{**recorded[0], "time/update_s": 9.0, "rollout/bubble_wall": 0.1}]  # only clocks differ; NaN == NaN
    r = run_replay.compare(recorded, same)
    assert r["identical"] and r["iterations"] == 1 and r["values"] == 2 and r["max_rel_diff"] == 0.0
    other = [same[0], {**recorded[1], "reward/mean": 0.25 * (1 + 2**-20)}]
    r = run_replay.compare(recorded, other)
    assert not r["identical"] and r["first_difference"]["iteration"] == 2
    assert r["first_difference"]["metric"] == "reward/mean" and r["max_rel_diff"] == pytest.approx(2**-20)
    assert "differs from iteration 2 (reward/mean" in run_replay.outcome(r)
    assert r["differing_metrics"] == ["reward/mean"] and r["metrics"] == 2 and not r["same_samples"]
    assert "the samples differ" in run_replay.outcome(r)
    bits = run_replay.compare(recorded, [same[0], {**recorded[1], "xi/p5": 0.9 * (1 + 2**-20)}])
    assert bits["same_samples"] and "the same samples" in run_replay.outcome(bits)
    lacking = [{k: v for k, v in recorded[0].items() if k != "xi/p5"}]  # the code no longer logs it
    assert run_replay.compare(recorded, lacking)["max_rel_diff"] == float("inf")
    # a metric logged only since the record is listed, not compared
    newer = run_replay.compare(recorded, [{**recorded[0], "agreement/p5": 0.8}])
    assert newer["identical"] and newer["new_metrics"] == ["agreement/p5"] and newer["values"] == 2
    said = run_replay.outcome({**newer, "package_changes": 3})
    assert "1 metrics logged only since the record" in said and "changed in 3 commits" in said
    assert "the same package code" in run_replay.outcome({**r, "package_changes": 0})
    with pytest.raises(ValueError, match="the record only 2"):
        run_replay.compare(recorded, recorded * 2)


def test_the_gpu_cost_comes_from_a_committed_device_check_or_says_how_to_measure_it(tmp_path):
    """results.md's GPU cost is the device check's `study` step where one finished (status ok),
    per device; a failed step or none says it is not measured and names the command."""
    assert "not measured yet" in real_collapse.gpu_cost_sentence(str(tmp_path))
    steps = tmp_path / "nvidia-h100" / "check-1" / "steps"
    steps.mkdir(parents=True)
    result = {
        "arms": {"dense": {"iteration_s": 2.5}, "sparse_rl": {"iteration_s": 3.25}},
        "plan": {"eval_s": 4.0, "total_s": 660.0},
    }
    (steps / "study.json").write_text(json.dumps({"status": "fail", "result": result}))
    assert "not measured yet" in real_collapse.gpu_cost_sentence(str(tmp_path))
    (steps / "study.json").write_text(json.dumps({"status": "ok", "result": result}))
    sentence = real_collapse.gpu_cost_sentence(str(tmp_path))
    assert "nvidia-h100" in sentence and "dense 2.5 s, sparse_rl 3.2 s" in sentence and "11 min" in sentence


def test_the_cost_line_counts_what_a_setting_trains_itself_apart_from_adopted_runs():
    """A setting whose untrained and dense runs are adopted from another setting's records prices
    the whole plan and, beside it, only the runs it trains itself."""
    run = {"commit": "c", "cpu": "x", "jax": "j", "wall_s": 1.0, "finished": "f", "uncommitted_changes": False}
    data = {
        "results": {"dense": [{"seconds_per_iteration": 360.0}]},
        "untrained": {"0": {"seconds": 360.0}},
        "seeds": [0],
        "iterations": 2 * real_collapse.EVAL_EVERY,
        "eval_prompts": 4,
        "runs": {"untrained/seed0": dict(run), "dense/seed0": dict(run), "naive/seed0": dict(run)},
    }
    n_runs, n_evals = real_collapse.plan_counts(1, data["iterations"])
    total_h = (n_runs * data["iterations"] + n_evals) * 360.0 / 3600
    (line,) = real_collapse.cost_lines(data)
    assert f"{total_h:.1f} core-hours" in line and "adopted" not in line
    for name in ("untrained/seed0", "dense/seed0"):
        data["runs"][name]["adopted_from"] = f"../rkv64/records/{name.replace('/', '-')}.json"
    (line,) = real_collapse.cost_lines(data)
    own_h = ((n_runs - 1) * data["iterations"] + n_evals - 1 - 2) * 360.0 / 3600  # less a run, its evals, iteration 0
    assert f"{total_h:.1f} core-hours" in line
    assert "2 of its runs are adopted" in line and f"trains {n_runs - 1} runs, about {own_h:.1f} core-hours" in line


@pytest.mark.slow
def test_rkv48q_logs_the_question_and_judges_persistence(tmp_path):
    """The compressed-question setting at smoke size: its sparse runs log question/* every
    iteration, each row carries the plan's persistence reading, and results.md shows the plan's
    additions and the persistence table; the dense arm logs none (no eviction)."""
    from hf_fixtures import make_tiny_hf_checkpoint

    from sparserl_jax.tokenizer import CharTokenizer

    ckpt = make_tiny_hf_checkpoint("llama", tmp_path / "ckpt")
    CharTokenizer().save(ckpt)
    out = tmp_path / "rkv48q"
    argv = ["--smoke", "--setting", "rkv48q", "--seeds", "0", "--runs-dir", str(tmp_path / "runs"), "--out", str(out)]
    data = real_collapse.main([*argv, f"model.checkpoint={ckpt}"])
    for arm in real_collapse.SPARSE_ARMS:
        (h,) = data["histories"][arm]
        assert all(0 < x["question/evicted"] <= 1 and 0 <= x["question/number_lost"] <= 1 for x in h)
        (r,) = data["results"][arm]
        assert r["persisted"] == real_collapse.persisted(r["k3_last25"], r["question_evicted_last25"])
        assert r["persisted"] is not None
    assert not any(k.startswith("question/") for x in data["histories"]["dense"][0] for k in x)
    assert data["results"]["dense"][0]["persisted"] is None
    md = (out / "results.md").read_text()
    assert "**What this setting adds, declared before its first run**" in md
    assert "**Persistence and mechanism**" in md and "sparse runs" in md.split("**Verdicts**")[1]


def test_the_persistence_rule():
    assert real_collapse.persisted(0.02, 0.10) and not real_collapse.persisted(0.019, 0.5)
    assert not real_collapse.persisted(0.5, 0.099) and real_collapse.persisted(None, 0.2) is None
    h = [{"mismatch/kl_k3": 0.5, "question/evicted": 0.5}] * 15 + [
        {"mismatch/kl_k3": 0.01, "question/evicted": 0.5}
    ] * 5
    q = real_collapse.question_summary(h)
    assert q["k3_last25"] == pytest.approx(0.01) and q["persisted"] is False
    assert q["question_evicted"] == pytest.approx(0.5) and q["question_number_lost"] is None
