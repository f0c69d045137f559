"""experiments/bench/bench_vs_trl.py at smoke size: both arms run on a tiny checkpoint, every phase is
timed, our learner compiles nothing after the warm-up and the report is written."""

import json
import os

import pytest

pytest.importorskip("trl")
from experiments.bench import bench_vs_trl

pytestmark = pytest.mark.xdist_group("bench_vs_trl")


@pytest.mark.extended
def test_smoke_report(tmp_path):
    from hf_fixtures import make_tiny_hf_checkpoint

    from sparserl_jax.tokenizer import CharTokenizer

    ckpt = make_tiny_hf_checkpoint("llama", tmp_path / "ckpt")
    CharTokenizer().save(ckpt)
    out = tmp_path / "bench.json"
    before = os.environ.get("SPARSERL_PORTABLE_CPU")
    report = bench_vs_trl.main(["--smoke", "--regimes", "fixed", "--checkpoint", str(ckpt), "--out", str(out)])
    arms = report["regimes"]["fixed"]
    assert set(arms) == {"ours", "trl"}
    for arm in arms.values():
        s = arm["summary"]
        assert s["iterations"] == 1 and s["length_mean"] == 8.0  # ignore_eos / min_new_tokens: equal work
        assert all(s[f"{p}_s"] >= 0 for p in bench_vs_trl.PHASES) and s["iteration_s"] > 0
    ours = arms["ours"]["summary"]
    assert ours["compiles_after_warmup"] == 0 and ours["learner_speedup"] > 0
    assert arms["ours"]["generate_reference"]["ms_per_step"] > 0
    assert json.loads(out.read_text())["regimes"]["fixed"]["trl"]["trl"]
    # the benchmark's host-numerics setting stays inside it (it leaked into later tests once)
    assert os.environ.get("SPARSERL_PORTABLE_CPU") == before
    md = (tmp_path / "bench.md").read_text()
    assert "| TRL GRPOTrainer | 1 |" in md and "| ours (Trainer) | 1 |" in md and "padded learner" in md
