"""The chat_arithmetic task (prompts, labels, the math-verify reward with its answer-line fallback,
errors naming the setting) and experiments/configs/real/smollm2_chat_arithmetic.yaml: it loads,
and shrunk onto a tiny Llama checkpoint with a chat template it trains for an iteration."""

import os
import re

import numpy as np
import pytest

from sparserl_jax.config import load_config
from sparserl_jax.data.tasks import get_task
from sparserl_jax.data.tasks.chat_arithmetic import (
    INSTRUCTION,
    evaluate_expression,
    extract_answer_line,
    extract_last_number,
)

CONFIG = os.path.join(os.path.dirname(__file__), "..", "experiments", "configs", "real", "smollm2_chat_arithmetic.yaml")
COLLAPSE_CONFIG = os.path.join(os.path.dirname(CONFIG), "smollm2_collapse.yaml")


def test_prompts_are_seeded_questions_with_the_instruction():
    task = get_task("chat_arithmetic", min_value=3, max_value=12, n_terms=3, ops="+-*")
    pairs = task.sample(np.random.default_rng(0), 200)
    assert pairs == task.sample(np.random.default_rng(0), 200)
    assert pairs != task.sample(np.random.default_rng(1), 200)
    seen_ops = set()
    for prompt, label in pairs:
        m = re.fullmatch(r"What is (\d+) ([+*-]) (\d+) ([+*-]) (\d+)\? (.*)", prompt)
        assert m and m.group(6) == INSTRUCTION
        a, op1, b, op2, c = m.group(1, 2, 3, 4, 5)
        assert all(3 <= int(x) <= 12 for x in (a, b, c))
        seen_ops |= {op1, op2}
        assert int(label) == eval(f"{a}{op1}{b}{op2}{c}")  # the test may eval; the task does not
        assert task.solve(prompt) == label
    assert seen_ops == {"+", "-", "*"}


def test_evaluate_expression_precedence():
    assert evaluate_expression("2 + 3 * 4") == 14
    assert evaluate_expression("2 * 3 - 4 * 5") == -14
    assert evaluate_expression("10 - 3 - 2") == 5
    assert evaluate_expression("7") == 7


def test_defaults_two_digit_sums_and_custom_instruction():
    task = get_task("chat_arithmetic")
    for prompt, label in task.sample(np.random.default_rng(3), 50):
        a, b = map(int, re.match(r"What is (\d+) \+ (\d+)\?", prompt).groups())
        assert 10 <= a <= 99 and 10 <= b <= 99 and int(label) == a + b
    bare = get_task("chat_arithmetic", instruction="")
    prompt, _ = bare.sample(np.random.default_rng(3), 1)[0]
    assert re.fullmatch(r"What is \d+ \+ \d+\?", prompt)


@pytest.mark.parametrize(
    "response, reward",
    [
        ("23 + 58: 3 + 8 = 11, carry 1; 2 + 5 + 1 = 8. So \\boxed{81}.", 1.0),
        ("The sum is $\\boxed{81.0}$", 1.0),  # math-verify: 81.0 == 81
        ("I think \\boxed{80}, no wait, \\boxed{81}", 1.0),  # the last box counts
        ("\\boxed{81} ... correction: \\boxed{82}", 0.0),
        ("Adding the tens and the ones gives 81.\nThe answer is: 81", 1.0),  # MetaMathQA style
        ("Answer: 81.", 1.0),
        ("The answer is 1,081", 0.0),
        ("The answer is 80. Or maybe 81.", 0.0),  # no trailing bare numbers
        ("First 20 + 50 = 70, then 3 + 8 = 11, 70 + 11 = 81.", 0.0),  # no final-answer marker
        ("\\boxed{80}. The answer is 81", 0.0),  # a box takes precedence over the answer line
        ("so \\boxed{81", 0.0),  # truncated box and no answer line
    ],
)
def test_reward(response, reward):
    assert get_task("chat_arithmetic").reward(response, "81") == reward


def test_answer_line_can_be_switched_off_and_negative_labels():
    strict = get_task("chat_arithmetic", answer_line=False)
    assert strict.reward("The answer is 81", "81") == 0.0
    assert strict.reward("\\boxed{81}", "81") == 1.0
    assert extract_answer_line("the final answer is -12.") == "-12"
    assert get_task("chat_arithmetic").reward("Answer: -12", "-12") == 1.0
    assert extract_answer_line("no marker 12") is None


