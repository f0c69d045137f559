"""A benchmark suite declared in one YAML file, scored as the field reports it, and its table.

  name: math                      # the table's title (default: the file's stem)
  benchmarks:
    - name: math500               # letters, digits and . _ + -: a table row, a TensorBoard tag
      path: math500.jsonl         # SimpleRL-Zoo jsonl; relative to this file's folder
      k: 4                        # samples per prompt
      n: 500                      # the first n prompts (default: all)
      temperature: 0.6
      top_p: 0.95
      max_new_tokens: 4096
      answer_format: auto         # ANSWER_FORMATS: what a response's final answer is
      reward: math                # data/rewards.py REWARDS
      prompt_template: null       # default: the math prompt of data/datasets.py

A benchmark setting left out is the evaluate command's flag (its default: the run's rollout
settings, or the authors'). Per benchmark the table holds pass@1 and pass@k (eval_metrics.pass_at_k
from the k samples, a sample correct when its reward is 1), maj@k (the vote over the k samples'
normalised answers, data/rewards.py normalize_answer, its answer written as its format writes one
and scored by the benchmark's reward) and avg@k (the mean reward), written as table.json,
table.md, samples.jsonl and TensorBoard scalars (metrics_log.py) at the checkpoint's step. The
model runs elsewhere: run_suite is handed a function that samples one benchmark
(evaluate.py, which stands above this module).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Sequence

import yaml

from sparserl_jax.config_io import from_dict
from sparserl_jax.data.rewards import (
    REWARDS,
    extract_answer,
    extract_boxed,
    extract_gsm8k,
    get_reward,
    normalize_answer,
)
from sparserl_jax.eval_metrics import avg_at_k, majority_vote, pass_at_k
from sparserl_jax.metrics_log import MetricsLogger
from sparserl_jax.validate import check_at_least, check_between, check_in

CORRECT: float = 1.0  # a sample counts as correct for pass@k when its reward reaches this (rewards are 0 / 1)


@dataclasses.dataclass(frozen=True)
class AnswerFormat:
    """How a response states its final answer: `extract` reads it (None: no answer, no vote),
    `write` states an answer that way (what the vote's answer is scored as)."""

    extract: Callable[[str], str | None]
    write: Callable[[str], str]


def _boxed(answer: str) -> str:
    return "\\boxed{" + answer + "}"


ANSWER_FORMATS: dict[str, AnswerFormat] = {
    "auto": AnswerFormat(extract_answer, _boxed),  # the last \boxed{}, else "#### answer": the math reward's
    "boxed": AnswerFormat(extract_boxed, _boxed),  # the last \boxed{} (or \fbox{}) only
    "gsm8k": AnswerFormat(extract_gsm8k, lambda a: "#### " + a),  # the last "#### answer" line only
}
SAMPLING = ("k", "n", "temperature", "top_p", "max_new_tokens", "reward")  # left out: the command's flag


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One jsonl file of the suite, its sampling settings and how its answers are read."""

    name: str
    path: str
    k: int | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_new_tokens: int | None = None
    answer_format: str = "auto"
    reward: str | None = None
    prompt_template: str | None = None

    def check(self, where: str) -> None:
        """Every value in range; `where` (benchmarks[i]) prefixes the setting an error names."""
        if not re.fullmatch(r"[\w.+-]+", self.name):
            raise ValueError(
                f"{where}.name={self.name!r}: use letters, digits and . _ + - (it names a table row and a TensorBoard tag)"
            )
        for field in ("k", "n", "max_new_tokens"):
            if getattr(self, field) is not None:
                check_at_least(f"{where}.{field}", getattr(self, field), 1)
        if self.temperature is not None:
            check_at_least(f"{where}.temperature", self.temperature, 0.0, integer=False)
        if self.top_p is not None:
            check_between(f"{where}.top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_in(f"{where}.answer_format", self.answer_format, ANSWER_FORMATS)
        if self.reward is not None:
            check_in(f"{where}.reward", self.reward, REWARDS)
        if self.prompt_template is not None and "{question}" not in self.prompt_template:
            raise ValueError(f"{where}.prompt_template={self.prompt_template!r} must contain '{{question}}'")


@dataclasses.dataclass(frozen=True)
class Suite:
    """Benchmarks evaluated together into one table."""

    name: str = ""
    benchmarks: tuple[Benchmark, ...] = ()

    def __post_init__(self):
        if not self.benchmarks:
            raise ValueError("benchmarks: the suite lists no benchmark (a list of {name, path, k, ...})")
        seen = set()
        for i, bench in enumerate(self.benchmarks):
            bench.check(f"benchmarks[{i}]")
            if bench.name in seen:
                raise ValueError(f"benchmarks[{i}].name={bench.name!r}: the name is used twice")
            seen.add(bench.name)

    def resolved(self, **defaults) -> Suite:
        """Every SAMPLING setting a benchmark leaves out set to `defaults` (the command's flags)."""
        missing = sorted(set(SAMPLING) - set(defaults))
        if missing:
            raise ValueError(f"Suite.resolved: no default for {missing}")
        benches = tuple(
            dataclasses.replace(b, **{f: defaults[f] for f in SAMPLING if getattr(b, f) is None})
            for b in self.benchmarks
        )
        return dataclasses.replace(self, benchmarks=benches)


def load_suite(path: str) -> Suite:
    """The suite of a YAML file; paths relative to its folder. A malformed file is a ValueError
    naming the file and the setting (benchmarks[1].k), a missing jsonl a FileNotFoundError."""
    try:
        with open(path) as f:
            tree = yaml.safe_load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"--suite {path}: no such file") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--suite {path}: not valid YAML ({str(e).splitlines()[0]})") from None
    try:
        suite = from_dict(Suite, tree if tree is not None else {}, "")
    except ValueError as e:
        raise ValueError(f"--suite {path}: {e}") from None
    folder = os.path.dirname(os.path.abspath(path))
    benches = []
    for i, b in enumerate(suite.benchmarks):
        full = os.path.join(folder, os.path.expanduser(b.path))
        if not os.path.isfile(full):
            raise FileNotFoundError(f"--suite {path}: benchmarks[{i}].path={b.path!r}: no such file ({full})")
        benches.append(dataclasses.replace(b, path=full))
    name = suite.name or os.path.splitext(os.path.basename(path))[0]
    return dataclasses.replace(suite, name=name, benchmarks=tuple(benches))


# ----------------------------------------------------------------------------- scoring


def score(bench: Benchmark, result: dict) -> tuple[dict, list[dict]]:
    """One table row from evaluate's result on `bench` (its `samples` prompt by prompt, k each),
    and the samples with their benchmark, prompt index and extracted answer."""
    k, samples = bench.k, result["samples"]
    if not k or len(samples) % k:
        raise ValueError(f"benchmark {bench.name!r}: {len(samples)} samples are not k={k} per prompt")
    fmt, reward = ANSWER_FORMATS[bench.answer_format], get_reward(bench.reward)
    sums = dict.fromkeys(("pass@1", "pass@k", "maj@k", "avg@k"), 0.0)
    scored, unanswered = [], 0
    n_prompts = len(samples) // k
    for p in range(n_prompts):
        group = samples[p * k : (p + 1) * k]
        answers = [fmt.extract(s["response"]) for s in group]
        keys = [None if a is None else (normalize_answer(a) or None) for a in answers]
        c = sum(s["reward"] >= CORRECT for s in group)
        sums["pass@1"] += pass_at_k(k, c, 1)
        sums["pass@k"] += pass_at_k(k, c, k)
        sums["avg@k"] += avg_at_k([s["reward"] for s in group])
        vote = majority_vote(keys)
        if vote is not None:
            sums["maj@k"] += float(reward(fmt.write(answers[vote]), group[0]["label"]))
        unanswered += sum(key is None for key in keys)
        scored += [
            {"benchmark": bench.name, "prompt": p, "answer": a, "voted": i == vote, **s}
            for i, (a, s) in enumerate(zip(answers, group, strict=True))
        ]
    row = {
        "benchmark": bench.name,
        "path": bench.path,
        "k": k,
        "n_prompts": n_prompts,
        **{name: total / n_prompts for name, total in sums.items()},
        "no_answer": unanswered / len(samples),
        "mean_length": result["mean_length"],
        "kv_saving": result["kv_saving"],
        **{f: getattr(bench, f) for f in ("temperature", "top_p", "max_new_tokens", "answer_format", "reward")},
    }
    return row, scored


def summary_line(row: dict) -> str:
    k = row["k"]
    return (
        f"{row['benchmark']}: pass@1 = {row['pass@1']:.4f}  pass@{k} = {row['pass@k']:.4f}  "
        f"maj@{k} = {row['maj@k']:.4f}  avg@{k} = {row['avg@k']:.4f}  ({row['n_prompts']} prompts, "
        f"mean length {row['mean_length']:.1f}, kv saving {row['kv_saving']:.1%})"
    )


def run_suite(
    suite: Suite, evaluate: Callable[[Benchmark], dict], log: Callable[[str], None] = print
) -> tuple[list[dict], list[dict]]:
    """(table rows, scored samples) of a resolved suite; `evaluate(bench)` samples one benchmark
    (evaluate.py's evaluate_examples result: `samples`, `mean_length`, `kv_saving`)."""
    rows, samples = [], []
    for i, bench in enumerate(suite.benchmarks):
        try:
            result = evaluate(bench)
        except ValueError as e:  # a length, a prompt or a cache that does not fit: say whose
            raise ValueError(f"suite {suite.name!r} benchmarks[{i}] ({bench.name}): {e}") from None
        row, scored = score(bench, result)
        log(summary_line(row))
        rows.append(row)
        samples += scored
    return rows, samples


# ----------------------------------------------------------------------------- the table

COLUMNS = (  # (header, row key, format)
    ("benchmark", "benchmark", "{}"),
    ("k", "k", "{}"),
    ("prompts", "n_prompts", "{}"),
    ("pass@1", "pass@1", "{:.4f}"),
    ("pass@k", "pass@k", "{:.4f}"),
    ("maj@k", "maj@k", "{:.4f}"),
    ("avg@k", "avg@k", "{:.4f}"),
    ("no answer", "no_answer", "{:.1%}"),
    ("mean length", "mean_length", "{:.1f}"),
    ("kv saving", "kv_saving", "{:.1%}"),
    ("temperature", "temperature", "{}"),
    ("top-p", "top_p", "{}"),
    ("max new tokens", "max_new_tokens", "{}"),
)


def markdown(table: dict) -> str:
    """table.md: a title line naming the checkpoint, step and KV policy, then one row per benchmark."""
    kv = table["kv"]
    policy = "dense" if kv["policy"] == "none" else f"{kv['policy']} (budget {kv['budget']}, buffer {kv['buffer']})"
    step = "" if table["step"] is None else f", step {table['step']}"
    lines = [
        f"# {table['suite']}: {table['checkpoint']}{step}, KV cache {policy}",
        "",
        "| " + " | ".join(h for h, _, _ in COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(fmt.format(row[key]) for _, key, fmt in COLUMNS) + " |" for row in table["benchmarks"]]
    return "\n".join(lines) + "\n"


def scalars(rows: Sequence[dict]) -> dict[str, float]:
    """TensorBoard tags: <benchmark>/pass@1, pass@<k>, maj@<k>, avg@<k>, mean_length, kv_saving."""
    out = {}
    for row in rows:
        name, k = row["benchmark"], row["k"]
        out |= {
            f"{name}/pass@1": row["pass@1"],
            f"{name}/pass@{k}": row["pass@k"],
            f"{name}/maj@{k}": row["maj@k"],
            f"{name}/avg@{k}": row["avg@k"],
            f"{name}/mean_length": row["mean_length"],
            f"{name}/kv_saving": row["kv_saving"],
        }
    return out


def write_table(out_dir: str, table: dict, samples: Sequence[dict]) -> list[str]:
    """table.json, table.md and samples.jsonl (this evaluation's), plus one metrics.jsonl line and
    TensorBoard event at the table's step (0 without one); returns the files written."""
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, name) for name in ("table.json", "table.md", "samples.jsonl")]
    with open(paths[0], "w") as f:
        json.dump(table, f, indent=1)
    with open(paths[1], "w") as f:
        f.write(markdown(table))
    with open(paths[2], "w") as f:
        f.writelines(json.dumps(s) + "\n" for s in samples)
    logger = MetricsLogger(out_dir)
    logger.log(table["step"] or 0, scalars(table["benchmarks"]))
    logger.close()
    return [*paths, logger.jsonl_path, logger.tb_dir]
