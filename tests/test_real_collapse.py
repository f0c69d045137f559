"""experiments/real_collapse.py at smoke size on a tiny checkpoint: every arm and seed trains with
the dense periodic evaluation, the table, the rules' verdicts and the figure are written, and
--replot re-renders them from results.json alone."""

import json
import os
import sys

import jax
import pytest
from compile_cache import compile_cache_in_process

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "experiments"))
import real_collapse  # noqa: E402

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


@pytest.mark.slow
def test_smoke_study_and_replot(tmp_path):
    from hf_fixtures import make_tiny_hf_checkpoint

    from sparserl_jax.tokenizer import CharTokenizer

    ckpt = make_tiny_hf_checkpoint("llama", tmp_path / "ckpt")
    CharTokenizer().save(ckpt)
    out = tmp_path / "out"
    data = real_collapse.main(["--smoke", "--seeds", "0", "--runs-dir", str(tmp_path / "runs"),
                               "--out", str(out), f"model.checkpoint={ckpt}"])
    res = data["results"]
    assert set(res) == set(real_collapse.ARMS) and all(len(rows) == 1 for rows in res.values())
    for arm, (_, sparse, _) in real_collapse.ARMS.items():
        r = res[arm][0]
        assert set(r["evals"]) == {"1", "2"} and r["dense_acc"] == r["evals"]["2"]
        assert (r["train_kv_saving"] > 0) == sparse
        assert r["collapsed"] == (r["dense_acc"] < 0.5 * r["untrained_acc"])
    md = (out / "results.md").read_text()
    assert "**Plan, fixed before the runs.**" in md and "**Verdicts**" in md and "Provenance: commit" in md
    assert (out / "arms.json").exists() and (out / "collapse.png").stat().st_size > 0
    before = json.loads((out / "results.json").read_text())
    (out / "collapse.png").unlink()
    real_collapse.main(["--replot", str(out)])
    assert (out / "collapse.png").exists() and json.loads((out / "results.json").read_text()) == before
