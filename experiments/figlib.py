"""Shared machinery of the figure scripts (experiments/fig_*.py).

Every figure is a set of training runs from one shared warm start plus evaluations of their final
weights. A run is identified by its full configuration: `Study.arm(...)` trains it once into
`<runs_dir>/<config hash>/` and every later call (from any figure script) reuses the finished run,
so the curves of fig_a, the policy ablation of fig_c and the correction ablation of fig_d share
their common arms instead of training them again. An interrupted run resumes from its last
checkpoint (the trainer's exact resume). Evaluations are cached in the run directory too.
`Study.train_all` trains a figure's independent runs in parallel single-core processes and the
script's own process is pinned to one core (workers.py), so figures are the same on any machine.

Outputs of a figure: `<out>/results.md` (the exact command, the table, the figure's caption),
`<out>/results.json` (every number behind the table and the figure), `<out>/config.yaml` and
`<out>/<name>.png`. `--replot <out>` (figures a-e and QuRL) re-renders the PNGs and results.md from
results.json and config.yaml alone, training and evaluating nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
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

# Paper-column figures: every panel about 3.5 in wide, saved at DPI, no text below 8 pt.
PANEL_W = 3.5
DPI = 150
plt.rcParams.update({"font.size": 8, "axes.titlesize": 9, "axes.labelsize": 8, "xtick.labelsize": 8,
                     "ytick.labelsize": 8, "legend.fontsize": 8, "figure.titlesize": 10})

# Settings that do not change what a run computes: left out of its identity.
_NOT_IDENTITY = ("train.out_dir", "train.progress", "train.save_every", "train.keep_checkpoints")


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
    value does not change the keys (bump RESULTS_EPOCH, or clear the run cache, after such a change). The warm start a run
    starts from enters by its own key (the basename of model.init_from), not by its location."""
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
    """Serialise work on one run directory between concurrently running figure scripts."""
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
    """Runs of one base config (YAML + overrides) that all start from the same warm start."""

    def __init__(self, config: str = DEFAULT_CONFIG, overrides: Sequence[str] = (),
                 runs_dir: str = DEFAULT_RUNS, log: Callable = print, cores: list[int] | None = None):
        self.config = config
        self.cores = cores  # train_all's worker cores (default: this process's available ones)
        self.overrides = list(overrides)
        self.runs_dir = runs_dir
        self.log = log
        self.base = load_config([config], self.overrides)
        self._warm_dir: str | None = None

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
                trainer = Trainer(cfg, log=self.log)
                trainer.run()
                with open(done, "w") as f:
                    json.dump({"name": name, "overrides": list(overrides),
                               "seconds": time.perf_counter() - t0}, f, indent=1)
            else:
                self.log(f"[{name}] reusing {out_dir}")
        history = read_metrics(out_dir) if cfg.train.iterations else []
        return Run(name, cfg, out_dir, history)

    def warm_start_dir(self) -> str:
        """The shared warm start: SFT with seed 0 and no RL iterations (every arm starts here)."""
        if self._warm_dir is None:
            run = self.train("warm_start", ["train.iterations=0", "train.seed=0",
                                             "rl.mode=dense", "kv.policy=none"])
            self._warm_dir = run.out_dir
        return self._warm_dir

    def arm(self, name: str, *, mode: str, policy: str, seed: int = 0,
            extra: Sequence[str] = ()) -> Run:
        """RL from the warm start with rollouts under `policy` and corrections `mode`."""
        overrides = [f"model.init_from={self.warm_start_dir()}", *FROM_WARM_START,
                     f"rl.mode={mode}", f"kv.policy={policy}", f"train.seed={seed}", *extra]
        return self.train(name, overrides)

    def train_all(self, specs: Sequence[dict]) -> list[Run]:
        """Train the runs `study.arm(**spec)` would, in parallel single-core processes (one per
        available core; workers.py), into the same cache: later `arm` calls reuse them."""
        warm = self.warm_start_dir()
        jobs = [(self.config, self.overrides, self.runs_dir, warm, dict(spec)) for spec in specs]
        return workers.parallel_map(_train_job, jobs, self.cores)

    def warm_start(self, policy: str | None = None) -> Run:
        """The warm start itself as a zero-iteration run (to evaluate it like any other model)."""
        policy = policy or self.base.kv.policy
        return self.arm("warm_start", mode="dense", policy=policy, extra=["train.iterations=0"])


def _train_job(job) -> Run:
    """Worker of Study.train_all: one arm of a study."""
    config, overrides, runs_dir, warm_dir, spec = job
    study = Study(config, overrides, runs_dir)
    study._warm_dir = warm_dir
    return study.arm(**spec)


# ----------------------------------------------------------------------------- statistics


