"""The rules every figure table applies, declared once (docs/reproducing.md#statistics-collapse-and-provenance
states them in words), and the numbers a table quotes.

Collapse: `collapsed` (final dense-inference accuracy below half the warm start's) and, beside it,
`reward_collapse_iteration` (the train reward's moving average falls below half its first
value). Ties: `diff_se` (the SE of a difference of two evaluations) and `tie_verdict` (a difference
counts only beyond 2 SE at every run pair, all with one sign); `compare` pairs the runs of two arms,
`compare_arms` every listed pair of a figure's arms, and `comparison_lines` writes the verdicts.
Verdicts over runs: `verdict_phrase` (a word only where the claim holds at every run, or at none;
otherwise 'k of n').
Tables: `md_table` with `stat_cells` (mean ± std over runs per column) and `arm_cells` (those and
both collapse rules); `per_warm_start_table` each arm on each warm start. Scripts reach these
through figlib (figlib.collapsed is the name the results cite).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence

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
    acc = (
        "-"
        if any(w is None for w in warm_dense)
        else f"{sum(collapsed(r['dense_acc'], w) for r, w in zip(rows, warm_dense))} of {n}"
    )
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
        out[name] = [
            r if "collapse_iteration" in r or h is None else {**r, "collapse_iteration": reward_collapse_iteration(h)}
            for r, h in zip(rows, hists)
        ]
    return out


COLLAPSE_NOTE = (
    f"Collapsed (accuracy rule, figlib.collapsed): final dense-inference accuracy below "
    f"{COLLAPSE_FRACTION:.0%} of the warm start's. Collapsed (reward rule, "
    f"figlib.reward_collapse_iteration): the {REWARD_WINDOW}-iteration moving average of the train "
    f"reward falls below half its first value; the iteration where it does, '-' where it never does."
)


def warm_note(warms: dict[int, dict]) -> str:
    """A table note on the warm starts the accuracy rule compares with (and where a number was
    taken from another result of the same cached warm start, its 'source')."""
    if not warms:
        return "The warm start's accuracy was not recorded with these runs: no accuracy-rule verdict. "
    parts = [
        f"warm start {w}: {row['dense_acc']:.3f}" + (f" ({row['source']})" if "source" in row else "")
        for w, row in sorted(warms.items())
    ]
    return f"Dense-inference accuracy of the {'; '.join(parts)}. "


TIE_SE = 2.0


def diff_se(p1: float, n1: int, p2: float, n2: int) -> float:
    """The standard error of the difference of two independent avg@1 evaluations at accuracies
    p1 on n1 prompts and p2 on n2 prompts: sqrt(p1 (1 - p1) / n1 + p2 (1 - p2) / n2)."""
    return float(np.sqrt(p1 * (1 - p1) / n1 + p2 * (1 - p2) / n2))


def tie_verdict(diffs: Sequence[float], ses: Sequence[float]) -> int:
    """The tie rule, stated once (docs/reproducing.md#statistics-collapse-and-provenance) and used
    by every table: a difference between two arms counts only when it exceeds TIE_SE (2) standard
    errors of the difference at every pair (every seed, on every warm start), all with the same
    sign. +1: the first arm is ahead, -1: behind, 0: a tie."""
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
    def sign(self) -> int:
        """The tie rule's verdict: +1 a ahead, -1 b ahead, 0 a tie."""
        return tie_verdict(self.diffs, self.ses)

    @property
    def verdict(self) -> str:
        return {1: f"**{self.a} ahead**", -1: f"**{self.b} ahead**", 0: "tie"}[self.sign]

    def outcomes(self) -> list[int]:
        """Each pair's own reading by the tie rule's threshold: +1 a ahead beyond TIE_SE SE, -1 behind, 0 a tie."""
        return [tie_verdict([d], [s]) for d, s in zip(self.diffs, self.ses)]

    def counts(self) -> tuple[int, int, int]:
        """(pairs with a ahead, pairs tied, pairs with a behind): the counts `verdict_phrase` reads."""
        o = self.outcomes()
        return o.count(1), o.count(0), o.count(-1)

    def mean_se(self) -> tuple[float, float]:
        """The mean difference and its standard error from the spread over pairs (0 for one)."""
        d = np.asarray(self.diffs, np.float64)
        return float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else 0.0


def unit_of(row: dict, i: int = 0) -> tuple[int, int]:
    """(warm start, seed) of a row (rows of results before warm starts: warm start 0, seed index)."""
    return int(row.get("warm_start", 0)), int(row.get("seed", i))


def compare(
    a: str,
    a_rows: Sequence[dict],
    b: str,
    b_rows: Sequence[dict] | dict,
    key: str,
    n_a: int,
    n_b: int | None = None,
    metric: str | None = None,
) -> list[Comparison]:
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
    return [
        Comparison(
            a,
            b,
            (metric or key) + (f", warm start {g[0][0][0]}" if g is not pairs else ""),
            [x - y for _, x, y in g],
            [diff_se(x, n_a, y, n_b or n_a) for _, x, y in g],
            [f"w{u[0]} s{u[1]}" for u, _, _ in g],
        )
        for g in groups + [pairs]
    ]


# The accuracies two arms are compared on: row key -> the metric's name in the table.
ACC_METRICS = {"dense_acc": "dense inference", "sparse_acc": "sparse inference"}


def compare_arms(
    results: dict[str, Sequence[dict]], pairs: Iterable[tuple[str, str]], metrics: dict[str, str], n: int
) -> list[Comparison]:
    """`compare` a - b for every pair (a, b) of `pairs` whose arms are both in `results` (arm ->
    runs' rows, paired by warm start and seed), on every key of `metrics` (row key -> its name)."""
    return [
        c
        for a, b in pairs
        if a in results and b in results
        for key, what in metrics.items()
        for c in compare(a, results[a], b, results[b], key, n, metric=what)
    ]


def comparison_lines(comparisons: Sequence[Comparison], heading: str) -> list[str]:
    """results.md's paired-differences block: `heading`, the comparison table, the tie rule."""
    return ["", heading, "", *comparison_table(comparisons), "", TIE_NOTE]


def comparison_table(comparisons: Sequence[Comparison]) -> list[str]:
    """Markdown lines: one row per comparison with every pair's difference (and 2 SE), the mean ±
    its SE over pairs, and the tie rule's verdict."""
    lines = [
        "| comparison | accuracy | a - b per run (2 SE of that difference) | mean ± SE over runs | "
        "verdict (tie rule) |",
        "|---|---|---|---|---|",
    ]
    for c in comparisons:
        per = ", ".join(f"{d:+.3f} ({TIE_SE * s:.3f})" for d, s in zip(c.diffs, c.ses))
        m, se = c.mean_se()
        lines.append(f"| {c.a} - {c.b} | {c.metric} | {per} | {m:+.3f} ± {se:.3f} | {c.verdict} |")
    return lines


def verdict_phrase(k: int, n: int, word: str = "supported", negation: str = "not supported") -> str:
    """The one rule that turns counts into a verdict (docs/reproducing.md#one-rule-for-every-verdict):
    a claim that holds at k of n runs (every seed on every warm start, on every machine that ran it;
    at one run by a collapse rule or by the tie rule's 2 SE of a difference) gets a verdict word only
    where every run agrees: `word` at n of n, `negation` at 0 of n; otherwise 'k of n', no word."""
    if not 0 <= k <= n or n < 1:
        raise ValueError(f"k={k} of n={n}: need 0 <= k <= n and n >= 1")
    if k == n:
        return f"**{word}** ({k} of {n})"
    if k == 0:
        return f"**{negation}** (0 of {n})"
    return f"{k} of {n}"


def claim_cell(k: int, n: int, others: dict[str, int]) -> str:
    """`verdict_phrase`'s reading of k of n runs, then the other outcomes' counts."""
    return verdict_phrase(k, n) + "".join(f"; {name} {count}" for name, count in others.items())


HOLDS = "holds"  # a run's outcome where the claim holds (any other outcome is named: 'tie', 'behind'...)


@dataclasses.dataclass
class Claim:
    """A claim read at every run: `outcomes[i]` is HOLDS or the name of what happened instead at
    the run `units[i]` = (warm start, seed)."""

    text: str
    units: list[tuple[int, int]]
    outcomes: list[str]

    def cell(self, warm: int | None = None) -> str:
        """claim_cell over the runs of warm start `warm` (None: every run); '-' where it has none."""
        mine = [o for (w, _), o in zip(self.units, self.outcomes) if warm in (None, w)]
        if not mine:
            return "-"
        others = {o: mine.count(o) for o in sorted(set(mine)) if o != HOLDS}
        return claim_cell(mine.count(HOLDS), len(mine), others)


_PAIR_OUTCOME = {1: "ahead", 0: "tie", -1: "behind"}


def comparison_claim(text: str, c: Comparison, holds: Sequence[int] = (1,)) -> Claim:
    """The claim that a's reading against b at each run pair of `c` (the tie rule's threshold:
    +1 ahead, 0 tie, -1 behind) is one of `holds`, e.g. (1,) 'a ahead of b', (0, 1) 'a not behind b',
    (0,) 'a level with b'."""
    units = [(int(u.split()[0][1:]), int(u.split()[1][1:])) for u in c.units]
    return Claim(text, units, [HOLDS if o in holds else _PAIR_OUTCOME[o] for o in c.outcomes()])


def survival_claims(name: str, rows: Sequence[dict], warms: dict[int, dict]) -> list[Claim]:
    """'`name` does not collapse' by the accuracy rule (each run against its own warm start; no such
    claim where a run's warm start was not recorded) and, beside it, by the reward rule (where the
    rows carry 'collapse_iteration': results that kept no history have no reward-rule claim)."""
    units = [unit_of(r, i) for i, r in enumerate(rows)]
    warm_dense = warm_dense_of(rows, warms)
    out = []
    if all(w is not None for w in warm_dense):
        acc = ["collapsed" if collapsed(r["dense_acc"], w) else HOLDS for r, w in zip(rows, warm_dense)]
        out.append(Claim(f"{name} does not collapse (accuracy rule)", units, acc))
    if all("collapse_iteration" in r for r in rows):
        reward = ["collapsed" if r["collapse_iteration"] is not None else HOLDS for r in rows]
        out.append(Claim(f"{name} does not collapse (reward rule, beside it)", units, reward))
    return out


def claims_table(claims: Sequence[Claim]) -> list[str]:
    """results.md's verdict block: one row per claim, its reading on each warm start (with several)
    and over every run (verdict_phrase: a word only where every run agrees), then the rule's note."""
    warms = sorted({w for c in claims for w, _ in c.units})
    per_warm = warms if len(warms) > 1 else []
    header = ["claim (rule)", *(f"warm start {w}" for w in per_warm), "every run" if per_warm else "runs"]
    body = [[c.text, *(c.cell(w) for w in per_warm), c.cell()] for c in claims]
    return ["", "Verdicts (runs where each claim holds):", "", *md_table(header, body), "", VERDICT_NOTE]


VERDICT_NOTE = (
    "Verdicts by one rule (figlib.verdict_phrase, docs/reproducing.md#one-rule-for-every-verdict): a "
    "claim is read at every run (the accuracy collapse rule first, the reward rule beside it; a "
    f"comparison by the tie rule at that run pair, beyond {TIE_SE:g} SE of the difference); 'supported' "
    "only where it holds at every run, 'not supported' where at none, otherwise 'k of n' and no verdict word."
)


TIE_NOTE = (
    "Verdicts by the tie rule (figlib.tie_verdict, "
    "docs/reproducing.md#statistics-collapse-and-provenance): a difference "
    f"counts only when it exceeds {TIE_SE:g} SE at every run pair (same warm start and seed), all "
    "with the same sign, where SE = sqrt(p1 (1 - p1) / n1 + p2 (1 - p2) / n2) is the standard error "
    "of the difference of the two evaluations; otherwise it is a tie. Mean ± SE: the mean "
    "difference over pairs and its standard error from their spread."
)


# ----------------------------------------------------------------------------- tables

Column = tuple[str, str, str]  # (header, row key, fmt spec)
COLLAPSE_HEADERS = ("collapsed (accuracy rule)", "collapsed (reward rule)")


def md_table(header: Sequence[str], body: Iterable[Sequence[str]]) -> list[str]:
    """A markdown table's lines: the header row, the rule under it, one row per list of cells."""
    return [f"| {' | '.join(header)} |", "|---" * len(header) + "|", *(f"| {' | '.join(r)} |" for r in body)]


def headers(columns: Sequence[Column]) -> list[str]:
    """The header cells of `columns`."""
    return [h for h, _, _ in columns]


def stat_cells(rows: Sequence[dict], columns: Sequence[Column], missing: str = "-") -> list[str]:
    """One cell per column: `fmt` (mean ± std over the runs' `rows`) of its key, `missing` where
    the rows do not carry it."""
    return [fmt([r[k] for r in rows], spec) if k in rows[0] else missing for _, k, spec in columns]


def arm_cells(rows: Sequence[dict], columns: Sequence[Column], warms: dict[int, dict]) -> list[str]:
    """An arm's table cells: `stat_cells`, then both collapse rules (`collapse_cells`, each run
    against its own warm start's dense accuracy in `warms`)."""
    return [*stat_cells(rows, columns), *collapse_cells(rows, warm_dense_of(rows, warms))]


def per_warm_start_table(results: dict[str, list[dict]], warms: dict[int, dict]) -> list[str]:
    """With several warm starts: each arm's dense / sparse accuracy on each (mean ± std over its
    seeds) and its collapses there by the accuracy rule; nothing with one warm start."""
    if len(warms) < 2:
        return []
    body = []
    for w, row in sorted(warms.items()):
        mine = [[r for r in rows if r.get("warm_start", 0) == w] for rows in results.values()]
        body.append(
            [
                f"{w} ({row['dense_acc']:.3f} / {row['sparse_acc']:.3f})"
                if "sparse_acc" in row
                else f"{w} ({row['dense_acc']:.3f} / -)",
                *(
                    f"{fmt([r['dense_acc'] for r in m])} / {fmt([r['sparse_acc'] for r in m])} "
                    f"({collapse_cells(m, [row['dense_acc']] * len(m))[0]})"
                    for m in mine
                ),
            ]
        )
    return [
        "",
        "Per warm start (mean ± std over its seeds; dense / sparse inference; collapsed by the accuracy rule):",
        "",
        *md_table(["warm start (dense / sparse acc.)", *results], body),
    ]


def seed_rows(per_seed: dict[str, Sequence | None]) -> list[dict]:
    """Rows {"seed": i, key: values[i], ...} of results that store one list per key (the seed is
    the list index; a key whose list is None is left out): the rows the table and comparison
    helpers take."""
    lists = {k: v for k, v in per_seed.items() if v is not None}
    return [{"seed": i, **{k: v[i] for k, v in lists.items()}} for i in range(len(next(iter(lists.values()))))]


def seed_collapse_cells(dense_acc: Sequence[float], iterations: Sequence | None, warm_dense: float) -> tuple[str, str]:
    """`collapse_cells` of results that store per-seed lists: the runs' dense accuracies and their
    reward-rule collapse iterations (None: not kept), all from one warm start."""
    runs = seed_rows({"dense_acc": dense_acc, "collapse_iteration": iterations})
    return collapse_cells(runs, [warm_dense] * len(runs))


def ratio_of_means(a: Sequence[float], b: Sequence[float]) -> float:
    """mean(a) / mean(b) (b's mean floored at 1e-9): e.g. Sparse-RL's accuracy as a fraction of dense's."""
    return np.mean(a) / max(np.mean(b), 1e-9)


# ----------------------------------------------------------------------------- a run's numbers


def last_quarter(history: list[dict], key: str, default: float = 0.0) -> float:
    """The mean of `key` over the last quarter of the iterations (at least one)."""
    tail = history[-max(len(history) // 4, 1) :]
    return float(np.mean([h.get(key, default) for h in tail])) if tail else float("nan")


def run_mean(history: list[dict], key: str, default: float = 0.0) -> float:
    """The mean of `key` over every iteration (`default` where an iteration did not log it)."""
    return float(np.mean([h.get(key, default) for h in history])) if history else float("nan")


CLOCK_PREFIXES = ("time/", "throughput/")  # metrics a clock decides (with every "wall" one)


def untimed(metrics: dict) -> dict:
    """The metrics of one iteration that no clock decides (no times, rates or wall-time bubbles):
    what two runs of the same computation must give alike."""
    return {k: v for k, v in metrics.items() if not k.startswith(CLOCK_PREFIXES) and "wall" not in k}


def iteration_time(metrics: dict) -> float:
    """One logged iteration's seconds: the sum of its time/* phases."""
    return sum(v for k, v in metrics.items() if k.startswith("time/"))


def seconds_per_iteration(history: list[dict]) -> float:
    """The median seconds of an iteration after the first (which compiles; all of a one-iteration run)."""
    seconds = [iteration_time(x) for x in history]
    return float(np.median(seconds[1:] or seconds))


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


def results_of(data: dict, key: str = "results") -> tuple[dict[int, dict], dict[str, list[dict]]]:
    """A results.json's warm starts and its arms' rows (data[key]: arm -> one row per run), each
    row with the reward rule's collapse iteration (from its history where it lacks one)."""
    return warm_starts_of(data), with_reward_rule(data[key], data.get("histories"))


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
