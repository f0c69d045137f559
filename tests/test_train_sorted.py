"""The trainer with rollout.scheduler='sorted': the same seed gives the same run, a run killed at a
group boundary and resumed gives the same metrics, and the agreement's tail is logged."""

import os
import shutil

import numpy as np
import pytest
from compile_cache import compile_cache_in_process

from sparserl_jax.config import load_config
from sparserl_jax.metrics_log import read_metrics
from sparserl_jax.train import Trainer

SMOKE = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "smoke.yaml")
TIMING = ("time/", "throughput/", "rollout/bubble_wall")  # wall-clock dependent


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """The killed and resumed trainers repeat the first one's programs: with the session's
    compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


def _cfg(out, *overrides):
    return load_config(
        [SMOKE],
        [
            f"train.out_dir={out}",
            "train.progress=false",
            "rollout.scheduler=sorted",
            "sorted.mode=partial",
            "sorted.group_batches=2",
            "sorted.slots=8",
            "sft.steps=4",
            "train.save_every=1",
            "train.eval_prompts=4",
            *overrides,
        ],
    )


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.mark.slow
def test_sorted_run_resumes_exactly_from_a_group_boundary(tmp_path):
    run = Trainer(_cfg(tmp_path / "a", "train.iterations=3"))
    run.run()
    # one engine for the run (prompts padded to data.max_prompt_len): one segment program, one
    # harvest copy, and at most the insert buckets Q / 8 .. Q (fresh prompts only)
    eng = run.source.scheduler.engine
    assert eng.P == run.cfg.data.max_prompt_len
    assert eng._segment._cache_size() == 1 and eng._harvest._cache_size() == 1
    assert eng._insert._cache_size() <= 4
    # killed after logging iteration 3, before its checkpoint: resumed from checkpoint 2 (the end of
    # the first group), it truncates the log and computes iteration 3 again
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "checkpoints" / "3")
    logged = []
    Trainer(_cfg(tmp_path / "b", "train.iterations=3"), log=lambda *a, **k: logged.append(" ".join(map(str, a)))).run()
    assert any("at iteration 2" in line for line in logged), logged
    a, b = _strip(read_metrics(tmp_path / "a")), _strip(read_metrics(tmp_path / "b"))
    assert [r["step"] for r in b] == [1, 2, 3]
    assert a[-1]["sorted/group"] == 1.0 and a[1]["sorted/staleness_max"] <= 1.0
    # the slot engine records the sampler's top candidates: every iteration logs the agreement
    for r in a:
        assert all(0 < r[f"agreement/{k}"] <= 1 for k in ("mean", "p1", "p5", "p50", "upper_mean", "upper_p5")), r
        assert r["agreement/mean"] <= r["agreement/upper_mean"]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            np.testing.assert_allclose(rb[k], ra[k], rtol=1e-6, atol=1e-7, err_msg=k)
