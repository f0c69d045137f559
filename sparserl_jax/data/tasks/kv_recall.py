"""Key-value recall: many "key:value" lines, then a question about a key from the start.

The answer sits only in one of the first `query_window` lines, `n_pairs` lines before the
question, so a KV cache that evicted that early entry cannot answer: the task separates eviction
policies. With the char tokenizer a prompt has 21 + 9 * n_pairs tokens for 3-letter keys and
4-digit values (10 to 40 pairs: about 110 to 380 tokens).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from sparserl_jax.data.tasks.base import BoxedAnswerTask, check_range, digits, letters

_PAIR_RE = re.compile(r"^([a-z]+):(\d+)$", re.MULTILINE)
_QUERY_RE = re.compile(r"Value of ([a-z]+)\?")


@dataclasses.dataclass(frozen=True)
class KVRecallTask(BoxedAnswerTask):
    """n_pairs ~ U[min_pairs, max_pairs] distinct keys; the queried key is one of the first query_window."""

    name = "kv_recall"
    min_pairs: int = 10
    max_pairs: int = 40
    query_window: int = 3
    key_len: int = 3
    value_len: int = 4

    def __post_init__(self):
        check_range("kv_recall (min_pairs, max_pairs)", self.min_pairs, self.max_pairs, 1)
        if not 1 <= self.query_window <= self.min_pairs:
            raise ValueError(f"kv_recall query_window={self.query_window} must be in [1, min_pairs={self.min_pairs}]")
        if self.key_len < 1 or self.value_len < 1:
            raise ValueError(f"kv_recall key_len={self.key_len}, value_len={self.value_len} must be >= 1")
        if 26**self.key_len < 2 * self.max_pairs:
            raise ValueError(
                f"kv_recall key_len={self.key_len} gives too few distinct keys for max_pairs={self.max_pairs}"
            )

    def sample_one(self, rng: np.random.Generator) -> tuple[str, str]:
        n = int(rng.integers(self.min_pairs, self.max_pairs + 1))
        keys: list[str] = []
        while len(keys) < n:
            key = letters(rng, self.key_len)
            if key not in keys:
                keys.append(key)
        values = [digits(rng, self.value_len) for _ in range(n)]
        q = int(rng.integers(0, self.query_window))
        lines = "".join(f"{k}:{v}\n" for k, v in zip(keys, values))
        prompt = f"Pairs:\n{lines}Value of {keys[q]}?\n"
        return prompt, values[q]

    @staticmethod
    def _parse(prompt: str) -> tuple[dict[str, str], str]:
        pairs = dict(_PAIR_RE.findall(prompt))
        m = _QUERY_RE.search(prompt)
        if m is None or m.group(1) not in pairs:
            raise ValueError(f"not a kv_recall prompt: {prompt[:60]!r}...")
        return pairs, m.group(1)

    def solve(self, prompt: str) -> str:
        pairs, key = self._parse(prompt)
        return pairs[key]

    def working(self, prompt: str) -> str:
        pairs, key = self._parse(prompt)
        return f"{key}:{pairs[key]}"
