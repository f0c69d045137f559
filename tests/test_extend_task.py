"""Adding a synthetic task, walked through once as docs/layout.md ("How to extend") says, with a
toy "reverse_digits" task (write a digit string backwards):

1. its file, sparserl_jax/data/tasks/reverse_digits.py in the package (here in this test): a
   frozen dataclass (its fields are the task's options) on BoxedAnswerTask with sample_one and
   solve;
2. one registry line in sparserl_jax/data/tasks/__init__.py: TASKS["reverse_digits"] = the class.

data.task=reverse_digits (with data.task_options) then builds the model's tokenizer and the
trainer's prompt batches, and the task scores its own demonstrations 1. monkeypatch restores the
registry after the test."""

import dataclasses
import re

import numpy as np
import pytest

from sparserl_jax import components
from sparserl_jax.config import load_config
from sparserl_jax.data.tasks import TASKS, Task, get_task
from sparserl_jax.data.tasks.base import BoxedAnswerTask, digits

# ----------------------------------------------------------------------------- 1. the file

_PROMPT_RE = re.compile(r"^Reverse the digits: (\d+)\n$")


@dataclasses.dataclass(frozen=True)
class ReverseDigitsTask(BoxedAnswerTask):
    """n_digits random digits; the answer is the same digits in reverse order."""

    name = "reverse_digits"
    n_digits: int = 6

    def __post_init__(self):
        if self.n_digits < 1:
            raise ValueError(f"reverse_digits n_digits={self.n_digits} must be >= 1")

    def sample_one(self, rng: np.random.Generator) -> tuple[str, str]:
        shown = digits(rng, self.n_digits)
        return f"Reverse the digits: {shown}\n", shown[::-1]

    def solve(self, prompt: str) -> str:
        m = _PROMPT_RE.match(prompt)
        if m is None:
            raise ValueError(f"not a reverse_digits prompt: {prompt[:60]!r}")
        return m.group(1)[::-1]


# ----------------------------------------------------------------------------- the walk-through


@pytest.fixture
def registered(monkeypatch):
    with pytest.raises(ValueError, match=r"task='reverse_digits' is not registered"):
        get_task("reverse_digits")
    monkeypatch.setitem(TASKS, "reverse_digits", ReverseDigitsTask)  # 2. the registry line
    yield
    monkeypatch.undo()
    assert "reverse_digits" not in TASKS


def test_a_toy_task_added_through_the_registry(registered):
    task = get_task("reverse_digits", n_digits="4")  # options are coerced like YAML values
    assert isinstance(task, Task) and task.n_digits == 4
    with pytest.raises(ValueError, match=r"has no option\(s\) \['width'\]"):
        get_task("reverse_digits", width=3)

    cfg = load_config(
        [],
        [
            "data.task=reverse_digits",
            "data.task_options={n_digits: 5}",
            "data.max_prompt_len=64",
            "rollout.max_new_tokens=16",
        ],
    )
    built = components.build_model(cfg)  # a random tiny model with the task's tokenizer
    assert isinstance(built.task, ReverseDigitsTask) and built.task.n_digits == 5
    batch = components.prompt_source(cfg, built.tokenizer, batch_size=4).next_batch()
    assert len(batch) == 4
    for ex in batch:
        assert _PROMPT_RE.match(ex.prompt) and len(ex.label) == 5
        assert built.tokenizer.decode(list(ex.prompt_ids)) == ex.prompt
        assert ex.label == built.task.solve(ex.prompt)
        assert built.reward(built.task.demonstration(ex.prompt), ex.label) == 1.0
        assert built.reward("\\boxed{" + ex.label[::-1] + "}", ex.label) == (1.0 if ex.label == ex.label[::-1] else 0.0)
