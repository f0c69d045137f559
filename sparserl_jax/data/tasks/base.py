"""What a synthetic verifiable task is, and the pieces the shipped tasks share.

A task draws (prompt, label) pairs from a seeded numpy Generator, scores a response against a
label, and knows the ideal response to any of its prompts (for supervised warm-starts of tiny
models). Answers are written as \\boxed{label} and scored by exact match.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from sparserl_jax.data.rewards import boxed_exact_reward
from sparserl_jax.tokenizer import CharTokenizer, Tokenizer


@runtime_checkable
class Task(Protocol):
    name: str

    def sample(self, rng: np.random.Generator, n: int) -> list[tuple[str, str]]:
        """n (prompt_text, label) pairs; the same Generator state gives the same pairs."""
        ...

    def reward(self, response: str, label: str) -> float:
        """1.0 for a correct final answer, else 0.0."""
        ...

    def solve(self, prompt: str) -> str:
        """The label of a prompt, read from the prompt alone (an oracle)."""
        ...

    def demonstration(self, prompt: str, rng: np.random.Generator | None = None) -> str:
        """The ideal response text (without the end-of-sequence token); `rng` draws the free
        choices of tasks whose ideal response has some (SFT passes its own)."""
        ...

    def tokenizer(self) -> Tokenizer: ...


class BoxedAnswerTask:
    """Shared behaviour: the response ends with \\boxed{answer}; exact-match reward; char tokenizer."""

    name: str = ""

    def sample(self, rng: np.random.Generator, n: int) -> list[tuple[str, str]]:
        if n < 0:
            raise ValueError(f"n={n} must be >= 0")
        return [self.sample_one(rng) for _ in range(n)]

    def sample_one(self, rng: np.random.Generator) -> tuple[str, str]:
        raise NotImplementedError

    def reward(self, response: str, label: str) -> float:
        return boxed_exact_reward(response, label)

    def solve(self, prompt: str) -> str:
        raise NotImplementedError

    def working(self, prompt: str) -> str:
        """The line the ideal response writes before its boxed answer ("" for none)."""
        return ""

    def demonstration(self, prompt: str, rng: np.random.Generator | None = None) -> str:
        working = self.working(prompt)
        return (working + "\n" if working else "") + "\\boxed{" + self.solve(prompt) + "}"

    def tokenizer(self) -> Tokenizer:
        return CharTokenizer()


def check_range(name: str, lo: int, hi: int, minimum: int) -> None:
    """Errors for a task's (lo, hi) difficulty range."""
    if not minimum <= lo <= hi:
        raise ValueError(f"{name}=({lo}, {hi}) must satisfy {minimum} <= min <= max")


def letters(rng: np.random.Generator, n: int) -> str:
    return "".join(chr(ord("a") + int(i)) for i in rng.integers(0, 26, size=n))


def digits(rng: np.random.Generator, n: int) -> str:
    return "".join(str(int(i)) for i in rng.integers(0, 10, size=n))
