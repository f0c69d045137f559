"""The figure scaffold (experiments/fig_*.py, default.py and the other result scripts).

A figure script declares one `Figure`: a name (its results directory), its own arguments, a `run`
(train and evaluate through a `Study`, return the numbers) and a `render` (numbers -> tables, PNGs,
caption); `Figure.main` is the whole command line: the common arguments (--config, --out,
--runs-dir, --seeds, --warm-starts, --eval-prompts, --smoke, --replot, key=value overrides),
pinning (workers.py), provenance and the outputs. `--replot <out>` re-renders results.md and the
PNGs from results.json and config.yaml alone, training and evaluating nothing.

Runs: `Study.arm(...)` trains a run once into `<runs_dir>/<config hash>/` and every later call
(from any figure) reuses it, so figures share their common arms. A run resumes from its last
checkpoint when interrupted. Warm starts are runs too (SFT seed k, `Study.warm_start_dir(k)`);
`Study.train_all` trains warm starts and arms in parallel single-core processes (workers.py).

Outputs: `<out>/results.md` (title, command, provenance, tables, figure, caption),
`results.json` (every number, the command and the provenance), `arms.json` (every run's resolved
config), `config.yaml` (the base config) and `<name>.png`.

The rules every table applies are declared here, once: `collapsed` and `reward_collapse_iteration`
(collapse), `diff_se` and `tie_verdict` (is a difference a difference); docs/reproducing.md states
them in words.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from typing import Callable, Iterable, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import FixedLocator, FuncFormatter  # noqa: E402

import workers  # noqa: E402  (imports no JAX)
from sparserl_jax.config import TrainConfig, dump_config, load_config, to_dict  # noqa: E402
from sparserl_jax.metrics_log import read_metrics  # noqa: E402
from sparserl_jax.train import Trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
DEFAULT_CONFIG = os.path.join(HERE, "configs", "default.yaml")
DEFAULT_RUNS = os.path.join(REPO, "runs", "figures")

# A seconds-long version of any experiment (tests and first checks).
SMOKE_OVERRIDES = (
    "sft.steps=5", "train.iterations=2", "train.eval_prompts=4", "rollout.prompts=2",
    "rollout.samples=4", "rl.update.minibatch_size=8", "rl.update.micro_batch_size=8",
)

# An RL run from a warm start's weights (model.init_from): neither SFT phase runs again.
FROM_WARM_START = ("sft.steps=0", "sft.curriculum.steps=0")

# Final evaluations use at least this many held-out prompts (binomial SE <= 0.022; 128 prompts
# gave ~0.04). Evaluations are cached per run and prompt count, so raising it re-trains nothing.
EVAL_PROMPTS = 512

# Paper-column figures: every panel about 3.5 in wide, at most two panels a row, no text below 8 pt.
PANEL_W = 3.5
DPI = 150
plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "xtick.labelsize": 8,
                     "ytick.labelsize": 8, "legend.fontsize": 8, "figure.titlesize": 10})

# Settings that do not change what a run computes: left out of its identity.
_NOT_IDENTITY = ("train.out_dir", "train.progress", "train.save_every", "train.keep_checkpoints")

# The commit that turned the portable CPU settings on (workers.py): results committed before it
# ran with the host's own numerics.
PORTABLE_SINCE = "de5812a"


# ----------------------------------------------------------------------------- the rules

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


# ----------------------------------------------------------------------------- runs


def _non_default(tree: dict, default: dict) -> dict:
    """The leaves of `tree` whose value differs from `default` (nested sections recursed)."""
    out = {}
    for key, value in tree.items():
        ref = default.get(key, object())
        if isinstance(value, dict) and isinstance(ref, dict):
            sub = _non_default(value, ref)
            if sub:
                out[key] = sub
        elif value != ref:
            out[key] = value
    return out


# Bumped when a code change alters the numbers of unchanged configs, so cached runs of older code
# are not reused (2: per-request sampler keys, rollout.sampler.request_keys).
RESULTS_EPOCH = 2


def config_key(cfg: TrainConfig) -> str:
    """A stable hash of the settings that differ from the defaults: what decides a run's numbers.

    Adding a setting with a default therefore keeps every cached run valid; changing a default
    value does not change the keys (bump RESULTS_EPOCH, or clear the run cache, after such a
    change). The warm start a run starts from enters by its own key (the basename of
    model.init_from), not by its location."""
    tree = to_dict(cfg)
    for dotted in _NOT_IDENTITY:
        section, name = dotted.split(".")
        tree[section].pop(name, None)
    if tree["model"]["init_from"]:
        tree["model"]["init_from"] = os.path.basename(os.path.normpath(tree["model"]["init_from"]))
    tree = _non_default(tree, to_dict(TrainConfig()))
    if RESULTS_EPOCH > 1:
        tree["results_epoch"] = RESULTS_EPOCH
    if workers.portable_cpu_enabled():  # other float bits than the host's fastest code
        tree["portable_cpu"] = True
    blob = json.dumps(tree, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


@contextlib.contextmanager
def _locked(path: str):
    """Serialise work on one run directory between concurrently running processes."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@dataclasses.dataclass
