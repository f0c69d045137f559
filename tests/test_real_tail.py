"""experiments/real/tail_study.py: the schedule built from calibrated bins, and the whole measurement
end to end on a tiny HF checkpoint the test builds (random Qwen2 weights + the char tokenizer)."""

import json

import jax
import numpy as np
import pytest
from hf_fixtures import make_tiny_hf_checkpoint

from experiments.real import report
from experiments.real import tail_study as real_tail
from experiments.real.schedule import schedule_for, sequential_schedule
from sparserl_jax.tokenizer import CharTokenizer

pytestmark = pytest.mark.xdist_group("real_tail")


def _row(budget, p5_by_bin):
    return {"arm": {"budget": budget}, "bins": {b: {"p5": v, "tokens": 10} for b, v in p5_by_bin.items()}}


def test_the_schedule_takes_per_bin_the_smallest_budget_reaching_tau():
    rows = [
        _row(16, {1: 0.90, 2: 0.70, 3: 0.50}),
        _row(32, {1: 0.95, 2: 0.85, 3: 0.60}),
        _row(64, {1: 0.99, 2: 0.90, 3: 0.70}),
    ]
    # bin 0: no tokens (nothing evicted): the smallest; bin 3: none reaches tau: the largest
    assert schedule_for(rows, [16, 32, 64], 0.8) == (16, 16, 32, 64)
    assert schedule_for(rows, [64, 16, 32], 0.5) == (16, 16, 16, 16)


def test_the_report_renders_a_measurement(tmp_path):
    """results.md and the one-column figure from a made-up measurement (the default tier; the
    measurement itself is the extended tier's smoke below)."""
    from experiments.real import report

    def row(name, budget, schedule, p5s, saving, k3):
        bins = {b: {"p5": v, "mean": v + 0.3, "tokens": 100} for b, v in enumerate(p5s, start=1)}
        return {
            "arm": {"name": name, "budget": budget, "schedule": schedule},
            "bins": bins,
            "agreement_mean": 0.8,
            "agreement_p5": min(p5s),
            "agreement_upper_p5": 0.9,
            "kl_k3": k3,
            "token_reject": 0.1,
            "xi_p5": 0.5,
            "kv_saving": saving,
            "mean_length": 100.0,
        }

    data = {
        "rows": [row("rkv@32", 32, [], [0.5, 0.3], 0.5, 0.1), row("rkv@64", 64, [], [0.6, 0.45], 0.3, 0.03)],
        "tau": 0.45,
        "schedule": [32, 32, 64],
        "settings": {
            "checkpoint": "/x/smollm2",
            "prompts": 8,
            "max_new": 64,
            "seed": 0,
            "policy": "rkv",
            "buffer": 16,
            "every": 32,
            "reference": 64,
        },
        "wall_s": 1.0,
        "cores": 1,
        "provenance": {"commit": "abc", "wall_s": 1.0},
    }
    data["rows"].append(row("rkv schedule", 64, [32, 32, 64], [0.5, 0.46], 0.4, 0.05))
    report.write("tail", str(tmp_path), data, cmd="python experiments/real/tail_study.py")
    md = (tmp_path / "results.md").read_text()
    assert "tau = 0.4500" in md and "| rkv schedule | 40.0% |" in md and "below tau in 0 of 2 bins" in md
    assert "0.300* (100)" in md  # a bin below tau is marked
    assert (tmp_path / "tail.png").stat().st_size > 0


@pytest.mark.extended
def test_smoke_measurement_and_replot(tmp_path):
    jax.devices()  # the backend runs: workers.parallel_map runs the arms in this process
    ckpt = make_tiny_hf_checkpoint("qwen2", tmp_path / "ckpt")
    CharTokenizer().save(ckpt)
    out = tmp_path / "tail"
    argv = ["--checkpoint", str(ckpt), "--prompts", "4", "--max-new", "16", "--budgets", "10", "16"]
    argv += ["--reference", "16", "--every", "8", "--buffer", "4", "--rows-per-call", "4", "--out", str(out)]
    data = real_tail.main(argv)
    assert [r["arm"]["name"] for r in data["rows"]] == ["rkv@10", "rkv@16", "rkv schedule"]
    tau = data["tau"]
    assert tau == data["rows"][1]["agreement_p5"]
    assert set(data["schedule"]) <= {10, 16} and list(data["rows"][2]["arm"]["schedule"]) == data["schedule"]
    for r in data["rows"]:
        assert 0 <= r["agreement_p5"] <= r["agreement_mean"] <= 1 and r["agreement_p5"] <= r["agreement_upper_p5"]
        assert 0 < r["kv_saving"] < 1 and r["kl_k3"] >= 0
    md = (out / "results.md").read_text()
    assert "Command: `python experiments/real/tail_study.py" in md and f"tau = {tau:.4f}" in md and "Outcome" in md
    assert (out / "tail.png").stat().st_size > 0
    before = md
    real_tail.main(["--replot", str(out)])
    assert (out / "results.md").read_text() == before
    assert json.loads((out / "results.json").read_text())["schedule"] == data["schedule"]