def last_quarter(history: list[dict], key: str, default: float = 0.0) -> float:
    tail = history[-max(len(history) // 4, 1):]
    return float(np.mean([h.get(key, default) for h in tail])) if tail else float("nan")


def run_mean(history: list[dict], key: str, default: float = 0.0) -> float:
    return float(np.mean([h.get(key, default) for h in history])) if history else float("nan")


def summarize(run: Run) -> dict:
    """The training-time numbers every table quotes."""
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
    }


def scores(run: Run, sparse_policy: str, n: int | None = None) -> dict:
    """Accuracy of the final weights under dense and under `sparse_policy` inference (on `n`
    held-out prompts, default train.eval_prompts), with the training-time summary: one row of a
    figure's table."""
    return {
        "dense_acc": run.evaluate({"policy": "none"}, n=n)["accuracy"],
        "sparse_acc": run.evaluate({"policy": sparse_policy}, n=n)["accuracy"],
        **summarize(run),
    }


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    v = np.asarray(list(values), np.float64)
    return float(v.mean()), float(v.std(ddof=1)) if v.size > 1 else 0.0


def fmt(values: Sequence[float], spec: str = ".3f") -> str:
    """'m' for one seed, 'm ± s' for several."""
    m, s = mean_std(values)
    return f"{m:{spec}}" if len(values) == 1 else f"{m:{spec}} ± {s:{spec.lstrip('+')}}"


def curve(histories: Sequence[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Iterations, mean and sample standard deviation over seeds (0 for one seed) of one metric,
    as the tables give them."""
    n = min(len(h) for h in histories)
    ys = np.array([[h[i].get(key, np.nan) for i in range(n)] for h in histories], np.float64)
    std = ys.std(0, ddof=1) if len(histories) > 1 else np.zeros(n)
    return np.arange(1, n + 1), ys.mean(0), std


def sparse_curve(histories: Sequence[list[dict]], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like curve() for a metric logged at some iterations only (e.g. eval/accuracy every
    train.eval_every): the iterations where every seed logged it."""
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
                 score: Callable[[Run], dict]) -> tuple[dict, dict]:
    """Train (or reuse) every variant x seed; `arm_of(name)` gives its (rl.mode, kv.policy, extra
    overrides). Returns results[name] = [score(run) per seed] and histories[name]."""
    arms = {name: arm_of(name) for name in names}
    study.train_all([dict(name=f"{n}/seed{s}", mode=arms[n][0], policy=arms[n][1], seed=s,
                          extra=arms[n][2]) for n in names for s in seeds])
    results, histories = {}, {}
    for name in names:
        mode, policy, extra = arm_of(name)
        runs = [study.arm(f"{name}/seed{s}", mode=mode, policy=policy, seed=s, extra=extra)
                for s in seeds]
        histories[name] = [r.history for r in runs]
        results[name] = [score(r) for r in runs]
    return results, histories


def bars_and_reward_curves(results: dict[str, list[dict]], histories: dict[str, list[list[dict]]],
                           bars: Sequence[tuple[str, str]]):
    """One bar chart (mean ± std over seeds, one bar per variant) per (key, title) in `bars`, then
    the train reward curves of every variant (mean over seeds)."""
    fig, axes = plt.subplots(1, len(bars) + 1, figsize=(14, 3.6))
    names = list(results)
    for ax, (key, title) in zip(axes[:-1], bars):
        stats = [mean_std(r[key] for r in results[n]) for n in names]
        ax.bar(np.arange(len(names)), [m for m, _ in stats], yerr=[s for _, s in stats], capsize=3)
        ax.set_xticks(np.arange(len(names)), names, fontsize=7, rotation=30)
        ax.set_title(title)
    for name in names:
        x, m, _ = curve(histories[name], "reward/mean")
        axes[-1].plot(x, m, label=name)
    axes[-1].set_title("train reward (mean over seeds)")
    axes[-1].set_xlabel("iteration")
    axes[-1].legend(fontsize=7)
    return fig


# ----------------------------------------------------------------------------- figure style

BAND_CAPTION = ("Lines and bars: mean over seeds; shaded bands and error bars: ± one sample standard "
                "deviation over seeds (none with one seed).")


def config_name(command: str) -> str:
    """The base config a figure ran on, from its command line: the --config file's stem, or
    'default'."""
    words = command.split()
    for i, w in enumerate(words):
        if w == "--config" and i + 1 < len(words):
            return os.path.splitext(os.path.basename(words[i + 1]))[0]
        if w.startswith("--config="):
            return os.path.splitext(os.path.basename(w.split("=", 1)[1]))[0]
    return "default"


def run_title(cfg: TrainConfig, command: str, seeds: Sequence[int], what: str = "") -> str:
    """A suptitle saying what was run: config, task, KV policy and budget, seeds, iterations."""
    kv = cfg.kv
    head = f"{what}\n" if what else ""
    return (f"{head}{config_name(command)} (task {cfg.data.task}), {kv.policy} budget {kv.budget} + "
            f"buffer {kv.buffer}, {len(seeds)} seed{'s' if len(seeds) != 1 else ''}, "
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


def _value_text(value: float, spec: str) -> str:
    return f"{value:{spec}}"


def ablation_figure(results: dict[str, list[dict]], histories: dict[str, list[list[dict]]],
                    bars: Sequence[tuple[str, str, str, bool]], labels: dict[str, str], title: str,
                    reference: str | None = None):
    """A figure of an ablation with short variant labels: one horizontal bar panel (mean ± std over
    seeds, value written beside each bar) per (key, axis label, value format, symlog?) in `bars`,
    then one small panel per variant with its train reward curve (mean ± std over seeds) over the
    `reference` variant's mean (grey, dashed)."""
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
        ax.barh(y, means, xerr=stds, color=[colours[n] for n in names], capsize=2,
                error_kw={"elinewidth": 0.8})
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
            ax.annotate(_value_text(m, spec), (max(m + s, 0), yi),
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
        ax.fill_between(x, m - s, m + s, color=colours[name], alpha=0.2, lw=0)
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


# ----------------------------------------------------------------------------- command line, outputs


def parser(doc: str, replot: bool = False) -> argparse.ArgumentParser:
    """The options every figure script has; `replot`: also --replot and --eval-prompts (the scripts
    that support them)."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=doc)
    if replot:
        p.add_argument("--replot", metavar="DIR", help="re-render the PNG(s) and results.md of a "
                       "results directory from its results.json and config.yaml (no training); the "
                       "tables keep their numbers")
        p.add_argument("--eval-prompts", type=int, help=f"held-out prompts of the final evaluations "
                       f"(default: at least {EVAL_PROMPTS}; train.eval_prompts with --smoke)")
    p.add_argument("--config", default=DEFAULT_CONFIG, help="the base YAML config")
    p.add_argument("--out", help="output directory (default experiments/results/<figure>, or "
                   "<figure>/<config stem> for another --config)")
    p.add_argument("--runs-dir", default=DEFAULT_RUNS, help="cache of training runs, shared by figures")
    p.add_argument("--smoke", action="store_true", help="a seconds-long run (tests)")
    p.add_argument("overrides", nargs="*", help="key=value settings applied to every run")
    return p


def variants_parser(doc: str, variants: Sequence[str], replot: bool = False) -> argparse.ArgumentParser:
    """parser() plus --variants (default: all) and --seeds (default: 0 1 2)."""
    p = parser(doc, replot)
    p.add_argument("--variants", nargs="+", default=list(variants), choices=list(variants))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    return p


def study_from_args(args) -> Study:
    """The study of a figure script's arguments. Pins this process to one core first (before any
    JAX computation; workers.py) so its evaluations, like its workers' runs, are the same on any
    machine."""
    if getattr(args, "replot", None):
        raise ValueError("--replot re-renders committed results: it trains nothing")
    cores = workers.available_cores()  # counted before this process keeps only the first
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


def load_results(out_dir: str) -> tuple[dict, TrainConfig]:
    """A results directory's results.json and the base config it ran (its config.yaml)."""
    with open(os.path.join(out_dir, "results.json")) as f:
        data = json.load(f)
    return data, load_config([os.path.join(out_dir, "config.yaml")])


def command_line() -> str:
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO) if sys.argv[0] else "?"
    return " ".join(["python", script, *sys.argv[1:]])


def write_outputs(out_dir: str, title: str, markdown: str, data: dict, fig, figure_name: str,
                  study: Study | None = None, *, caption: str = "", replot: bool = False) -> None:
    """results.md (command + table + the figure and its caption), results.json (the numbers),
    <figure_name>.png, config.yaml. `replot`: results.json and config.yaml stay as they are (the
    command in results.md stays the one that produced them)."""
    os.makedirs(out_dir, exist_ok=True)
    command = data["command"] if replot else command_line()
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write(f"# {title}\n\nCommand: `{command}`\n\n{markdown}\n\n![{figure_name}]({figure_name}.png)\n")
        if caption:
            f.write(f"\n{caption}\n")
    if not replot:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump({"command": command, **data}, f, indent=1, default=float)
    save_figure(out_dir, fig, figure_name)
    if study is not None and not replot:
        dump_config(study.base, os.path.join(out_dir, "config.yaml"))
    print(markdown)


def save_figure(out_dir: str, fig, name: str) -> None:
    """<out_dir>/<name>.png (a figure's extra plots; write_outputs saves its main one)."""
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