class Run:
    """A finished training run: its config, directory and per-iteration metrics."""

    name: str
    cfg: TrainConfig
    out_dir: str
    history: list[dict]
    _trainer: Trainer | None = None

    def trainer(self, log=print) -> Trainer:
        """A trainer holding the run's final weights (restored from its last checkpoint)."""
        if self._trainer is None:
            self._trainer = Trainer(self.cfg, log=log)
            self._trainer.start()
        return self._trainer

    def evaluate(self, kv_overrides: dict | None = None, n: int | None = None, log=print) -> dict:
        """Accuracy (avg@1) and KV saving of the final weights under the run's KV settings with
        `kv_overrides` applied (e.g. {"policy": "none"} for dense inference); cached on disk."""
        n = n or self.cfg.train.eval_prompts
        kv_cfg = dataclasses.replace(self.cfg.kv, **(kv_overrides or {}))
        key = json.dumps({"kv": dataclasses.asdict(kv_cfg), "n": n}, sort_keys=True)
        path = os.path.join(self.out_dir, "evals.json")
        with _locked(path):
            cache = json.load(open(path)) if os.path.exists(path) else {}
            if key not in cache:
                res = self.trainer(log).evaluate(kv_cfg=kv_cfg, n=n)
                cache[key] = {k: res[k] for k in ("accuracy", "mean_length", "kv_saving")}
                with open(path + ".tmp", "w") as f:
                    json.dump(cache, f, indent=1)
                os.replace(path + ".tmp", path)
        return cache[key]


class Study:
    """Runs of one base config (YAML + overrides) from its warm starts (SFT seed k: warm start k)."""

    def __init__(self, config: str = DEFAULT_CONFIG, overrides: Sequence[str] = (),
                 runs_dir: str = DEFAULT_RUNS, log: Callable = print, cores: list[int] | None = None):
        self.config = config
        self.cores = cores  # train_all's worker cores (default: this process's available ones)
        self.overrides = list(overrides)
        self.runs_dir = runs_dir
        self.log = log
        self.base = load_config([config], self.overrides)
        self._warm_dirs: dict[int, str] = {}
        self.arms: dict[str, dict] = {}  # every run this study returned: name -> resolved config

    def train(self, name: str, overrides: Sequence[str]) -> Run:
        """Train (or resume, or reuse when finished) the run of the base config + `overrides`."""
        cfg = load_config([self.config], self.overrides + ["train.progress=false", *overrides])
        out_dir = os.path.join(self.runs_dir, config_key(cfg))
        cfg = load_config([self.config], self.overrides + ["train.progress=false", *overrides,
                                                         f"train.out_dir={out_dir}"])
        done = os.path.join(out_dir, "done.json")
        with _locked(out_dir):
            if not os.path.exists(done):
                t0 = time.perf_counter()
                self.log(f"[{name}] training in {out_dir}")
                Trainer(cfg, log=self.log).run()
                with open(done, "w") as f:
                    json.dump({"name": name, "overrides": list(overrides),
                               "seconds": time.perf_counter() - t0}, f, indent=1)
            else:
                self.log(f"[{name}] reusing {out_dir}")
        self.arms[name] = {"overrides": list(overrides), "run": os.path.basename(out_dir),
                           "config": to_dict(cfg)}
        history = read_metrics(out_dir) if cfg.train.iterations else []
        return Run(name, cfg, out_dir, history)

    def warm_start_dir(self, warm: int = 0) -> str:
        """Warm start `warm`: SFT with train.seed=warm and no RL iterations (every arm with that
        `warm` starts from its weights)."""
        if warm not in self._warm_dirs:
            run = self.train(f"warm_start{warm}/sft", ["train.iterations=0", f"train.seed={warm}",
                                                       "rl.mode=dense", "kv.policy=none"])
            self._warm_dirs[warm] = run.out_dir
        return self._warm_dirs[warm]

    def arm(self, name: str, *, mode: str, policy: str, seed: int = 0, extra: Sequence[str] = (),
            warm: int = 0) -> Run:
        """RL from warm start `warm` with rollouts under `policy`, corrections `mode`, train.seed
        `seed`."""
        overrides = [f"model.init_from={self.warm_start_dir(warm)}", *FROM_WARM_START,
                     f"rl.mode={mode}", f"kv.policy={policy}", f"train.seed={seed}", *extra]
        return self.train(name, overrides)

    def warm_start(self, policy: str | None = None, warm: int = 0) -> Run:
        """Warm start `warm` itself as a zero-iteration run (to evaluate it like any other model;
        its evaluation seed is train.seed + 1 with train.seed = warm)."""
        policy = policy or self.base.kv.policy
        return self.arm("warm_start" if warm == 0 else f"warm_start{warm}", mode="dense",
                        policy=policy, seed=warm, extra=["train.iterations=0"], warm=warm)

    def train_all(self, specs: Sequence[dict], evals: Sequence[tuple[dict, int]] = ()) -> None:
        """Train what `study.arm(**spec)` would for every spec (warm starts first), in parallel
        single-core processes (one per available core; workers.py), and evaluate each final model
        under every (kv overrides, prompts) of `evals` there: later `arm` / `evaluate` calls read
        the cache. A spec {"warm_start": k} trains warm start k and evaluates it."""
        warms = sorted({int(s.get("warm", 0)) for s in specs if "warm_start" not in s}
                       | {int(s["warm_start"]) for s in specs if "warm_start" in s})
        jobs = [{"warm_start": w} for w in warms] + [dict(s) for s in specs if "warm_start" not in s]
        args = (self.config, self.overrides, self.runs_dir, self.base.kv.policy,
                [[dict(kv), int(n)] for kv, n in evals])
        workers.parallel_map(_train_job, [(*args, job) for job in jobs], self.cores)


