"""The SFT warm start: the curriculum phase (sft.curriculum) and its settings."""

import os

import jax
import numpy as np
import pytest
from compile_cache import compile_cache_in_process

from sparserl_jax import components, sft
from sparserl_jax.config import load_config
from sparserl_jax.train import Trainer

SMOKE = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "smoke.yaml")
WALK = (
    "data.task=cycle_walk",
    "data.task_options={min_steps: 8, max_steps: 12, numbering: down, memo: true}",
    "rollout.max_new_tokens=72",
)
CURRICULUM = (
    "sft.curriculum.steps=3",
    "sft.curriculum.task_options={min_steps: 2, max_steps: 3}",
    "sft.curriculum.max_new_tokens=24",
)


@pytest.fixture(scope="module", autouse=True)
def _compile_cache(tmp_path_factory):
    """Every warm start is a fresh SFT run of the same programs: with the session's
    compilation cache they compile once (tests/compile_cache.py)."""
    with compile_cache_in_process(tmp_path_factory):
        yield


def _cfg(tmp_path, *overrides):
    return load_config([SMOKE], [f"train.out_dir={tmp_path}", "train.progress=false", *WALK, *overrides])


def test_curriculum_phase_trains_on_the_easier_task_first(tmp_path, monkeypatch):
    """sft.curriculum.steps batches of the curriculum's task (its options merged over the task's,
    its own width) come before sft.steps batches of the task itself."""
    calls = []
    original = sft.demonstration_batch

    def spy(task, tokenizer, rng, n, width, **kw):
        tokens, mask = original(task, tokenizer, rng, n, width, **kw)
        prompts = [tokenizer.decode(row.tolist()).split(":")[0] for row in tokens]
        calls.append((task, width, [int(p.split(", ")[1].split()[0]) for p in prompts]))
        return tokens, mask

    monkeypatch.setattr(sft, "demonstration_batch", spy)
    trainer = Trainer(_cfg(tmp_path, "sft.steps=2", *CURRICULUM))
    trainer.start()
    assert [c[1] for c in calls] == [32 + 24] * 3 + [32 + 72] * 2
    easy, main = calls[0][0], calls[-1][0]
    assert (easy.min_steps, easy.max_steps, easy.memo, easy.numbering) == (2, 3, True, "down")
    assert (main.min_steps, main.max_steps) == (8, 12)
    assert all(2 <= s <= 3 for c in calls[:3] for s in c[2])
    assert all(8 <= s <= 12 for c in calls[3:] for s in c[2])


def test_curriculum_changes_the_warm_start_and_runs_alone(tmp_path):
    def warm(name, *overrides):
        trainer = Trainer(_cfg(tmp_path / name, *overrides))
        trainer.start()
        return jax.device_get(trainer.params)

    plain = warm("plain", "sft.steps=2")
    with_curriculum = warm("curriculum", "sft.steps=2", *CURRICULUM)
    only = warm("only", "sft.steps=0", *CURRICULUM)
    init = warm("init", "sft.steps=0")
    leaves = lambda tree: jax.tree.leaves(tree)  # noqa: E731
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(plain), leaves(with_curriculum)))
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(init), leaves(only)))


def test_curriculum_sft_is_deterministic(tmp_path):
    cfg = _cfg(tmp_path, "sft.steps=1", *CURRICULUM)
    parts = components.build_model(cfg)
    task, easy = parts.task, components.curriculum_task(cfg)
    runs = [
        sft.sft_warm_start(
            parts.params,
            parts.model_cfg,
            task,
            parts.tokenizer,
            cfg.sft,
            seed=0,
            width=104,
            curriculum_task=easy,
            curriculum_width=56,
            log=lambda *_: None,
        )
        for _ in range(2)
    ]
    for a, b in zip(jax.tree.leaves(runs[0][0]), jax.tree.leaves(runs[1][0])):  # same programs
        np.testing.assert_array_equal(a, b)
    assert runs[0][1] == runs[1][1]


@pytest.mark.parametrize(
    "overrides,match",
    [
        (("sft.curriculum.steps=-1",), r"sft\.curriculum\.steps=-1"),
        (("sft.curriculum.max_new_tokens=-4",), r"sft\.curriculum\.max_new_tokens=-4"),
        (("sft.curriculum.colour=red",), r"sft\.curriculum\.colour: unknown setting"),
        (
            (*CURRICULUM[:2], "sft.curriculum.max_new_tokens=80"),
            r"sft\.curriculum\.max_new_tokens=80 exceeds rollout\.max_new_tokens=72",
        ),
        (
            ("sft.curriculum.steps=3", "sft.curriculum.task_options={min_steps: 9, max_steps: 3}"),
            r"cycle_walk \(min_steps, max_steps\)",
        ),
    ],
)
def test_bad_curriculum_settings_are_named(tmp_path, overrides, match):
    with pytest.raises(ValueError, match=match):
        Trainer(_cfg(tmp_path, *overrides))


def test_curriculum_needs_a_synthetic_task(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    with pytest.raises(ValueError, match=r"sft\.curriculum needs a synthetic task"):
        components.curriculum_task(_cfg(tmp_path, "data.task=null", f"data.dataset={data}", *CURRICULUM))


def test_without_curriculum_there_is_no_curriculum_task(tmp_path):
    assert components.curriculum_task(_cfg(tmp_path)) is None
