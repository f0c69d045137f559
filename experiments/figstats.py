"""The rules every figure table applies, declared once (docs/reproducing.md#statistics-collapse-and-provenance
states them in words), and the numbers a table quotes.

Collapse: `collapsed` (final dense-inference accuracy below half the warm start's) and, beside it,
`reward_collapse_iteration` (the train reward's moving average falls below half its first
value). Ties: `diff_se` (the SE of a difference of two evaluations) and `tie_verdict` (a difference
counts only beyond 2 SE at every run pair, all with one sign); `compare` pairs the runs of two arms
and `comparison_table` writes the verdicts. Scripts reach these through figlib (figlib.collapsed is
the name the results cite).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

COLLAPSE_FRACTION = 0.5
REWARD_WINDOW = 5


def collapsed(dense_acc: float, warm_dense_acc: float) -> bool:
    """The collapse rule, declared before the runs and applied to every arm of every figure: a run
    has collapsed when its final dense-inference accuracy is below COLLAPSE_FRACTION (one half) of
    the dense-inference accuracy of the warm start it was trained from."""
    return dense_acc < COLLAPSE_FRACTION * warm_dense_acc


def reward_collapse_iteration(history: list[dict], window: int = REWARD_WINDOW) -> int | None:
    """The train-reward rule, reported beside `collapsed` for every arm: the first iteration
    (1-based) at which the mean train reward of the `window` iterations ending there falls below
    half its mean over iterations 1..window; None (no collapse) if it never does or the run is
    shorter than 2 x window iterations."""
    r = np.array([h["reward/mean"] for h in history], np.float64)
    if len(r) < 2 * window:
        return None
    smooth = np.convolve(r, np.ones(window) / window, mode="valid")
    below = np.nonzero(smooth < 0.5 * smooth[0])[0]
    return int(below[0]) + window if below.size else None


def collapse_cells(rows: Sequence[dict], warm_dense: Sequence[float | None]) -> tuple[str, str]:
    """The two collapse columns of a table row: 'k of n' by `collapsed` (each row against its own
    warm start's dense accuracy; '-' when that was not recorded) and 'k of n (at i, j, -)' by
    `reward_collapse_iteration` (rows carry 'collapse_iteration'; '-' when no history was kept)."""
    n = len(rows)
    acc = ("-" if any(w is None for w in warm_dense) else
           f"{sum(collapsed(r['dense_acc'], w) for r, w in zip(rows, warm_dense))} of {n}")
    if any("collapse_iteration" not in r for r in rows):
        return acc, "-"
    its = [r["collapse_iteration"] for r in rows]
    return acc, f"{sum(i is not None for i in its)} of {n} (at {', '.join('-' if i is None else str(i) for i in its)})"


def with_reward_rule(results: dict[str, list[dict]], histories: dict[str, list] | None) -> dict:
    """`results` with each row's 'collapse_iteration' computed from its history where the row lacks
    it (results.json files written before every row carried it); rows without a history stay so."""
    out = {}
    for name, rows in results.items():
        hists = (histories or {}).get(name) or [None] * len(rows)
        out[name] = [r if "collapse_iteration" in r or h is None else
                     {**r, "collapse_iteration": reward_collapse_iteration(h)} for r, h in zip(rows, hists)]
    return out


COLLAPSE_NOTE = (
    f"Collapsed (accuracy rule, figlib.collapsed): final dense-inference accuracy below "
    f"{COLLAPSE_FRACTION:.0%} of the warm start's. Collapsed (reward rule, "
    f"figlib.reward_collapse_iteration): the {REWARD_WINDOW}-iteration moving average of the train "
    f"reward falls below half its first value; the iteration where it does, '-' where it never does.")

def warm_note(warms: dict[int, dict]) -> str:
    """A table note on the warm starts the accuracy rule compares with (and where a number was
    taken from another result of the same cached warm start, its 'source')."""
    if not warms:
        return "The warm start's accuracy was not recorded with these runs: no accuracy-rule verdict. "
    parts = [f"warm start {w}: {row['dense_acc']:.3f}" + (f" ({row['source']})" if "source" in row else "")
             for w, row in sorted(warms.items())]
    return f"Dense-inference accuracy of the {'; '.join(parts)}. "


TIE_SE = 2.0


def diff_se(p1: float, n1: int, p2: float, n2: int) -> float:
    """The standard error of the difference of two independent avg@1 evaluations at accuracies
    p1 on n1 prompts and p2 on n2 prompts: sqrt(p1 (1 - p1) / n1 + p2 (1 - p2) / n2)."""
    return float(np.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2))


def tie_verdict(diffs: Sequence[float], ses: Sequence[float]) -> int:
    """The tie rule, stated once (docs/reproducing.md#statistics) and used by every table: a
    difference between two arms counts only when it exceeds TIE_SE (2) standard errors of the
    difference at every pair (every seed, on every warm start), all with the same sign. +1: the
    first arm is ahead, -1: behind, 0: a tie."""
    d, s = np.asarray(diffs, np.float64), np.asarray(ses, np.float64)
    if d.size and np.all(d > TIE_SE * s):
        return 1
    if d.size and np.all(d < -TIE_SE * s):
        return -1
    return 0


@dataclasses.dataclass
class Comparison:
    """Paired differences a - b of one accuracy, one per run pair (`units`: 'w0 s1' = warm start
    0, seed 1), each with its evaluation SE (diff_se), and the tie rule's verdict over them."""

    a: str
    b: str
    metric: str
    diffs: list[float]
    ses: list[float]
    units: list[str]

    @property
    def verdict(self) -> str:
        v = tie_verdict(self.diffs, self.ses)
        return {1: f"**{self.a} ahead**", -1: f"**{self.b} ahead**", 0: "tie"}[v]

    def mean_se(self) -> tuple[float, float]:
        """The mean difference and its standard error from the spread over pairs (0 for one)."""
        d = np.asarray(self.diffs, np.float64)
        return float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else 0.0


def unit_of(row: dict, i: int = 0) -> tuple[int, int]:
    """(warm start, seed) of a row (rows of results before warm starts: warm start 0, seed index)."""
    return int(row.get("warm_start", 0)), int(row.get("seed", i))


def compare(a: str, a_rows: Sequence[dict], b: str, b_rows: Sequence[dict] | dict, key: str,
            n_a: int, n_b: int | None = None, metric: str | None = None) -> list[Comparison]:
    """a - b on `key`. `b_rows`: rows paired with `a_rows` one by one (same warm start and seed), or
    {warm start: row} (one model per warm start, e.g. the warm start itself). One Comparison per
    warm start when there are several, then the pooled one over every pair."""
    units = [unit_of(r, i) for i, r in enumerate(a_rows)]
    if isinstance(b_rows, dict):
        partners = [b_rows[w] for w, _ in units]
    else:
        partners = list(b_rows)
        if [unit_of(r, i) for i, r in enumerate(partners)] != units:
            raise ValueError(f"{a} and {b}: rows not paired by warm start and seed")
    pairs = [(u, r[key], p[key]) for u, r, p in zip(units, a_rows, partners)]
    warms = sorted({w for w, _ in units})
    groups = [[p for p in pairs if p[0][0] == w] for w in warms] if len(warms) > 1 else []
    return [Comparison(a, b, (metric or key) + (f", warm start {g[0][0][0]}" if g is not pairs else ""),
                       [x - y for _, x, y in g], [diff_se(x, n_a, y, n_b or n_a) for _, x, y in g],
                       [f"w{u[0]} s{u[1]}" for u, _, _ in g])
            for g in groups + [pairs]]


def comparison_table(comparisons: Sequence[Comparison]) -> list[str]:
    """Markdown lines: one row per comparison with every pair's difference (and 2 SE), the mean ±
    its SE over pairs, and the tie rule's verdict."""
    lines = ["| comparison | accuracy | a - b per run (2 SE of that difference) | mean ± SE over runs | "
             "verdict (tie rule) |", "|---|---|---|---|---|"]
    for c in comparisons:
        per = ", ".join(f"{d:+.3f} ({TIE_SE * s:.3f})" for d, s in zip(c.diffs, c.ses))
        m, se = c.mean_se()
        lines.append(f"| {c.a} - {c.b} | {c.metric} | {per} | {m:+.3f} ± {se:.3f} | {c.verdict} |")
    return lines


TIE_NOTE = (
    f"Verdicts by the tie rule (figlib.tie_verdict, docs/reproducing.md#statistics): a difference "
    f"counts only when it exceeds {TIE_SE:g} SE at every run pair (same warm start and seed), all "
    "with the same sign, where SE = sqrt(p1 (1 - p1) / n1 + p2 (1 - p2) / n2) is the standard error "
    "of the difference of the two evaluations; otherwise it is a tie. Mean ± SE: the mean "
    "difference over pairs and its standard error from their spread.")


# ----------------------------------------------------------------------------- a run's numbers


def last_quarter(history: list[dict], key: str, default: float = 0.0) -> float:
    """The mean of `key` over the last quarter of the iterations (at least one)."""
    tail = history[-max(len(history) // 4, 1):]
    return float(np.mean([h.get(key, default) for h in tail])) if tail else float("nan")


def run_mean(history: list[dict], key: str, default: float = 0.0) -> float:
    """The mean of `key` over every iteration (`default` where an iteration did not log it)."""
    return float(np.mean([h.get(key, default) for h in history])) if history else float("nan")


def warm_starts_of(data: dict) -> dict[int, dict]:
    """A results.json's warm starts {k: row} (results before warm starts: one, k = 0, from
    'warm_start' or fig b's 'warm_dense_acc'); {} when none was recorded."""
    if "warm_starts" in data:
        return {int(k): v for k, v in data["warm_starts"].items()}
    if "warm_start" in data:
        return {0: data["warm_start"]}
    if "warm_dense_acc" in data:
        return {0: {"dense_acc": data["warm_dense_acc"]}}
    return {}


def warm_dense_of(rows: Sequence[dict], warms: dict[int, dict]) -> list[float | None]:
    """Each row's warm start's dense accuracy (None where that was not recorded)."""
    return [warms.get(unit_of(r, i)[0], {}).get("dense_acc") for i, r in enumerate(rows)]


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    v = np.asarray(list(values), np.float64)
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def fmt(values: Sequence[float], spec: str = ".3f") -> str:
    """'m' for one seed, 'm ± s' for several."""
    m, s = mean_std(values)
    return f"{m:{spec}}" if len(values) == 1 else f"{m:{spec}} ± {s:{spec.lstrip('+')}}"