def _train_job(job) -> None:
    """Worker of Study.train_all: one warm start or one arm, trained and evaluated."""
    config, overrides, runs_dir, policy, evals, spec = job
    study = Study(config, overrides, runs_dir)
    if "warm_start" in spec:
        run = study.warm_start(policy, warm=spec["warm_start"])
    else:
        run = study.arm(**spec)
    for kv, n in evals:
        run.evaluate(kv, n)
    run._trainer = None


# ----------------------------------------------------------------------------- numbers of a run


def last_quarter(history: list[dict], key: str, default: float = 0.0) -> float:
    tail = history[-max(len(history) // 4, 1):]
    return float(np.mean([h.get(key, default) for h in tail])) if tail else float("nan")


def run_mean(history: list[dict], key: str, default: float = 0.0) -> float:
    return float(np.mean([h.get(key, default) for h in history])) if history else float("nan")


def summarize(run: Run) -> dict:
    """The training-time numbers every table quotes, and the reward rule's collapse iteration."""
    h = run.history
    return {
        "train_reward_last25": last_quarter(h, "reward/mean"),
        "train_kv_saving": run_mean(h, "kv/saving"),
        "token_reject_rate": last_quarter(h, "sars/token_reject_rate"),
        "seq_reject_rate": last_quarter(h, "sars/seq_reject_rate"),
        "mismatch_kl_k3": run_mean(h, "mismatch/kl_k3"),
        "entropy_last25": last_quarter(h, "loss/entropy", np.nan),
        "length_last25": last_quarter(h, "response/length_mean"),
        "skipped_steps": float(sum(h_.get("update/skipped", 0.0) for h_ in h)),
        "collapse_iteration": reward_collapse_iteration(h),
    }


def scores(run: Run, sparse_policy: str, n: int | None = None) -> dict:
    """One row of a figure's table: accuracy of the final weights under dense and under
    `sparse_policy` inference (on `n` held-out prompts, default train.eval_prompts), the sparse
    evaluation's KV saving and the training-time summary."""
    sparse = run.evaluate({"policy": sparse_policy}, n=n)
    return {"dense_acc": run.evaluate({"policy": "none"}, n=n)["accuracy"],
            "sparse_acc": sparse["accuracy"], "sparse_kv_saving": sparse["kv_saving"], **summarize(run)}


def warm_rows(study: Study, warms: Sequence[int], n: int, policy: str | None = None) -> dict:
    """{warm start: its dense and sparse (`policy`, default the base config's) accuracy}."""
    policy = policy or study.base.kv.policy
    out = {}
    for w in warms:
        run = study.warm_start(policy, warm=w)
        sparse = run.evaluate({"policy": policy}, n=n)
        out[w] = {"dense_acc": run.evaluate({"policy": "none"}, n=n)["accuracy"],
                  "sparse_acc": sparse["accuracy"], "sparse_kv_saving": sparse["kv_saving"]}
    return out


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


def curve(histories: Sequence[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Iterations, mean and sample standard deviation over runs (0 for one run) of one metric."""
    n = min(len(h) for h in histories)
    ys = np.array([[h[i].get(key, np.nan) for i in range(n)] for h in histories], np.float64)
    std = ys.std(0, ddof=1) if len(histories) > 1 else np.zeros(n)
    return np.arange(1, n + 1), ys.mean(0), std


def sparse_curve(histories: Sequence[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like curve() for a metric logged at some iterations only (e.g. eval/accuracy every
    train.eval_every): the iterations where every run logged it."""
    steps = None
    for h in histories:
        have = {i + 1 for i, row in enumerate(h) if key in row}
        steps = have if steps is None else steps & have
    x = np.array(sorted(steps or ()), np.int64)
    ys = np.array([[h[i - 1][key] for i in x] for h in histories], np.float64).reshape(len(histories), len(x))
    std = ys.std(0, ddof=1) if len(histories) > 1 else np.zeros(len(x))
    return x, ys.mean(0), std


def run_variants(study: Study, names: Sequence[str], seeds: Sequence[int],
                 arm_of: Callable[[str], tuple[str, str, Sequence[str]]],
                 score: Callable[[Run], dict], evals: Sequence[tuple[dict, int]] = (),
                 warms: Sequence[int] = (0,)) -> tuple[dict, dict]:
    """Train (or reuse) every variant x warm start x seed; `arm_of(name)` gives its (rl.mode,
    kv.policy, extra overrides), `evals` the evaluations the workers run. Returns results[name] =
    [score(run) + its warm_start and seed, per run] and histories[name]."""
    arms = {name: arm_of(name) for name in names}
    units = [(w, s) for w in warms for s in seeds]

    def spec(n, w, s):
        return dict(name=f"{n}/seed{s}" if w == 0 else f"{n}/w{w}/seed{s}", mode=arms[n][0],
                    policy=arms[n][1], seed=s, extra=list(arms[n][2]), warm=w)

    study.train_all([spec(n, w, s) for n in names for w, s in units], evals)
    results, histories = {}, {}
    for name in names:
        runs = [(w, s, study.arm(**spec(name, w, s))) for w, s in units]
        histories[name] = [r.history for _, _, r in runs]
        results[name] = [{**score(r), "warm_start": w, "seed": s} for w, s, r in runs]
    return results, histories


# ----------------------------------------------------------------------------- figure style

BAND_CAPTION = ("Lines and bars: mean over runs (warm starts x seeds); shaded bands and error bars: "
                "± one sample standard deviation over runs (none with one run), clipped to the "
                "metric's range.")


def band(ax, x, m, s, colour, floor: float | None = 0.0, ceil: float | None = None) -> None:
    """A ± one-standard-deviation band clipped to the metric's range [floor, ceil]."""
    lo, hi = m - s, m + s
    if floor is not None:
        lo, hi = np.maximum(lo, floor), np.maximum(hi, floor)
    if ceil is not None:
        lo, hi = np.minimum(lo, ceil), np.minimum(hi, ceil)
    ax.fill_between(x, lo, hi, color=colour, alpha=0.2, lw=0)


def config_name(command: str, default_config: str = DEFAULT_CONFIG) -> str:
    """The base config a figure ran on, from its command line: the --config file's stem, or
    that of the script's default config."""
    words = command.split()
    for i, w in enumerate(words):
        if w == "--config" and i + 1 < len(words):
            return os.path.splitext(os.path.basename(words[i + 1]))[0]
        if w.startswith("--config="):
            return os.path.splitext(os.path.basename(w.split("=", 1)[1]))[0]
    return os.path.splitext(os.path.basename(default_config))[0]


def runs_phrase(seeds: Sequence[int], warms: Sequence[int] = (0,)) -> str:
    """'3 seeds' or '2 warm starts x 3 seeds'."""
    s = f"{len(seeds)} seed{'s' if len(seeds) != 1 else ''}"
    return s if len(warms) == 1 else f"{len(warms)} warm starts x {s}"


def run_title(cfg: TrainConfig, command: str, seeds: Sequence[int], what: str = "",
              warms: Sequence[int] = (0,), default_config: str = DEFAULT_CONFIG) -> str:
    """A suptitle saying what was run: config, task, KV policy and budget, runs, iterations."""
    kv = cfg.kv
    head = f"{what}\n" if what else ""
    return (f"{head}{config_name(command, default_config)} (task {cfg.data.task}), {kv.policy} budget {kv.budget} + "
            f"buffer {kv.buffer}\n{runs_phrase(seeds, warms)}, "
            f"{cfg.train.iterations} iterations of {cfg.rollout.prompts}x{cfg.rollout.samples} rollouts")


def symlog_axis(ax, values: Iterable[float], axis: str = "x") -> None:
    """A log axis that also shows values <= 0: symlog, linear below the smallest positive |value|,
    with at most 5 decade ticks (no overlapping labels)."""
    v = np.abs(np.asarray([x for x in values if np.isfinite(x)], np.float64))
    pos = v[v > 0]
    lo = int(np.floor(np.log10(pos.min()))) if pos.size else -6
    hi = int(np.ceil(np.log10(v.max()))) if pos.size else 0
    hi = max(hi, lo + 1)
    getattr(ax, f"set_{axis}scale")("symlog", linthresh=10.0 ** lo, linscale=0.5)
    step = max(1, -(-(hi - lo) // 4))
    ticks = [0.0] + [10.0 ** k for k in range(hi, lo - 1, -step)][::-1]
    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(FixedLocator(ticks))
    target.set_minor_locator(FixedLocator([]))
    target.set_major_formatter(FuncFormatter(
        lambda x, _: "0" if x == 0 else f"$10^{{{int(round(np.log10(abs(x))))}}}$"))
    neg = np.asarray([x for x in values if np.isfinite(x)], np.float64)
    low = min(-0.3 * 10.0 ** lo, 1.5 * float(neg.min()) if neg.size else 0.0)
    # room right of the largest bar for its value
    getattr(ax, f"set_{axis}lim")(low, 10.0 ** (hi + 0.3 * (hi - lo + 1)))


def ablation_figure(results: dict[str, list[dict]], histories: dict[str, list[list[dict]]],
                    bars: Sequence[tuple[str, str, str, bool]], labels: dict[str, str], title: str,
                    reference: str | None = None):
    """A figure of an ablation with short variant labels: one horizontal bar panel (mean ± std over
    runs, value written beside each bar, every run a dot) per (key, axis label, value format,
    symlog?) in `bars`, then one small panel per variant with its train reward curve (mean ± std
    over runs) over the `reference` variant's mean (grey, dashed)."""
    names = list(results)
    colours = {n: f"C{i}" for i, n in enumerate(names)}
    n_multi_rows = -(-len(names) // 2)
    bar_h = 0.9 + 0.22 * len(names)
    fig = plt.figure(figsize=(2 * PANEL_W, bar_h * -(-len(bars) // 2) + 1.55 * n_multi_rows + 0.5),
                     layout="constrained")
    top, bottom = fig.subfigures(2, 1, height_ratios=[bar_h * -(-len(bars) // 2), 1.55 * n_multi_rows])
    bar_axes = np.atleast_1d(top.subplots(-(-len(bars) // 2), min(len(bars), 2))).ravel()
    y = np.arange(len(names))
    for ax, (key, xlabel, spec, log) in zip(bar_axes, bars):
        stats = [mean_std(r[key] for r in results[n]) for n in names]
        means = np.array([m for m, _ in stats])
        stds = np.array([s for _, s in stats])
        lo = np.minimum(stds, np.maximum(means, 0.0))  # no error bar below the metric's floor, 0
        ax.barh(y, means, xerr=[lo, stds], color=[colours[n] for n in names], capsize=2, alpha=0.85,
                error_kw={"elinewidth": 0.8})
        for yi, n in zip(y, names):
            vals = [r[key] for r in results[n]]
            if len(vals) > 1:
                ax.plot(vals, yi + np.linspace(-0.15, 0.15, len(vals)), "k.", ms=2.5)
        ax.set_yticks(y, [labels.get(n, n) for n in names])
        if ax is not bar_axes[0] and len(bar_axes) == 2:  # same rows as its left neighbour
            ax.tick_params(labelleft=False)
        ax.invert_yaxis()
        ax.set_xlabel(xlabel)
        if log:
            symlog_axis(ax, np.concatenate([means, means + stds]))
        else:
            ax.set_xlim(0, max(1e-9, float(np.nanmax(means + stds))) * 1.3)
        for yi, m, s in zip(y, means, stds):
            ax.annotate(f"{m:{spec}}", (max(m + s, 0), yi),
                        xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
    multi = np.atleast_2d(bottom.subplots(n_multi_rows, 2, sharex=True, sharey=True))
    for i, ax in enumerate(multi.ravel()):
        if i >= len(names):
            ax.set_visible(False)
            continue
        name = names[i]
        if reference in histories and name != reference:
            x, m, _ = curve(histories[reference], "reward/mean")
            ax.plot(x, m, "--", color="0.55", lw=1)
        x, m, s = curve(histories[name], "reward/mean")
        ax.plot(x, m, color=colours[name], lw=1.2)
        band(ax, x, m, s, colours[name], 0.0, 1.0)
        ax.set_title(labels.get(name, name), fontsize=8, pad=2)
        if i % 2 == 0:
            ax.set_ylabel("train reward\n(mean per rollout)")
        if i >= len(names) - 2:
            ax.set_xlabel("iteration")
            ax.xaxis.set_tick_params(labelbottom=True)
    fig.suptitle(title)
    return fig


def band_legend_below(fig, ax, ncol: int | None = None) -> None:
    """One legend for the whole figure, below its panels (never over a curve)."""
    handles, names = ax.get_legend_handles_labels()
    fig.legend(handles, names, loc="outside lower center", ncol=ncol or len(names), frameon=False)


# ----------------------------------------------------------------------------- provenance


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def command_line(cores: Sequence[int] | None = None) -> str:
    """This process's command as the docs write it, with the pinning it ran under: `taskset -c`
    when the command may use fewer cores than the machine has, SPARSERL_PORTABLE_CPU=0 when the
    portable CPU settings were off."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO) if sys.argv[0] else "?"
    prefix = [] if workers.portable_cpu_enabled() else ["SPARSERL_PORTABLE_CPU=0"]
    cores = list(workers.available_cores() if cores is None else cores)
    if len(cores) < (os.cpu_count() or len(cores)):
        prefix += ["taskset", "-c", ",".join(map(str, cores))]
    return " ".join([*prefix, "python", script, *sys.argv[1:]])


def cpu_model() -> str:
    """The CPU's model name, family and model, and whether it has AVX-512."""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return "?"
    info = {k.strip(): v.strip() for k, v in info.items()}
    avx512 = "avx512f" in info.get("flags", "").split()
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}, {'AVX-512' if avx512 else 'no AVX-512'})")


def provenance(cores: Sequence[int], seconds: float | None) -> dict:
    """What produced a result: commit (and whether the tree had uncommitted changes), the portable
    CPU settings (workers.py), the machine, the jax version, the cores and the wall time."""
    import jax

    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "--short=12", "HEAD"), "uncommitted_changes": bool(dirty),
            "portable_cpu": workers.portable_cpu_enabled(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "cpu": cpu_model(), "jax": jax.__version__, "python": sys.version.split()[0],
            "cores": len(cores), "wall_s": None if seconds is None else round(seconds, 1)}


def provenance_line(data: dict, results_json: str | None = None) -> str:
    """results.md's provenance sentence, from data['provenance'] (or, for results that did not
    record it, what git says of their results.json)."""
    p = data.get("provenance")
    if p and p.get("recorded") is False:  # results from before figlib recorded it: what git says
        numerics = ("the portable CPU numerics (their default since)" if p["portable_cpu"] else
                    "the host's own CPU numerics")
        return (f"Provenance: not recorded by the run; its numbers were committed in {p['results_commit']}, "
                f"{'after' if p['portable_cpu'] else 'before'} the portable CPU settings ({PORTABLE_SINCE}), "
                f"so it ran with {numerics}; machine, jax version and each arm's config not recorded.")
    if p:
        commit = f"{p['commit']}{' with uncommitted changes' if p['uncommitted_changes'] else ''}"
        portable = "on" if p["portable_cpu"] else "off (SPARSERL_PORTABLE_CPU=0)"
        wall = "" if p["wall_s"] is None else f"; wall time {p['wall_s']:.0f} s"
        arms = " Every run's resolved config: [arms.json](arms.json)." if p.get("arms_json") else ""
        return (f"Provenance: commit {commit}; portable CPU settings {portable} (experiments/workers.py); "
                f"{p['cpu']}; jax {p['jax']}; {p['cores']} core(s){wall}.{arms}")
    if results_json is None:
        return "Provenance: not recorded."
    rel = os.path.relpath(os.path.abspath(results_json), REPO)
    commit = _git("log", "-1", "--format=%h %ad", "--date=short", "--", rel)
    if not commit:
        return "Provenance: not recorded by this run (before figlib recorded it)."
    before = _git("merge-base", "--is-ancestor", PORTABLE_SINCE, commit.split()[0]) is None
    return (f"Provenance: not recorded by this run (before figlib recorded it); its results.json was "
            f"committed in {commit}, {'before' if before else 'after'} the portable CPU settings "
            f"({PORTABLE_SINCE}), so it ran with {'the host' if before else 'the portable'} CPU numerics; "
            "no arms.json.")


# ----------------------------------------------------------------------------- the scaffold


@dataclasses.dataclass
class Rendered:
    """A figure's render: results.md's title and body (tables, notes), its figures by file stem
    (the first is the main one, shown under the body with `caption`; the body shows the others)."""

    title: str
    markdown: str
    figures: dict
    caption: str = ""


@dataclasses.dataclass
class Figure:
    """One result script. `run(args, study)` trains and evaluates (study is None when
    `trains=False`) and returns the numbers (JSON-able); `render(data, base, command)` turns them
    into a Rendered, from a fresh run or from a committed results.json (--replot)."""

    name: str  # results directory: experiments/results/<name>[/<config stem>]
    doc: str
    run: Callable[[argparse.Namespace, "Study | None"], dict]
    render: Callable[[dict, "TrainConfig | None", str], Rendered]
    arguments: Callable[[argparse.ArgumentParser], None] | None = None
    seeds: Sequence[int] | None = (0,)  # --seeds default; None: the script has no seeds
    seeds_help: str = "train.seed of the RL runs (on every warm start)"
    warm_starts: Sequence[int] | None = None  # --warm-starts default; None: warm start 0 only
    trains: bool = True  # --config, --runs-dir, overrides, a Study
    eval_prompts: bool = True  # --eval-prompts
    replot: bool = True
    default_config: str = DEFAULT_CONFIG
    fresh_runs: bool = False  # runs in <out>/runs, cleared first, unless --runs-dir names a cache

    def parser(self) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser(description=self.doc.split("\n")[0], epilog=self.doc,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
        if self.replot:
            p.add_argument("--replot", metavar="DIR", help="re-render the PNG(s) and results.md of a "
                           "results directory from its results.json and config.yaml (no training)")
        p.add_argument("--out", help="output directory (default experiments/results/<figure>, or "
                       "<figure>/<config stem> for another --config)")
        p.add_argument("--smoke", action="store_true", help="a seconds-long run (tests)")
        if self.seeds is not None:
            p.add_argument("--seeds", type=int, nargs="+", default=list(self.seeds), help=self.seeds_help)
        if self.warm_starts is not None:
            p.add_argument("--warm-starts", type=int, nargs="+", default=list(self.warm_starts),
                           help="SFT seeds of the warm starts every arm is trained from")
        if self.trains:
            p.add_argument("--config", default=self.default_config, help="the base YAML config")
            p.add_argument("--runs-dir", default=None if self.fresh_runs else DEFAULT_RUNS,
                           help="cache of training runs, shared by figures" + (
                               " (default: <out>/runs, cleared first)" if self.fresh_runs else ""))
            if self.eval_prompts:
                p.add_argument("--eval-prompts", type=int, help=f"held-out prompts of the final "
                               f"evaluations (default: at least {EVAL_PROMPTS}; train.eval_prompts "
                               "with --smoke)")
            p.add_argument("overrides", nargs="*", help="key=value settings applied to every run")
        if self.arguments:
            self.arguments(p)
        return p

    def main(self, argv=None) -> dict:
        args = self.parser().parse_args(argv)
        if getattr(args, "replot", None):
            data, base = load_results(args.replot, self.trains, self.default_config)
            self.write(args.replot, data, base, replot=True)
            return data
        t0 = time.perf_counter()
        cores = workers.available_cores()  # before this process pins itself to the first
        command = command_line(cores)
        args.out = args.out or default_out(self.name, getattr(args, "config", self.default_config),
                                           self.default_config)
        if self.fresh_runs and args.runs_dir is None:
            args.runs_dir = os.path.join(args.out, "runs")
            shutil.rmtree(args.runs_dir, ignore_errors=True)
        study = study_from_args(args, cores) if self.trains else None
        data = self.run(args, study)
        data = {"command": command, **data,
                "provenance": {**provenance(cores, time.perf_counter() - t0), "arms_json": bool(study and study.arms)}}
        self.write(args.out, data, study.base if study else None, study)
        return data

    def write(self, out: str, data: dict, base, study: Study | None = None, replot: bool = False) -> None:
        """results.md and the PNGs (and, unless `replot`, results.json, arms.json, config.yaml)."""
        write_results(out, self.render(data, base, data["command"]), data, study, replot)


def write_results(out: str, r: Rendered, data: dict, study: Study | None = None, replot: bool = False) -> None:
    """results.md (title, command, provenance, body, main figure, caption) and every PNG of `r`;
    unless `replot`, also results.json (`data`), and with a study arms.json and config.yaml."""
    os.makedirs(out, exist_ok=True)
    prov = provenance_line(data, os.path.join(out, "results.json") if replot else None)
    main = next(iter(r.figures), None)
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write(f"# {r.title}\n\nCommand: `{data['command']}`\n\n{prov}\n\n{r.markdown}\n")
        if main:
            f.write(f"\n![{main}]({main}.png)\n")
        if r.caption:
            f.write(f"\n{r.caption}\n")
    for name, fig in r.figures.items():
        save_figure(out, fig, name)
    if not replot:
        with open(os.path.join(out, "results.json"), "w") as f:
            json.dump(data, f, indent=1, default=float)
        if study is not None:
            dump_config(study.base, os.path.join(out, "config.yaml"))
        if study is not None and study.arms:
            with open(os.path.join(out, "arms.json"), "w") as f:
                json.dump({"config": os.path.relpath(study.config, REPO), "overrides": study.overrides,
                           "arms": study.arms}, f, indent=1)
    print(r.markdown)


def parser(doc: str, replot: bool = False) -> argparse.ArgumentParser:
    """The common arguments alone (--config, --out, --runs-dir, --smoke, overrides; `replot`: also
    --replot and --eval-prompts), for a script that builds its own main (real_rl.py)."""
    return Figure("", doc, None, None, seeds=None, eval_prompts=replot, replot=replot).parser()


def variants_parser(doc: str, variants: Sequence[str], replot: bool = False) -> argparse.ArgumentParser:
    """parser() plus --variants (default: all) and --seeds (default: 0 1 2)."""
    p = parser(doc, replot)
    p.add_argument("--variants", nargs="+", default=list(variants), choices=list(variants))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    return p


def write_outputs(out_dir: str, title: str, markdown: str, data: dict, fig, figure_name: str,
                  study: Study | None = None, *, caption: str = "", replot: bool = False) -> None:
    """write_results for a script that builds its own main: the command and provenance of this
    process (or, with `replot`, those `data` recorded)."""
    if not replot:
        cores = workers.available_cores()
        data = {"command": command_line(cores), **data,
                "provenance": {**provenance(cores, None), "arms_json": bool(study and study.arms)}}
    write_results(out_dir, Rendered(title, markdown, {figure_name: fig}, caption), data, study, replot)


def study_from_args(args, cores: list[int] | None = None) -> Study:
    """The study of a figure script's arguments. Pins this process to one core first (before any
    JAX computation; workers.py) so its evaluations, like its workers' runs, are the same on any
    machine; the workers get every core the command may use (`cores`, counted before pinning)."""
    if getattr(args, "replot", None):
        raise ValueError("--replot re-renders committed results: it trains nothing")
    cores = workers.available_cores() if cores is None else cores
    workers.pin_to_one_core()
    overrides = list(args.overrides) + (smoke_overrides(args.config, args.overrides) if args.smoke else [])
    return Study(args.config, overrides, args.runs_dir, cores=cores)


def smoke_overrides(config: str, overrides: Sequence[str] = ()) -> list[str]:
    """SMOKE_OVERRIDES, plus a 2-step SFT curriculum where the config has one."""
    has_curriculum = load_config([config], list(overrides)).sft.curriculum.steps > 0
    return list(SMOKE_OVERRIDES) + (["sft.curriculum.steps=2"] if has_curriculum else [])


def eval_prompts(args, study: Study) -> int:
    """The final evaluations' prompt count: --eval-prompts, else max(EVAL_PROMPTS,
    train.eval_prompts), else (--smoke) train.eval_prompts."""
    if getattr(args, "eval_prompts", None):
        return args.eval_prompts
    n = study.base.train.eval_prompts
    return n if args.smoke else max(EVAL_PROMPTS, n)


def warms_of(args) -> list[int]:
    """--warm-starts, or [0] for a script without it."""
    return list(getattr(args, "warm_starts", None) or [0])


def load_results(out_dir: str, with_config: bool = True,
                 default_config: str = DEFAULT_CONFIG) -> tuple[dict, TrainConfig | None]:
    """A results directory's results.json and the base config it ran: its config.yaml, or (results
    that kept none) the --config of its command, else `default_config`."""
    with open(os.path.join(out_dir, "results.json")) as f:
        data = json.load(f)
    if not with_config:
        return data, None
    path = os.path.join(out_dir, "config.yaml")
    if not os.path.exists(path):
        words = data["command"].split()
        path = (os.path.join(REPO, words[words.index("--config") + 1]) if "--config" in words
                else default_config)
    return data, load_config([path])


def save_figure(out_dir: str, fig, name: str) -> None:
    """<out_dir>/<name>.png."""
    os.makedirs(out_dir, exist_ok=True)
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    fig.savefig(os.path.join(out_dir, f"{name}.png"), dpi=DPI)
    plt.close(fig)


def default_out(name: str, config: str = DEFAULT_CONFIG, default_config: str = DEFAULT_CONFIG) -> str:
    """experiments/results/<figure>, or .../<figure>/<config stem> for another base config (so
    a second regime never overwrites the first)."""
    out = os.path.join(HERE, "results", name)
    if os.path.abspath(config) == os.path.abspath(default_config):
        return out
    return os.path.join(out, os.path.splitext(os.path.basename(config))[0])
