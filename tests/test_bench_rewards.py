"""experiments/bench/bench_rewards.py: it answers --help, its responses are a deterministic mix of
every kind that the rewards judge as their kind says, and its smoke run writes both reports."""

import json
import os
import subprocess
import sys
from pathlib import Path

from experiments.bench import bench_rewards as br
from sparserl_jax.data import rewards

SCRIPT = Path(__file__).resolve().parent.parent / "experiments" / "bench" / "bench_rewards.py"


def test_help():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--workers" in proc.stdout and "--responses" in proc.stdout


def test_responses_are_a_deterministic_mix_judged_by_kind():
    rows = br.make_rows(400, seed=1)
    assert rows == br.make_rows(400, seed=1) and rows != br.make_rows(400, seed=2)
    assert {row[3] for row in rows} == set(br.KINDS)
    math = rewards.get_timed_reward("math", 5.0)
    expected = {"same": 1.0, "equivalent": 1.0, "wrong": 0.0, "no_answer": 0.0}
    for response, label, source, kind in rows:
        if kind in expected:
            assert math(response, label) == expected[kind], (kind, response[-60:], label)
        else:
            assert source == {"gsm8k": "openai/gsm8k", "choice": "multiple_choice"}[kind]


def test_smoke_run_writes_json_and_markdown(tmp_path):
    out = tmp_path / "bench_rewards.json"
    data = br.main(["--smoke", "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["summary"].keys() == {"serial", "pool_1"} and saved["responses"] == 32
    assert all(s["equal_to_serial"] and s["timeouts"] == 0 for s in data["summary"].values())
    md = (tmp_path / "bench_rewards.md").read_text()
    assert md.startswith("# Reward throughput") and "| pool_1 |" in md and "Measured" in md
    # the report says when the machine was loaded (load average at the start >= its cores)
    assert ("loaded machine" in md) == (saved["load_average"]["start"] >= saved["cores"])
    assert os.path.exists(out)
