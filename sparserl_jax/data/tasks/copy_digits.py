"""Copy the first digits: a digit string, then filler text, then "Repeat the digits."

The digits appear only at the start, `filler` characters before the request, so answering needs
the earliest entries of the KV cache. With the char tokenizer a prompt has n_digits + filler + 28 or 29
tokens.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from sparserl_jax.data.tasks.base import BoxedAnswerTask, check_range, digits, letters

_DIGITS_RE = re.compile(r"^Digits: (\d+)\n")


@dataclasses.dataclass(frozen=True)
class CopyDigitsTask(BoxedAnswerTask):
    """n_digits random digits followed by filler ~ U[min_filler, max_filler] characters of words."""

    name = "copy_digits"
    n_digits: int = 8
    min_filler: int = 80
    max_filler: int = 360

    def __post_init__(self):
        if self.n_digits < 1:
            raise ValueError(f"copy_digits n_digits={self.n_digits} must be >= 1")
        check_range("copy_digits (min_filler, max_filler)", self.min_filler, self.max_filler, 0)

    def _filler(self, rng: np.random.Generator, n: int) -> str:
        words: list[str] = []
        size = 0
        while size < n:
            words.append(letters(rng, int(rng.integers(2, 8))))
            size += len(words[-1]) + 1
        text = " ".join(words)[:n]
        return text.rstrip() + "\n" if text.strip() else ""

    def sample_one(self, rng: np.random.Generator) -> tuple[str, str]:
        answer = digits(rng, self.n_digits)
        filler = self._filler(rng, int(rng.integers(self.min_filler, self.max_filler + 1)))
        return f"Digits: {answer}\n{filler}Repeat the digits.\n", answer

    def solve(self, prompt: str) -> str:
        m = _DIGITS_RE.match(prompt)
        if m is None:
            raise ValueError(f"not a copy_digits prompt: {prompt[:60]!r}...")
        return m.group(1)
