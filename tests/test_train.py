"""The trainer: configs and their errors, exact resume, and reward going up on an easy task."""

import dataclasses
import os
import warnings

import jax
import numpy as np
import pytest
from compile_cache import compile_cache_in_process

from sparserl_jax import components
from sparserl_jax.config import load_config
from sparserl_jax.metrics_log import read_metrics
from sparserl_jax.rollout.prompts import pad_prompt_batch
from sparserl_jax.train import Trainer

SMOKE = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "smoke.yaml")
TIMING = ("time/", "throughput/")


def _cfg(tmp_path, *overrides):
    return load_config([SMOKE], [f"train.out_dir={tmp_path}", "train.progress=false", *overrides])


def test_overrides_reach_nested_settings(tmp_path):
    cfg = _cfg(tmp_path, "kv.budget=12", "rl.sars.token_lo=0.4", "model.arch.n_layers=3")
    assert cfg.kv.budget == 12 and cfg.rl.sars.token_lo == 0.4 and cfg.model.arch.n_layers == 3


@pytest.mark.parametrize(
    "override,match",
    [
        ("kv.budgett=3", r"kv\.budgett: unknown setting"),
        ("rl.mode=sparse", r"rl\.mode='sparse'"),
        ("kv.policy=lru", r"kv\.policy='lru'"),
        ("rollout.prompts=0", r"rollout\.prompts=0"),
    ],
)
def test_bad_config_names_the_setting(tmp_path, override, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path, override)


def test_budget_plus_buffer_beyond_max_length_is_refused(tmp_path):
    cfg = _cfg(tmp_path, "kv.budget=60", "kv.buffer=8")  # 32 prompt + 16 new tokens = 48
    with pytest.raises(ValueError, match=r"kv\.budget=60 \+ kv\.buffer=8 exceeds"):
        Trainer(cfg)


def test_batch_must_split_into_minibatches(tmp_path):
    with pytest.raises(ValueError, match="minibatch_size"):
        Trainer(_cfg(tmp_path, "rl.update.minibatch_size=6", "rl.update.micro_batch_size=3"))


def test_prompt_longer_than_the_limit_is_refused():
    with pytest.raises(ValueError, match=r"max_prompt_len=4"):
        pad_prompt_batch([[1, 2, 3, 4, 5]], 0, 4)
    with pytest.raises(ValueError, match=r"max_prompt_len=4"):
        pad_prompt_batch([[1, 2, 3, 4, 5]], 0, 4, fixed=True)


def test_fixed_prompt_width_pads_every_batch_to_the_limit():
    """fixed=True (the SortedRL engine's one prompt width) vs the bucketed default."""
    tokens, lengths = pad_prompt_batch([[1, 2], [3]], 9, 40, fixed=True)
    assert tokens.shape == (2, 40) and lengths.tolist() == [2, 1]
    assert tokens[0, :2].tolist() == [1, 2] and (tokens[0, 2:] == 9).all() and (tokens[1, 1:] == 9).all()
    assert pad_prompt_batch([[1, 2], [3]], 9, 40)[0].shape[1] < 40


def test_empty_and_missing_datasets_and_checkpoints(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="empty"):
        Trainer(_cfg(tmp_path, "data.task=null", f"data.dataset={empty}"))
    with pytest.raises(FileNotFoundError):
        Trainer(_cfg(tmp_path, "data.task=null", f"data.dataset={tmp_path / 'missing.jsonl'}"))
    with pytest.raises(FileNotFoundError, match="nowhere"):
        Trainer(_cfg(tmp_path, f"model.checkpoint={tmp_path / 'nowhere'}"))
    with pytest.raises(FileNotFoundError, match="no-config"):
        load_config([str(tmp_path / "no-config.yaml")])


def _strip_timing(rows):
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def test_resume_continues_the_same_run(tmp_path, tmp_path_factory):
    # the stopped and resumed trainers repeat the first one's programs: compiled once with the
    # session's compilation cache (tests/compile_cache.py; this module's compile counts stay out)
    common = ("train.iterations=3", "sft.steps=8", "train.save_every=1")
    with compile_cache_in_process(tmp_path_factory):
        Trainer(_cfg(tmp_path / "a", *common)).run()
        # the same run, stopped after 2 iterations, then resumed
        Trainer(_cfg(tmp_path / "b", *common[1:], "train.iterations=2")).run()
        Trainer(_cfg(tmp_path / "b", *common)).run()
    a, b = _strip_timing(read_metrics(tmp_path / "a")), _strip_timing(read_metrics(tmp_path / "b"))
    assert [r["step"] for r in b] == [1, 2, 3]
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            np.testing.assert_allclose(rb[k], ra[k], rtol=1e-6, atol=1e-7, err_msg=k)
    assert a[-1]["update/tokens"] > 0


