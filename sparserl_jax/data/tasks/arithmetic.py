"""Easy arithmetic: "Compute 23+58.", answer \\boxed{81}. A short-context sanity task."""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from sparserl_jax.data.tasks.base import BoxedAnswerTask, check_range

_PROMPT_RE = re.compile(r"Compute (-?\d+(?:[+-]\d+)*)\.")


@dataclasses.dataclass(frozen=True)
class ArithmeticTask(BoxedAnswerTask):
    """Sums and differences of `n_terms` integers drawn uniformly from [min_value, max_value]."""

    name = "arithmetic"
    min_value: int = 0
    max_value: int = 99
    n_terms: int = 2
    ops: str = "+"

    def __post_init__(self):
        check_range("arithmetic (min_value, max_value)", self.min_value, self.max_value, 0)
        if self.n_terms < 2:
            raise ValueError(f"arithmetic n_terms={self.n_terms} must be >= 2")
        if not self.ops or set(self.ops) - set("+-"):
            raise ValueError(f"arithmetic ops={self.ops!r} must be a non-empty combination of '+' and '-'")

    def sample_one(self, rng: np.random.Generator) -> tuple[str, str]:
        terms = rng.integers(self.min_value, self.max_value + 1, size=self.n_terms)
        ops = [self.ops[int(i)] for i in rng.integers(0, len(self.ops), size=self.n_terms - 1)]
        expr = str(int(terms[0])) + "".join(op + str(int(t)) for op, t in zip(ops, terms[1:]))
        prompt = f"Compute {expr}.\n"
        return prompt, self.solve(prompt)

    @staticmethod
    def _expression(prompt: str) -> str:
        m = _PROMPT_RE.search(prompt)
        if m is None:
            raise ValueError(f"not an arithmetic prompt: {prompt!r}")
        return m.group(1)

    def solve(self, prompt: str) -> str:
        # Signed terms summed by hand: no eval.
        return str(sum(int(t) for t in re.findall(r"[+-]?\d+", self._expression(prompt))))

    def working(self, prompt: str) -> str:
        return f"{self._expression(prompt)}={self.solve(prompt)}"
