"""experiments/real/calibrate.py end to end on a tiny Llama checkpoint with the char tokenizer's
chat template: greedy and sampled arms, dense and sparse, their group and length statistics, and
results.md / results.json accumulating one run per call."""

import json
import os

import numpy as np
import pytest
from compile_cache import compile_cache_in_process

from experiments.real import calibrate

HERE = os.path.dirname(__file__)

CONFIG = os.path.join(HERE, "..", "experiments", "configs", "real", "smollm2_chat_arithmetic.yaml")


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """Each measurement builds its sampler and scorer afresh: with the session's
    compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


def test_group_and_length_stats():
    g = calibrate.group_stats(np.array([[1, 1], [0, 1], [0, 0], [1, 0]], float))
    assert g == {"mixed": 0.5, "all_right": 0.25, "all_wrong": 0.25, "pass_at_k": 0.75}
    L = calibrate.length_stats(np.array([10, 128, 200, 256]), 256)
    assert L["at_cap"] == 0.25 and L["ge_128"] == 0.75 and L["max"] == 256


def test_study_targets_read_the_declared_numbers():
    base = {
        "dense_reward": 0.3,
        "dense_mixed": 0.6,
        "sparse_reward": 0.2,
        "budget": 64,
        "prompt_max": 57,
        "kv_saving": 0.33,
        "k3": 0.05,
    }
    met = lambda c: [name for name, _, test in calibrate.STUDY_TARGETS if test(c)]  # noqa: E731
    assert len(met(base)) == len(calibrate.STUDY_TARGETS)
    for bad in (
        {"dense_reward": 0.2},
        {"dense_reward": 0.8, "sparse_reward": 0.5},
        {"dense_mixed": 0.4},
        {"sparse_reward": 0.1},
        {"budget": 57},
        {"kv_saving": 0.25},
        {"k3": 0.01},
    ):
        assert len(met({**base, **bad})) == len(calibrate.STUDY_TARGETS) - 1, bad


def test_calibrate_on_a_tiny_checkpoint(tmp_path):
    pytest.importorskip("transformers")
    from hf_fixtures import make_tiny_hf_checkpoint

    from sparserl_jax.tokenizer import CharTokenizer

    ckpt = make_tiny_hf_checkpoint("llama", tmp_path)
    CharTokenizer().save(ckpt)
    out = tmp_path / "cal"
    common = [
        "--config",
        CONFIG,
        "--prompts",
        "3",
        "--samples",
        "2",
        "--rows-per-call",
        "6",
        "--out",
        str(out),
        f"model.checkpoint={ckpt}",
        "data.max_prompt_len=160",
        "rollout.max_new_tokens=20",
        "kv.buffer=4",
    ]
    data = calibrate.main([*common, "--budgets", "48", "--note", "first"])
    (run,) = data["runs"]
    names = [a["name"] for a in run["arms"]]
    assert names == ["greedy dense", "greedy rkv@48", "sampled dense", "sampled rkv@48"]
    for a in run["arms"]:
        assert 0 <= a["accuracy"] <= 1 and np.array(a["rewards"]).shape == (3, a["k"])
        assert max(a["response_lengths"]) <= 20 and a["lengths"]["max"] <= 20
        assert (a["kv_saving"] == 0) == (a["policy"] == "none")
    assert run["arms"][2]["k"] == 2 and 0 <= run["arms"][2]["groups"]["mixed"] <= 1
    assert 0 <= run["arms"][1]["same_as_dense"] <= 1
    # the sampled sparse arm is scored under the dense model: the first iteration's mismatch
    assert "mismatch" not in run["arms"][2]
    m = run["arms"][3]["mismatch"]
    assert m["kl_k3"] >= 0 and 0 <= m["token_reject"] <= 1 and m["tokens"] == sum(run["arms"][3]["response_lengths"])
    # a second call (another setting, greedy dense only) appends a run; results.md shows both
    data = calibrate.main([*common, "--arms", "greedy", "--dense-only", "data.task_options.max_value=30"])
    assert len(data["runs"]) == 2 and [a["name"] for a in data["runs"][1]["arms"]] == ["greedy dense"]
    assert data["runs"][1]["task_options"]["max_value"] == 30
    md = (out / "results.md").read_text()
    assert "## Run 1: min_value=1, max_value=20" in md and "## Run 2:" in md and "max_value=30" in md
    assert "Command: `python experiments/real/calibrate.py --config" in md and "first" in md
    study = md[md.index("## The collapse study's setting") : md.index("## Run 1")]
    assert study.count("\n| 1 | ") == 1 and "| 2 | " not in study  # run 1's sampled sparse arm, not run 2
    assert md.count("Provenance: commit") == 2 and "portable CPU settings" in md  # one per run
    # the commit and tree at each run's start (its own first save writes into the tree), its wall time at the end
    assert all(r["provenance"]["commit_at"] == "start" and r["provenance"]["wall_s"] is not None for r in data["runs"])
    assert "at the start of the run" in md
    assert json.loads((out / "results.json").read_text()) == data
    with pytest.raises(FileNotFoundError, match="model.checkpoint="):
        calibrate.main(["--config", CONFIG, "--out", str(out), "model.checkpoint=/nonexistent"])