def test_the_sequential_calibration_samples_each_bin_with_the_earlier_choices_in_force():
    """A fake model whose bin-b percentile is the mean of the budgets in force up to b over 100:
    small early budgets drag the later bins down, which the per-bin rule cannot see."""
    calls = []

    def measure(schedules):
        calls.append(schedules)
        return [
            {
                "arm": {"schedule": s},
                "bins": {b: {"p5": sum(s[: b + 1]) / (b + 1) / 100} for b in (1, 2, 3)},
            }
            for s in schedules
        ]

    schedule, sampled, final = sequential_schedule(4, [64, 16, 32], 0.3, {1, 2, 3}, measure)
    # bin 0: no token, the smallest (16); bin 1: (16 + B) / 2 reaches 30 only at B = 64; bin 2:
    # (16 + 64 + 16) / 3 = 32 at B = 16; bin 3: (96 + 16) / 4 = 28 < 30, (96 + 32) / 4 = 32 at B = 32
    assert schedule == (16, 64, 16, 32)
    assert [len(c) for c in calls] == [3, 3, 3] and len(sampled) == 9
    assert calls[1][0] == (16, 64, 16, 64) and final["arm"]["schedule"] == schedule
    # no candidate reaches tau: the largest
    assert sequential_schedule(2, [16, 32], 0.9, {1}, measure)[0] == (16, 32)


def test_the_sequential_calibration_keeps_every_later_bin_at_its_target():
    """A fake model whose bin 2 keeps at most 20 fewer than bin 1's budget (what bin 1 evicted is
    gone): 32 passes bin 1 itself (0.32 >= 0.3) but leaves bin 2 at 0.12 under any budget, so bin 1
    takes 64; a bin the largest budget cannot hold at tau (the ceiling) is held at its level."""

    def measure(schedules):
        return [
            {"arm": {"schedule": s}, "bins": {1: {"p5": s[1] / 100}, 2: {"p5": min(s[1] - 20, s[2]) / 100}}}
            for s in schedules
        ]

    assert sequential_schedule(3, [16, 32, 64], 0.3, {1, 2}, measure)[0] == (16, 64, 32)
    # bin 2's ceiling 0.12 (the largest budget's own percentile there) is its target: 32 in bin 1 suffices
    capped = sequential_schedule(3, [16, 32, 64], 0.3, {1, 2}, measure, {1: 0.64, 2: 0.12})
    assert capped[0] == (16, 32, 16)


@pytest.mark.extended
def test_smoke_sequential_calibration(tmp_path):
    jax.devices()
    ckpt = make_tiny_hf_checkpoint("qwen2", tmp_path / "ckpt")
    CharTokenizer().save(ckpt)
    out = tmp_path / "tail"
    argv = ["--checkpoint", str(ckpt), "--prompts", "4", "--max-new", "16", "--budgets", "10", "16"]
    argv += ["--reference", "16", "--every", "8", "--buffer", "4", "--rows-per-call", "4", "--out", str(out)]
    data = real_tail.main([*argv, "--calibration", "sequential"])
    assert data["calibration"] == "sequential" and data["trials"] >= 2
    assert list(data["rows"][-1]["arm"]["schedule"]) == data["schedule"]
    assert "calibrated bin by bin" in (out / "results.md").read_text()


def test_the_fixed_budgets_at_the_schedules_mismatch_interpolate_in_k3():
    rows = [
        {"arm": {"budget": b}, "kl_k3": k, "kv_saving": v, "agreement_p5": p}
        for b, k, v, p in ((32, 0.12, 0.6, 0.30), (48, 0.04, 0.4, 0.40), (96, 0.01, 0.1, 0.50))
    ]
    eq = report.at_equal_mismatch(rows, 0.08)  # halfway between 48 and 32
    assert eq["between"] == (48, 32)
    np.testing.assert_allclose([eq["kv_saving"], eq["agreement_p5"]], [0.5, 0.35])
    assert report.at_equal_mismatch(rows, 0.2) is None
    line = report.equal_mismatch_sentence(rows, {"kl_k3": 0.08, "kv_saving": 0.45, "agreement_p5": 0.37})
    assert "save 50.0% at agreement p5 0.3500; the schedule saves 45.0% at 0.3700" in line
    assert "outside" in report.equal_mismatch_sentence(rows, {"kl_k3": 0.5, "kv_saving": 0.0, "agreement_p5": 0.0})
