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
    argv = ["--smoke", "--regimes", "fixed", "--compute-dtype", "float32", "bfloat16", "--checkpoint", str(ckpt)]
    report = bench_vs_trl.main([*argv, "--out", str(out), "rollout.draw=inverse_cdf"])
    assert report["compute_dtypes"] == ["float32", "bfloat16"]
    for dtype in report["compute_dtypes"]:
        assert set(report["by_dtype"][dtype]["fixed"]) == {"ours", "trl"}
        assert report["by_dtype"][dtype]["fixed"]["ours"]["config"]["model"]["dtype"] == dtype
    assert report["by_dtype"]["float32"]["fixed"]["ours"]["config"]["rollout"]["draw"] == "inverse_cdf"
    best = report["best"]["fixed"]
    per = {
        arm: {
            d: report["by_dtype"][d]["fixed"][arm]["summary"]["iteration_s_per_token"] for d in report["compute_dtypes"]
        }
        for arm in ("ours", "trl")
    }
    assert best["ours"]["iteration_s_per_token"] == min(per["ours"].values())
    assert best["ratio"] == best["ours"]["iteration_s_per_token"] / min(per["trl"].values())
    arms = report["by_dtype"]["float32"]["fixed"]
    assert set(arms) == {"ours", "trl"}
    for arm in arms.values():
        s = arm["summary"]
        assert s["iterations"] == 1 and s["length_mean"] == 8.0  # ignore_eos / min_new_tokens: equal work
        assert all(s[f"{p}_s"] >= 0 for p in bench_vs_trl.PHASES) and s["iteration_s"] > 0
    ours = arms["ours"]["summary"]
    assert ours["compiles_after_warmup"] == 0 and ours["learner_speedup"] > 0
    assert arms["ours"]["generate_reference"]["ms_per_step"] > 0
    assert json.loads(out.read_text())["by_dtype"]["bfloat16"]["fixed"]["trl"]["trl"]
    # the benchmark's host-numerics setting stays inside it (it leaked into later tests once)
    assert os.environ.get("SPARSERL_PORTABLE_CPU") == before
    md = (tmp_path / "bench.md").read_text()
    assert (
        md.count("| TRL GRPOTrainer | 1 |") == 2 and md.count("| ours (Trainer) | 1 |") == 2 and "padded learner" in md
    )
    assert "## bfloat16 compute, fixed response lengths" in md and "## Each at its best precision" in md
