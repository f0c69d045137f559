"""Prompt datasets: jsonl or parquet files in the SimpleRL-Zoo / verl formats, and resumable batch
iterators.

A row holds a question ("prompt", "question" or "problem"; a "prompt" or "messages" list is a chat),
a label ("label", "gt_answer", "answer", "ground_truth" or reward_model.ground_truth) and, when it
has one, its data_source (which picks its reward, data/rewards.py SOURCE_REWARDS); data.columns
names other columns. A path ending in .parquet is read by data/parquet.py (verl's preprocessed
gsm8k / MATH files), any other as jsonl. A question becomes prompt_template with {question} filled
in (Sparse-RL's evaluation prompt, section 1.6), optionally wrapped in the tokenizer's chat
template. Iterators are deterministic functions of (seed, epoch, position) so that a resumed run
sees the same prompts in the same order.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np

from sparserl_jax.data import parquet
from sparserl_jax.data.rewards import label_answer
from sparserl_jax.tokenizer import Tokenizer

DEFAULT_PROMPT_TEMPLATE: str = "{question} Please reason step by step, and put your final answer within \\boxed{}."
QUESTION_FIELDS: tuple[str, ...] = ("prompt", "question", "problem", "messages")
LABEL_FIELDS: tuple[str, ...] = ("label", "gt_answer", "answer", "ground_truth", "reward_model.ground_truth")

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class DatasetColumns:
    """Which column of a row (a jsonl key or a parquet column; dotted for a nested field, e.g.
    reward_model.ground_truth) holds its question, label and data_source. None: the first
    non-empty of QUESTION_FIELDS / LABEL_FIELDS, and "data_source" where a row has it; a column
    named here must be in every row."""

    question: str | None = None
    label: str | None = None
    data_source: str | None = None

    def __post_init__(self):
        for name in ("question", "label", "data_source"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, str) and all(value.split("."))):
                raise ValueError(
                    f"data.columns.{name}={value!r} must be a column name (dotted for a nested field, "
                    "e.g. reward_model.ground_truth) or null (found in the row)"
                )


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """How rows become prompts. `prompt_template` must contain "{question}" (filled by plain
    replacement, so the braces of \\boxed{} need no escaping); it is not applied to chat rows."""

    prompt_template: str = DEFAULT_PROMPT_TEMPLATE
    chat_template: bool = True
    system_prompt: str | None = None
    max_prompt_len: int = 1024
    on_long_prompt: Literal["error", "skip"] = "error"
    columns: DatasetColumns = DatasetColumns()

    def __post_init__(self):
        if "{question}" not in self.prompt_template:
            raise ValueError(f"data.prompt_template={self.prompt_template!r} must contain '{{question}}'")
        if self.max_prompt_len < 1:
            raise ValueError(f"data.max_prompt_len={self.max_prompt_len} must be >= 1")
        if self.on_long_prompt not in ("error", "skip"):
            raise ValueError(f"data.on_long_prompt={self.on_long_prompt!r} must be one of 'error', 'skip'")


@dataclasses.dataclass(frozen=True)
class PromptExample:
    """One prompt ready for the sampler: rendered text, its token ids, the answer label, its origin
    ("<file>:<line>" or "<file> row <i>"), and the row's data_source (None without one), which picks
    its reward."""

    prompt: str
    prompt_ids: tuple[int, ...]
    label: str
    source: str
    data_source: str | None = None


def render_prompt(question: str | list[dict], tokenizer: Tokenizer | None, cfg: DatasetConfig) -> str:
    """The text fed to the model for a question string or a list of chat messages."""
    if isinstance(question, str):
        messages = [{"role": "user", "content": cfg.prompt_template.replace("{question}", question)}]
    else:
        messages = list(question)
        if messages and messages[-1].get("role") == "assistant":
            messages = messages[:-1]  # a trailing reference answer is not part of the prompt
    if cfg.system_prompt is not None and not any(m.get("role") == "system" for m in messages):
        messages = [{"role": "system", "content": cfg.system_prompt}] + messages
    if not cfg.chat_template:
        if not isinstance(question, str) or cfg.system_prompt is not None:
            raise ValueError(
                "chat rows ('messages' or a 'prompt' list) and data.system_prompt need data.chat_template=true"
            )
        return messages[0]["content"]
    if tokenizer is None:
        raise ValueError("data.chat_template=true needs a tokenizer")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def make_examples(
    rows: Sequence[tuple[str | list[dict], str, str] | tuple[str | list[dict], str, str, str | None]],
    tokenizer: Tokenizer,
    cfg: DatasetConfig,
) -> list[PromptExample]:
    """(question, label, source[, data_source]) rows -> PromptExamples, enforcing cfg.max_prompt_len."""
    out = []
    for question, label, source, *data_source in rows:
        text = render_prompt(question, tokenizer, cfg)
        ids = tuple(tokenizer.encode(text))
        if len(ids) > cfg.max_prompt_len:
            msg = f"{source}: prompt has {len(ids)} tokens > data.max_prompt_len={cfg.max_prompt_len}"
            if cfg.on_long_prompt == "error":
                raise ValueError(msg + "; raise max_prompt_len or set data.on_long_prompt='skip'")
            log.warning("skipping %s", msg)
            continue
        out.append(PromptExample(text, ids, label, source, data_source[0] if data_source else None))
    return out


def _field(row: dict, dotted: str) -> Any:
    value: Any = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _column(row: dict, where: str, named: str | None, part: str, fields: Sequence[str]) -> tuple[str, Any]:
    """(column, value) of a row's `part` (question or label): the column data.columns names, else
    the first of `fields` that is not empty."""
    if named is not None:
        value = _field(row, named)
        if value in (None, "", []):
            raise ValueError(f"{where}: column {named!r} (data.columns.{part}) is missing or empty")
        return named, value
    for name in fields:
        if (value := _field(row, name)) not in (None, "", []):
            return name, value
    raise ValueError(
        f"{where}: row has no {part}; accepted fields: {', '.join(fields)} (or name its column in data.columns.{part})"
    )


def parse_row(row: Any, where: str, columns: DatasetColumns | None = None) -> tuple[str | list[dict], str, str | None]:
    """(question or messages, label, data_source or None) of one row; errors name `where` (file:line
    or file row) and the column. `columns`: DatasetColumns() (every part found in the row) when None."""
    columns = DatasetColumns() if columns is None else columns
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__}")
    column, question = _column(row, where, columns.question, "question", QUESTION_FIELDS)
    if isinstance(question, list):
        if not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and m.get("content") is not None for m in question
        ):
            raise ValueError(
                f"{where}: a chat prompt must be a list of {{'role', 'content'}} objects (column {column!r})"
            )
    elif not isinstance(question, str):
        raise ValueError(
            f"{where}: question must be a string or a list of messages, got {type(question).__name__} "
            f"(column {column!r})"
        )
    column, label = _column(row, where, columns.label, "label", LABEL_FIELDS)
    if isinstance(label, (list, dict)):
        raise ValueError(f"{where}: label must be a string or a number, got {type(label).__name__} (column {column!r})")
    column = columns.data_source or "data_source"
    data_source = _field(row, column)
    if columns.data_source is not None and data_source in (None, ""):
        raise ValueError(f"{where}: column {column!r} (data.columns.data_source) is missing or empty")
    if data_source is not None and not isinstance(data_source, str):
        raise ValueError(f"{where}: data_source must be a string, got {type(data_source).__name__} (column {column!r})")
    return question, label_answer(str(label)), data_source or None


def load_dataset(
    path: str | os.PathLike, tokenizer: Tokenizer, cfg: DatasetConfig | None = None
) -> list[PromptExample]:
    """A prompt file into PromptExamples: parquet when the path ends in .parquet, else jsonl."""
    if os.fspath(path).lower().endswith(".parquet"):
        return load_parquet(path, tokenizer, cfg)
    return load_jsonl(path, tokenizer, cfg)


def load_jsonl(path: str | os.PathLike, tokenizer: Tokenizer, cfg: DatasetConfig | None = None) -> list[PromptExample]:
    """Reads a jsonl prompt file (blank lines ignored) into PromptExamples (`cfg`: DatasetConfig()
    when None)."""
    cfg = DatasetConfig() if cfg is None else cfg
    path = _existing(path)
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg})") from None
            question, label, data_source = parse_row(row, where, cfg.columns)
            rows.append((question, label, where, data_source))
    return _examples(path, rows, tokenizer, cfg)


def load_parquet(
    path: str | os.PathLike, tokenizer: Tokenizer, cfg: DatasetConfig | None = None
) -> list[PromptExample]:
    """Reads a parquet prompt file (verl's layout or flat columns; data/parquet.py) into
    PromptExamples; a row's origin is "<file> row <i>", rows counted from 0 as pyarrow and
    `datasets` index them."""
    cfg = DatasetConfig() if cfg is None else cfg
    path = _existing(path)
    c = cfg.columns
    named = {f"data.columns.{k}": v for k, v in dataclasses.asdict(c).items() if v is not None}
    wanted = [*named.values(), *QUESTION_FIELDS, *LABEL_FIELDS, "data_source"]
    rows = []
    for i, row in parquet.read_rows(path, wanted, named):
        where = f"{path} row {i}"
        question, label, data_source = parse_row(row, where, c)
        rows.append((question, label, where, data_source))
    return _examples(path, rows, tokenizer, cfg)


def _existing(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data.dataset={path!r} does not exist")
    return path


def _examples(path: str, rows: list, tokenizer: Tokenizer, cfg: DatasetConfig) -> list[PromptExample]:
    if not rows:
        raise ValueError(f"data.dataset={path!r} is empty (no rows)")
    examples = make_examples(rows, tokenizer, cfg)
    if not examples:
        raise ValueError(f"data.dataset={path!r}: every prompt is longer than data.max_prompt_len={cfg.max_prompt_len}")
    return examples


class PromptIterator:
    """Endless batches of a fixed example list: each epoch is a fresh permutation drawn from
    (seed, epoch); batches never straddle epochs (the remainder of an epoch is dropped).

    The state (epoch, position) is all a resumed run needs to continue the same order.
    """

    def __init__(self, examples: Sequence[PromptExample], batch_size: int, seed: int = 0, shuffle: bool = True):
        if not 1 <= batch_size <= len(examples):
            raise ValueError(f"batch_size={batch_size} must be in [1, {len(examples)}] (the dataset size)")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0

    def _order(self, epoch: int) -> np.ndarray:
        n = len(self.examples)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self) -> list[PromptExample]:
        if self.position + self.batch_size > len(self.examples):
            self.epoch, self.position = self.epoch + 1, 0
        idx = self._order(self.epoch)[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return [self.examples[i] for i in idx]

    def __iter__(self) -> Iterator[list[PromptExample]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed, "num_examples": len(self.examples)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, mine in (("seed", self.seed), ("num_examples", len(self.examples))):
            if key in state and int(state[key]) != mine:
                raise ValueError(f"data iterator state has {key}={state[key]} but this run has {key}={mine}")
        if not 0 <= int(state["position"]) <= len(self.examples):
            raise ValueError(f"data iterator state position={state['position']} outside [0, {len(self.examples)}]")
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


class TaskPromptIterator:
    """Endless batches of a synthetic task: batch k is task.sample(rng(seed, k), batch_size).

    The state is the step k, so a resumed run draws exactly the prompts it would have drawn.
    """

    def __init__(
        self, task, batch_size: int, seed: int = 0, tokenizer: Tokenizer | None = None, cfg: DatasetConfig | None = None
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.task = task
        self.batch_size = batch_size
        self.seed = seed
        self.tokenizer = tokenizer if tokenizer is not None else task.tokenizer()
        self.cfg = cfg if cfg is not None else DatasetConfig(chat_template=False, max_prompt_len=1 << 30)
        self.step = 0

    def next_batch(self) -> list[PromptExample]:
        rng = np.random.default_rng([self.seed, self.step])
        pairs = self.task.sample(rng, self.batch_size)
        rows = [
            (p, label, f"{self.task.name}[seed={self.seed},step={self.step},{i}]") for i, (p, label) in enumerate(pairs)
        ]
        self.step += 1
        return make_examples(rows, self.tokenizer, self.cfg)

    def __iter__(self) -> Iterator[list[PromptExample]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(f"task iterator state has seed={state['seed']} but this run has seed={self.seed}")
        self.step = int(state["step"])
