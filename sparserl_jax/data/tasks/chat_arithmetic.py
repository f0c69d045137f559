"""Arithmetic for chat models: "What is 23 + 58? Please reason step by step, and put your final
answer within \\boxed{}." A real instruct model (SmolLM2-135M) solves part of it while thinking
aloud for a hundred tokens or more, so GRPO groups have mixed rewards and sparse rollouts evict.

The final answer is the last \\boxed{} of the response or, when there is none and `answer_line`
is on, the number after the last "answer is" / "Answer:" (the MetaMathQA style small instruct
models learned), or, when there is neither and `last_number` is on, the last number of the
response (the usual fallback of GSM8K graders); it is checked against the label with
rewards.math_equal (math-verify).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from sparserl_jax.data.rewards import extract_boxed, math_equal
from sparserl_jax.data.tasks.base import BoxedAnswerTask, check_range

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
OPS = "+-*"
_QUESTION_RE = re.compile(r"What is (-?\d+(?: [+*-] \d+)+)\?")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_ANSWER_LINE_RE = re.compile(r"answer(?: is)?\s*[:=]?\s*\$?\s*(-?\d[\d,]*(?:\.\d+)?)", re.IGNORECASE)


def evaluate_expression(expr: str) -> int:
    """Value of "a op b op c ..." (ops + - *, spaces around them) with * before + and -; no eval."""
    tokens = expr.split(" ")
    total, product, sign = 0, int(tokens[0]), 1
    for op, value in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            product *= int(value)
        else:
            total += sign * product
            sign, product = (1 if op == "+" else -1), int(value)
    return total + sign * product


def extract_answer_line(text: str) -> str | None:
    """The number after the last "answer is" / "answer:" of the text, else None."""
    found = _ANSWER_LINE_RE.findall(text)
    return found[-1].replace(",", "") if found else None


def extract_last_number(text: str) -> str | None:
    """The last number of the text (thousands commas dropped), else None."""
    found = _NUMBER_RE.findall(text)
    return found[-1].replace(",", "") if found else None


@dataclasses.dataclass(frozen=True)
class ChatArithmeticTask(BoxedAnswerTask):
    """`n_terms` integers ~ U[min_value, max_value] joined by operators drawn from `ops`, asked as
    a chat question followed by `instruction`; the label is the value (* before + and -)."""

    name = "chat_arithmetic"
    min_value: int = 10
    max_value: int = 99
    n_terms: int = 2
    ops: str = "+"
    instruction: str = INSTRUCTION
    answer_line: bool = True  # without a \boxed{}, accept "The answer is N" / "Answer: N"
    last_number: bool = False  # without either, accept the response's last number

    def __post_init__(self):
        check_range("chat_arithmetic (min_value, max_value)", self.min_value, self.max_value, 0)
        if self.n_terms < 2:
            raise ValueError(f"chat_arithmetic n_terms={self.n_terms} must be >= 2")
        if not self.ops or set(self.ops) - set(OPS):
            raise ValueError(
                f"chat_arithmetic ops={self.ops!r} must be a non-empty combination of {', '.join(repr(o) for o in OPS)}"
            )

    def question(self, rng: np.random.Generator) -> str:
        terms = rng.integers(self.min_value, self.max_value + 1, size=self.n_terms)
        ops = [self.ops[int(i)] for i in rng.integers(0, len(self.ops), size=self.n_terms - 1)]
        return str(int(terms[0])) + "".join(f" {op} {int(t)}" for op, t in zip(ops, terms[1:]))

    def sample_one(self, rng: np.random.Generator) -> tuple[str, str]:
        prompt = f"What is {self.question(rng)}?" + (f" {self.instruction}" if self.instruction else "")
        return prompt, self.solve(prompt)

    @staticmethod
    def _expression(prompt: str) -> str:
        m = _QUESTION_RE.search(prompt)
        if m is None:
            raise ValueError(f"not a chat_arithmetic prompt: {prompt[:60]!r}")
        return m.group(1)

    def solve(self, prompt: str) -> str:
        return str(evaluate_expression(self._expression(prompt)))

    def working(self, prompt: str) -> str:
        return f"{self._expression(prompt)} = {self.solve(prompt)}."

    def final_answer(self, response: str) -> str | None:
        """The answer the reward reads: the last \\boxed{}, else (answer_line) the answer line,
        else (last_number) the last number."""
        answer = extract_boxed(response)
        if answer is None and self.answer_line:
            answer = extract_answer_line(response)
        if answer is None and self.last_number:
            answer = extract_last_number(response)
        return answer

    def reward(self, response: str, label: str) -> float:
        answer = self.final_answer(response)
        return float(answer is not None and math_equal(answer, label))
