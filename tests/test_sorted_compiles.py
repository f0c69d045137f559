"""Compile once per run: after the first iteration no training step compiles anything, for the
batch scheduler and SortedRL (on-policy, partial with re-prefilled resumes), from a warm start
restored from disk as the figure scripts run it, with one optimizer step per iteration (so a
program the update runs once per iteration shows a recompile in the next one). A compile counter
from jax.monitoring (sparserl_jax.compile_clock), not a timing. SortedRL's engine counts the
compilations inside its own calls apart (EngineStats.compiles): all in the first iteration."""

import os

import jax
import pytest

from sparserl_jax import compile_clock
from sparserl_jax.config import load_config
from sparserl_jax.train import Trainer

SMOKE = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "smoke.yaml")
ARMS = {  # smoke.yaml: 4 prompts x 4 samples; one minibatch = the whole update batch
    "batch": ("rollout.prompts=8", "rl.update.minibatch_size=32"),
    "sorted_on_policy": ("rollout.scheduler=sorted", "sorted.mode=on_policy", "rl.update.minibatch_size=16"),
    "sorted_partial_prefill": (
        "rollout.scheduler=sorted",
        "sorted.mode=partial",
        "sorted.resume=prefill",
        "rl.update.minibatch_size=16",
    ),
}


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    out = tmp_path_factory.mktemp("warm")
    Trainer(
        load_config(
            [SMOKE],
            [
                f"train.out_dir={out}",
                "train.progress=false",
                "sft.steps=4",
                "train.iterations=0",
                "rl.mode=dense",
                "kv.policy=none",
            ],
        ),
        log=lambda *a, **k: None,
    ).run()
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "arm",
    [  # the batch scheduler's compile-once: tests/test_train.py's (the extended tier adds it from disk here)
        pytest.param(arm, marks=pytest.mark.extended) if arm == "batch" else arm for arm in ARMS
    ],
)
def test_no_compilation_after_the_first_iteration(arm, warm_start, tmp_path):
    cfg = load_config(
        [SMOKE],
        [
            f"train.out_dir={tmp_path}",
            "train.progress=false",
            f"model.init_from={warm_start}",
            "sft.steps=0",
            "sft.curriculum.steps=0",
            "sorted.group_batches=2",
            "sorted.slots=8",
            "rl.update.micro_batch_size=4",
            "train.iterations=4",
            "rl.update.compile_ahead=true",
            *ARMS[arm],
        ],
    )
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.start()
    source, rollout_compiles = trainer.source, []
    next_batch = source.next

    def counted_next(*args, **kwargs):
        since = compile_clock.Since()
        out = next_batch(*args, **kwargs)
        rollout_compiles.append(since.compiles)
        return out

    source.next = counted_next
    step_compiles, engine_compiles = [], []
    engine = getattr(source, "scheduler", None) and source.scheduler.engine
    for _ in range(3 if arm == "batch" else 4):  # sorted: two groups
        since, before = compile_clock.Since(), engine and engine.stats.compiles
        trainer.step()
        trainer.iteration += 1
        step_compiles.append(since.compiles)
        if engine:
            engine_compiles.append(engine.stats.compiles - before)
    if engine:
        assert engine_compiles[0] > 0 and engine.stats.compile_seconds > 0
        assert engine_compiles[1:] == [0] * (len(engine_compiles) - 1)
    assert rollout_compiles[0] > 0 and rollout_compiles[1:] == [0] * (len(rollout_compiles) - 1)
    assert step_compiles[0] > 0
    # the optimizer's step counts start committed, as the update returns them (else it recompiles)
    assert all(x.committed for x in jax.tree.leaves(trainer.learner.init_opt_state(trainer.params)))
    assert step_compiles[1:] == [0] * (len(step_compiles) - 1), step_compiles
