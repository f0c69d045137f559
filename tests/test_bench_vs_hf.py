"""experiments/bench/bench_vs_hf.py runs end to end in smoke mode, on its random model and on a
checkpoint directory (--checkpoint, as for SmolLM2), and writes its JSON and markdown."""

import json
import os

import pytest
from hf_fixtures import make_tiny_hf_checkpoint

pytestmark = pytest.mark.xdist_group("bench_vs_hf")


@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_smoke_writes_rows(tmp_path, use_checkpoint, monkeypatch):
    # bench_vs_hf sets XLA_FLAGS for its own process when imported: keep it out of later
    # tests' subprocesses (monkeypatch restores the variable)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    from experiments.bench import bench_vs_hf

    args = ["--smoke", "--batch", "1", "2", "--out", str(tmp_path / "b.json")]
    if use_checkpoint:
        ckpt = make_tiny_hf_checkpoint("llama", tmp_path, tie=True)
        args += ["--checkpoint", str(ckpt)]
    report = bench_vs_hf.main(args)
    saved = json.loads((tmp_path / "b.json").read_text())
    assert [r["batch"] for r in saved["results"]] == [1, 2]
    for r in report["results"]:
        assert all(v > 0 for v in r["tokens_per_s"].values())
        assert 0.0 <= r["greedy_match_dense_vs_hf"] <= 1.0
    if use_checkpoint:
        assert saved["checkpoint"] == str(ckpt) and saved["model"]["family"] == "llama"
        # the same weights in both engines: greedy tokens agree (float32, a tiny model)
        assert all(r["greedy_match_dense_vs_hf"] >= 0.9 for r in report["results"])
    md = (tmp_path / "b.md").read_text()
    assert "| 1 |" in md and "| 2 |" in md
