"""The shared argument checks (sparserl_jax/validate.py) and every config section built from
Python with a bad value: a one-line ValueError that names the setting, never a TypeError or a
ZeroDivisionError from deeper in the code, and never a silent acceptance of NaN or a wrong type
in a checked field."""

import dataclasses
import math
import typing

import pytest

from sparserl_jax import config as run_config
from sparserl_jax import validate as V
from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.model.config import ModelConfig, RopeScaling
from sparserl_jax.quant.config import QuantConfig
from sparserl_jax.rl import config as rl_config
from sparserl_jax.rollout import config as rollout_config

GOOD = [
    lambda: V.check_in("x.mode", "a", ("a", "b")),
    lambda: V.check_in("x.mode", "a", {"a": 1}),  # a registry: its keys are accepted
    lambda: V.check_at_least("x.n", 0, 0),
    lambda: V.check_at_least("x.t", 0.5, 0, integer=False),
    lambda: V.check_positive("x.lr", 1e-9),
    lambda: V.check_positive("x.cap", math.inf),
    lambda: V.check_between("x.p", 1.0, 0, 1, lo_open=True),
    lambda: V.check_between("x.p", 0.0, 0, 1, hi_open=True),
    lambda: V.check_bool("x.flag", False),
    lambda: V.check_multiple("x.rows", 12, "x.chunk", 4),
]

BAD = [  # (call, the whole message)
    (lambda: V.check_in("x.mode", "c", ("a", "b")), "x.mode='c': accepted values are ('a', 'b')"),
    (lambda: V.check_in("x.mode", ["a"], ("a",)), "x.mode=['a']: accepted values are ('a',)"),
    (lambda: V.check_at_least("x.n", 0, 1), "x.n=0 must be >= 1"),
    (lambda: V.check_at_least("x.n", 2.0, 1), "x.n=2.0 must be an integer"),
    (lambda: V.check_at_least("x.n", True, 0), "x.n=True must be an integer"),
    (lambda: V.check_at_least("x.n", "3", 1), "x.n='3' must be an integer"),
    (lambda: V.check_at_least("x.t", math.nan, 0, integer=False), "x.t=nan must be a number"),
    (lambda: V.check_positive("x.lr", 0.0), "x.lr=0.0 must be > 0"),
    (lambda: V.check_positive("x.lr", None), "x.lr=None must be a number"),
    (lambda: V.check_positive("x.k", 1.5, integer=True), "x.k=1.5 must be an integer"),
    (lambda: V.check_between("x.p", 0.0, 0, 1, lo_open=True), "x.p=0.0 must be in (0, 1]"),
    (lambda: V.check_between("x.p", 1, 0, 1, hi_open=True), "x.p=1 must be in [0, 1)"),
    (lambda: V.check_between("x.p", -2, -1, 1), "x.p=-2 must be in [-1, 1]"),
    (lambda: V.check_bool("x.flag", 1), "x.flag=1 must be true or false"),
    (lambda: V.check_bool("x.flag", "yes"), "x.flag='yes' must be true or false"),
    (lambda: V.check_multiple("x.rows", 10, "x.chunk", 4), "x.rows=10 must be a multiple of x.chunk=4"),
    (
        lambda: V.check_multiple("x.rows", 10, "x.chunk", 4, "each call's rows"),
        "x.rows=10 must be a multiple of x.chunk=4: each call's rows",
    ),
    (lambda: V.check_multiple("x.rows", 10, "x.chunk", 0), "x.chunk=0 must be >= 1"),
]


@pytest.mark.parametrize("call", GOOD)
def test_accepted_values_pass(call):
    assert call() is None


@pytest.mark.parametrize("call, message", BAD)
def test_rejected_values_raise_one_line_naming_the_setting(call, message):
    with pytest.raises(ValueError) as e:
        call()
    assert str(e.value) == message


# ----------------------------------------------------------------------------- config sections

# Every section with the prefix its errors use (rl's sections are named without "rl.", as in
# their messages since they were written), and the fields whose checks live elsewhere.
SECTIONS = {
    KVConfig: "kv",
    ModelConfig: "model",
    RopeScaling: "model.rope_scaling",
    QuantConfig: "quant",
    rl_config.SarsConfig: "sars",
    rl_config.IbrConfig: "ibr",
    rl_config.TisConfig: "tis",
    rl_config.AcrConfig: "acr",
    rl_config.LossConfig: "loss",
    rl_config.OptimConfig: "optim",
    rl_config.UpdateConfig: "update",
    rl_config.RLConfig: "rl",
    rollout_config.RolloutConfig: "rollout",
    run_config.SFTCurriculumConfig: "sft.curriculum",
    run_config.SFTConfig: "sft",
    run_config.RunConfig: "train",
    run_config.DataConfig: "data",
}
BAD_VALUES = {int: (-1, 2.5, "3", None, True), float: (-1.0, math.nan, "0.5", None), bool: ("yes", 1, None)}


