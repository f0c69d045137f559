"""Walk a fixed cycle step by step and write every step: a long-response scratchpad task.

Prompt "From c, 14 steps:\\n" (with `recall` > 0: "From c, 14 steps, ask 03:\\n"). The model has
learned one fixed cycle of nodes (`nodes`, each node's successor is the next letter, wrapping);
the ideal response writes one labelled line per step and then the final node:

    01 f\\n02 c\\n ... 14 d\\n\\boxed{d}          (recall 0, numbering "up")
    01 f\\n02 c\\n ... 14 d\\n\\boxed{gd}         (ask 03: the node of line 03, then the last)
    14 f\\n13 c\\n ... 01 d\\n\\boxed{gd}         (numbering "down", ask 12: the line labelled 12)

Each line costs 5 tokens with the char tokenizer, so a response is 5 * steps + 9 (or 10) tokens:
the prompt is short and fits any KV budget while the response does not. Settings:

- `min_steps`, `max_steps`: the range of the walk's length (<= 99: two-digit line numbers);
- `lengths`: "uniform" over the range, or "long_tail": min_steps * (1 + Pareto(tail_alpha)),
  clipped to max_steps - many short walks and a few at the cap (a long-tailed length workload
  for SortedRL);
- `numbering`: line labels count the steps "up" (01, 02, ...; the model must compare its count
  with the prompt's to stop) or "down" (steps, steps - 1, ..., 01; stopping is local);
- `recall`: 0, or also ask for the node of a step q ~ U[1, recall], named by its line label.
  That node was written by the model itself 5 * (steps - q) tokens before the answer, so an
  eviction policy that dropped it loses state the answer needs (the Sparse-RL regime: eviction
  removes the model's own earlier reasoning). Retrieving a line by its two-digit label is hard
  for a 2-layer model (it learns it slowly and partly);
- `memo`: the ideal response first writes a memo "#X\\n", X a capital letter of its own free
  choice (uniform over 25 capitals in the demonstrations), and the answer repeats it before the
  final node: "#Q\\n14 f\\n ... 01 d\\n\\boxed{Qd}". Nothing in the prompt determines X, so the
  answer needs the model's own first tokens, ~5 * steps tokens back (the only capital in the
  response: one attention head finds it by content). The reward reads the memo from the
  response's first line (none: 0) and checks the boxed answer against memo + final node: it
  still scores the final answer only, against the commitment the response made. A 2-layer model
  learns the copy on short walks within a few hundred SFT steps and then keeps it on long ones,
  while on long walks alone it does not find it in 1000 (sft.curriculum; configs/walk_memo.yaml).
  RL can make a free choice predictable (always "P"), and then the answer needs no memory at all;
- `memo_key` (with `memo`): the prompt names the memo letter instead ("From c, 14 steps, key Q:"),
  the response still writes it first ("#Q") and the answer must repeat it: the same distance
  back, but no policy can make it predictable. The reward checks the boxed answer against
  key + final node.

The reward checks the boxed answer only (exact match).
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from sparserl_jax.data.tasks.base import BoxedAnswerTask, check_range

_MEMO_RE = re.compile(r"^#([A-Z])\n")
MEMO_LETTERS = "ABCDEGHIJKLMNOPQRSTUVWXYZ"  # capitals (not the prompt's F): found by content alone
_PROMPT_RE = re.compile(r"From ([a-z]), (\d+) steps(?:, ask (\d\d))?(?:, key ([A-Z]))?:\n")
LENGTHS = ("uniform", "long_tail")
NUMBERINGS = ("up", "down")


@dataclasses.dataclass(frozen=True)
class CycleWalkTask(BoxedAnswerTask):
    """A walk of `steps` steps along the fixed cycle `nodes` from a random start node."""

    name = "cycle_walk"
    nodes: str = "adgbehcf"
    min_steps: int = 2
    max_steps: int = 24
    lengths: str = "uniform"
    tail_alpha: float = 1.0
    numbering: str = "up"
    recall: int = 0
    memo: bool = False
    memo_key: bool = False

    def __post_init__(self):
        if (
            len(self.nodes) < 2
            or len(set(self.nodes)) != len(self.nodes)
            or not self.nodes.isalpha()
            or not self.nodes.islower()
        ):
            raise ValueError(f"cycle_walk nodes={self.nodes!r} must be >= 2 distinct lowercase letters")
        check_range("cycle_walk (min_steps, max_steps)", self.min_steps, self.max_steps, 1)
        if self.max_steps > 99:
            raise ValueError(f"cycle_walk max_steps={self.max_steps} must be <= 99 (two-digit lines)")
        if self.lengths not in LENGTHS:
            raise ValueError(f"cycle_walk lengths={self.lengths!r}; accepted: {list(LENGTHS)}")
        if self.numbering not in NUMBERINGS:
            raise ValueError(f"cycle_walk numbering={self.numbering!r}; accepted: {list(NUMBERINGS)}")
        if self.tail_alpha <= 0:
            raise ValueError(f"cycle_walk tail_alpha={self.tail_alpha} must be > 0")
        if self.memo_key and not self.memo:
            raise ValueError("cycle_walk memo_key=true needs memo=true (the key is the memo's letter)")
        if not 0 <= self.recall <= self.min_steps:
            raise ValueError(
                f"cycle_walk recall={self.recall} must be in [0, min_steps="
                f"{self.min_steps}] (the asked step must exist in every walk)"
            )

    def _steps(self, rng: np.random.Generator) -> int:
        if self.lengths == "uniform":
            return int(rng.integers(self.min_steps, self.max_steps + 1))
        return int(min(self.min_steps * (1.0 + rng.pareto(self.tail_alpha)), self.max_steps))

    def sample_one(self, rng: np.random.Generator) -> tuple[str, str]:
        start = self.nodes[int(rng.integers(len(self.nodes)))]
        steps = self._steps(rng)
        ask = f", ask {self._label(int(rng.integers(1, self.recall + 1)), steps)}" if self.recall else ""
        key = f", key {MEMO_LETTERS[int(rng.integers(len(MEMO_LETTERS)))]}" if self.memo_key else ""
        prompt = f"From {start}, {steps} steps{ask}{key}:\n"
        return prompt, self.solve(prompt)

    def walk(self, prompt: str) -> list[str]:
        """The nodes of steps 1..steps."""
        start, steps, _ = self._parse(prompt)
        i = self.nodes.index(start)
        return [self.nodes[(i + s) % len(self.nodes)] for s in range(1, steps + 1)]

    def _label(self, step: int, steps: int) -> str:
        """The line label of step `step` (1-based) of a walk of `steps` steps."""
        return f"{step if self.numbering == 'up' else steps - step + 1:02d}"

    def _parse(self, prompt: str) -> tuple[str, int, int]:
        """(start node, steps, asked step q or 0)."""
        m = _PROMPT_RE.match(prompt)
        if m is None or m.group(1) not in self.nodes:
            raise ValueError(f"not a cycle_walk prompt for nodes={self.nodes!r}: {prompt[:60]!r}")
        steps, label = int(m.group(2)), int(m.group(3) or 0)
        if m.group(3) is None:
            return m.group(1), steps, 0
        if not 1 <= label <= steps:
            raise ValueError(f"cycle_walk prompt asks for line {m.group(3)} of {steps}: {prompt!r}")
        return m.group(1), steps, int(self._label(label, steps))  # a label's step: _label again

    def solve(self, prompt: str) -> str:
        _, _, ask = self._parse(prompt)
        path = self.walk(prompt)
        return self._key(prompt) + (path[ask - 1] if ask else "") + path[-1]

    def _key(self, prompt: str) -> str:
        """The memo letter the prompt names ("" without memo_key)."""
        key = _PROMPT_RE.match(prompt).group(4)
        if self.memo_key != (key is not None):
            raise ValueError(f"cycle_walk memo_key={self.memo_key} and the prompt {prompt!r} disagree")
        return key or ""

    def demonstration(self, prompt: str, rng: np.random.Generator | None = None) -> str:
        """The ideal response; with `memo`, its memo letter is drawn from rng (without one, from a
        generator seeded by the prompt, so an oracle call is reproducible)."""
        demo = super().demonstration(prompt)
        if not self.memo:
            return demo
        if self.memo_key:  # the answer (solve) already starts with the key
            return f"#{self._key(prompt)}\n" + demo
        rng = rng if rng is not None else np.random.default_rng(list(prompt.encode()))
        x = MEMO_LETTERS[int(rng.integers(len(MEMO_LETTERS)))]
        return f"#{x}\n" + demo.replace("\\boxed{", "\\boxed{" + x, 1)

    def reward(self, response: str, label: str) -> float:
        if not self.memo or self.memo_key:
            return super().reward(response, label)
        m = _MEMO_RE.match(response)
        return super().reward(response, m.group(1) + label) if m else 0.0

    def working(self, prompt: str) -> str:
        steps = self._parse(prompt)[1]
        return "\n".join(f"{self._label(s, steps)} {node}" for s, node in enumerate(self.walk(prompt), start=1))