@pytest.mark.parametrize(
    "response, reward",
    [
        ("First 20 + 50 = 70, then 3 + 8 = 11, 70 + 11 = 81.", 1.0),  # no marker: the last number
        ("So 81 is the sum, not 1,080", 0.0),  # the last number, even when wrong
        ("The answer is 80. Or maybe 81.", 0.0),  # an answer line wins over the last number
        ("\\boxed{80}, 81", 0.0),  # and a box over both
        ("no number at all", 0.0),
    ],
)
def test_last_number_fallback(response, reward):
    assert get_task("chat_arithmetic", last_number=True).reward(response, "81") == reward
    assert get_task("chat_arithmetic").reward("First 70 + 11 = 81.", "81") == 0.0  # off by default
    assert extract_last_number("from -3 to 1,234.5") == "1234.5" and extract_last_number("none") is None


def test_demonstration_earns_the_reward():
    task = get_task("chat_arithmetic", ops="+-*", n_terms=3)
    for prompt, label in task.sample(np.random.default_rng(5), 20):
        demo = task.demonstration(prompt)
        assert demo.endswith("\\boxed{" + label + "}") and task.reward(demo, label) == 1.0


@pytest.mark.parametrize(
    "options, match",
    [
        ({"ops": "/"}, r"chat_arithmetic ops='/' must be a non-empty combination of '\+', '-', '\*'"),
        ({"ops": ""}, "chat_arithmetic ops=''"),
        ({"n_terms": 1}, "chat_arithmetic n_terms=1 must be >= 2"),
        ({"min_value": 50, "max_value": 20}, r"chat_arithmetic \(min_value, max_value\)=\(50, 20\)"),
        ({"min_value": -1}, r"\(min_value, max_value\)=\(-1, 99\) must satisfy 0 <= min"),
        ({"digits": 2}, r"task 'chat_arithmetic' has no option\(s\) \['digits'\]; accepted: \['min_value'"),
    ],
)
def test_bad_options_name_the_setting(options, match):
    with pytest.raises(ValueError, match=match):
        get_task("chat_arithmetic", **options)


def test_bad_option_type_through_the_config_names_the_setting():
    with pytest.raises(ValueError, match=r"data.task_options.n_terms='two': expected an integer"):
        get_task("chat_arithmetic", n_terms="two")


def test_not_a_prompt():
    with pytest.raises(ValueError, match="not a chat_arithmetic prompt"):
        get_task("chat_arithmetic").solve("Compute 1+2.")


# ---------------------------------------------------------------- the RL config


@pytest.mark.parametrize("config", [CONFIG, COLLAPSE_CONFIG])
def test_config_loads_with_the_calibrated_settings(config):
    cfg = load_config([config])
    assert cfg.data.task == "chat_arithmetic" and cfg.data.chat_template is True
    assert cfg.model.checkpoint == "checkpoints/smollm2-135m"
    assert cfg.rollout.max_new_tokens >= 128 and cfg.kv.policy == "rkv"
    assert cfg.rollout.rows % cfg.rl.update.minibatch_size == 0
    get_task(cfg.data.task, **dict(cfg.data.task_options))


@pytest.mark.extended
@pytest.mark.slow
def test_config_trains_on_a_tiny_chat_checkpoint(tmp_path):
    """The config's settings, shrunk (lengths, budget, batch) onto a tiny random Llama with the char
    tokenizer's chat template: one iteration of sparse rollouts and a GRPO update, then an eval."""
    pytest.importorskip("transformers")
    from hf_fixtures import make_tiny_hf_checkpoint

    from sparserl_jax.tokenizer import CharTokenizer
    from sparserl_jax.train import Trainer

    ckpt = make_tiny_hf_checkpoint("llama", tmp_path)
    CharTokenizer().save(ckpt)
    cfg = load_config(
        [CONFIG],
        [
            f"model.checkpoint={ckpt}",
            "data.max_prompt_len=160",
            "rollout.prompts=2",
            "rollout.samples=2",
            "rollout.max_new_tokens=24",
            "kv.budget=64",
            "kv.buffer=8",
            "rl.update.minibatch_size=4",
            "rl.update.micro_batch_size=2",
            "rl.update.score_batch_size=4",
            "train.iterations=1",
            "train.eval_prompts=2",
            f"train.out_dir={tmp_path / 'run'}",
            "train.progress=false",
        ],
    )
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    (metrics,) = trainer.run()
    prompt = trainer.prompts.task.sample(np.random.default_rng(0), 1)[0][0]
    assert cfg.data.task_options["instruction"] in prompt
    assert 0.0 <= metrics["reward/mean"] <= 1.0 and np.isfinite(metrics["update/loss"])
    assert metrics["kv/saving"] > 0.0  # the budget is below prompt + response: R-KV evicted
    assert 0.0 <= trainer.evaluate()["accuracy"] <= 1.0