def _numeric_fields(cls):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if tp in BAD_VALUES:
            yield f.name, tp


CASES = [(cls, name, value) for cls in SECTIONS for name, tp in _numeric_fields(cls) for value in BAD_VALUES[tp]]


def _build(cls, **kwargs):
    if cls is run_config.DataConfig:  # exactly one of task / dataset
        kwargs.setdefault("task", "kv_recall")
    return cls(**kwargs)


@pytest.mark.parametrize("cls, name, value", CASES, ids=[f"{SECTIONS[c]}.{n}={v!r}" for c, n, v in CASES])
def test_a_bad_value_is_refused_or_harmless(cls, name, value):
    """A numeric or true/false field given a value of the wrong type, NaN, or a negative number:
    either the section accepts it (a negative number where any is valid: a seed, an entropy
    coefficient) or it raises a one-line ValueError naming the field. A wrong type or NaN
    never passes."""
    setting = f"{SECTIONS[cls]}.{name}"
    try:
        _build(cls, **{name: value})
    except ValueError as e:
        assert setting in str(e) and "\n" not in str(e), str(e)
        return
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    wrong_type = isinstance(value, bool) != (typing.get_type_hints(cls)[name] is bool) or not (
        number or isinstance(value, bool)
    )
    assert not wrong_type, f"{setting}={value!r} was accepted"


SETTINGS = [  # (section, kwargs, a substring of the one-line message)
    (KVConfig, dict(budget=64.0), "kv.budget=64.0 must be an integer"),
    (KVConfig, dict(newline_token_ids=["a"]), "kv.newline_token_ids=['a'] must be a list of token ids"),
    (ModelConfig, dict(n_kv_heads=0), "model.n_kv_heads=0 must be >= 1"),
    (ModelConfig, dict(n_heads=6, n_kv_heads=4), "model.n_heads=6 must be a multiple of model.n_kv_heads=4"),
    (ModelConfig, dict(family="gpt"), "model.family='gpt': accepted values are ('qwen2', 'llama', 'qwen3')"),
    (ModelConfig, dict(dtype="float16"), "model.dtype='float16'"),
    (ModelConfig, dict(attention="flash"), "model.attention='flash'"),
    (ModelConfig, dict(attention="cudnn"), "model.attention=cudnn needs model.dtype=bfloat16"),
    (ModelConfig, dict(d_ff=0), "model.d_ff=0 must be >= 1"),
    (RopeScaling, dict(factor=0.0), "model.rope_scaling.factor=0.0 must be > 0"),
    (QuantConfig, dict(skip="embed"), "quant.skip='embed' must be a list of weight names"),
    (QuantConfig, dict(invariant_scaling="yes"), "quant.invariant_scaling='yes' must be true or false"),
    (rl_config.LossConfig, dict(eps_low=1.0), "loss.eps_low=1.0 must be in [0, 1)"),
    (rl_config.OptimConfig, dict(b2=1.0), "optim.b2=1.0 must be in [0, 1)"),
    (rl_config.OptimConfig, dict(min_lr_ratio=2.0), "optim.min_lr_ratio=2.0 must be in [0, 1]"),
    (rl_config.UpdateConfig, dict(micro_batch_size=0), "update.micro_batch_size=0 must be >= 1"),
    (rollout_config.RolloutConfig, dict(attn_impl="flash"), "rollout.attn_impl='flash'"),
    (rollout_config.RolloutConfig, dict(top_p=0.0), "rollout.top_p=0.0 must be in (0, 1]"),
    (rollout_config.RolloutConfig, dict(rows_per_call=-4), "rollout.rows_per_call=-4 must be 0 (all rows in one call)"),
    (
        rollout_config.RolloutConfig,
        dict(prompts=2, samples=3, rows_per_call=4),
        "rollout.rows_per_call=4 must be 0 (all rows in one call) or a divisor of",
    ),
    (run_config.SFTConfig, dict(batch_size=0), "sft.batch_size=0 must be >= 1"),
    (run_config.RunConfig, dict(progress="no"), "train.progress='no' must be true or false"),
    (run_config.DataConfig, dict(task="kv_recall", max_prompt_len=0), "data.max_prompt_len=0 must be >= 1"),
    (run_config.ModelSource, dict(dtype="int8"), "model.dtype='int8'"),
    (run_config.ModelSource, dict(attention="cuda"), "model.attention='cuda'"),
    (run_config.ModelSource, dict(attention="cudnn"), "model.attention=cudnn needs model.dtype=bfloat16"),
]


@pytest.mark.parametrize("cls, kwargs, message", SETTINGS, ids=[f"{c.__name__}-{'-'.join(k)}" for c, k, _ in SETTINGS])
def test_section_errors_name_the_setting(cls, kwargs, message):
    with pytest.raises(ValueError) as e:
        cls(**kwargs)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_every_section_default_is_valid():
    for cls in [*SECTIONS, rl_config.UpdateConfig, run_config.TrainConfig, run_config.ModelSource]:
        assert _build(cls) == _build(cls)