@pytest.mark.slow
def test_training_raises_the_reward_on_an_easy_task(tmp_path):
    """Sparse-RL (snapkv rollouts) on sums of 0..1: a short warm start, then 10 RL iterations."""
    cfg = load_config(
        [SMOKE, SMOKE.replace("smoke.yaml", "learns.yaml")], [f"train.out_dir={tmp_path}", "train.progress=false"]
    )  # the shipped overlay
    trainer = Trainer(cfg)
    trainer.start()
    before = trainer.evaluate(n=64)["accuracy"]
    rewards = [m["reward/mean"] for m in trainer.run()]
    after = trainer.evaluate(n=64)["accuracy"]
    assert after > before + 0.1, (before, after)
    assert np.mean(rewards[-3:]) > np.mean(rewards[:3]) + 0.05, rewards


@pytest.mark.slow
def test_donated_update_keeps_the_reference_params(tmp_path):
    """The update step donates params and optimizer state (rl.update.donate): their old buffers
    are gone after a step, while pi_ref, a copy taken at start(), still reads as the warm start."""
    trainer = Trainer(_cfg(tmp_path, "sft.steps=2", "train.iterations=1"))
    assert trainer.cfg.rl.update.donate
    trainer.start()
    ref_before = jax.device_get(trainer.ref_params)
    old_params, old_opt_state = trainer.params, trainer.opt_state
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.step()
    assert not [w for w in caught if "donated buffers" in str(w.message)]
    assert all(x.is_deleted() for x in jax.tree.leaves((old_params, old_opt_state)))
    ref_after = jax.device_get(trainer.ref_params)
    for a, b in zip(jax.tree.leaves(ref_before), jax.tree.leaves(ref_after)):
        np.testing.assert_array_equal(a, b)
    moved = [
        not np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(ref_before), jax.tree.leaves(jax.device_get(trainer.params)))
    ]
    assert any(moved)  # the policy took a step away from pi_ref
    trainer.save()  # the new params and optimizer state are live buffers


@pytest.mark.slow
def test_no_compilation_after_the_first_iteration_and_dense_evaluation(tmp_path):
    """Every program of the loop (rollout, learner widths, evaluation) compiles in the first
    iteration; later iterations compile nothing (a compile counter, not a timing). The periodic
    evaluation with train.eval_kv=dense is the dense-inference accuracy of the current weights."""
    from jax import monitoring

    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda event, duration, **kw: compiles.append(event) if "backend_compile" in event else None
    )
    trainer = Trainer(
        _cfg(
            tmp_path,
            "sft.steps=2",
            "train.iterations=3",
            "train.eval_every=1",
            "train.eval_kv=dense",
            "train.eval_prompts=4",
            "train.eval_batch_size=4",
            "kv.policy=rkv",
            "kv.budget=8",
            "kv.buffer=4",
            "rl.update.compile_ahead=true",
        )
    )
    seen = []
    log = trainer.state.log_metrics
    trainer.state.log_metrics = lambda it, m: (seen.append((it, len(compiles), dict(m))), log(it, m))
    trainer.run()
    assert [it for it, _, _ in seen] == [1, 2, 3]
    assert seen[0][1] > 0 and seen[1][1] == seen[2][1] == seen[0][1], "compiled after iteration 1"
    assert seen[-1][2]["kv/saving"] > 0  # sparse rollouts, dense evaluation
    dense = dataclasses.replace(trainer.cfg.kv, policy="none")
    assert seen[-1][2]["eval/accuracy"] == trainer.evaluate(kv_cfg=dense)["accuracy"]


def test_eval_temperature_zero_evaluates_greedily(tmp_path):
    """train.eval_temperature=0: held-out evaluation decodes greedily whatever the rollouts'
    temperature, so its sampling keys (the evaluation seed) change nothing."""
    from sparserl_jax.evaluate import evaluate_examples
    from sparserl_jax.rollout.sampling import SamplingConfig

    trainer = Trainer(_cfg(tmp_path, "sft.steps=0", "train.eval_temperature=0", "train.eval_prompts=8"))
    assert trainer.cfg.rollout.temperature == 1.0
    got = trainer.evaluate()
    examples = components.eval_examples(trainer.cfg, trainer.tokenizer, n=8)
    greedy = components.sampler_config(trainer.cfg, trainer.tokenizer, sampling=SamplingConfig(0.0))
    for seed in (1, 2):
        res = evaluate_examples(
            trainer.params,
            trainer.model_cfg,
            trainer.tokenizer,
            examples,
            trainer.parts.reward,
            greedy,
            seed=seed,
            batch_size=4,
            max_prompt_len=trainer.cfg.data.max_prompt_len,
        )
        assert (res["accuracy"], res["mean_length"]) == (got["accuracy"], got["mean_length"])
