"""Training runs shared by figures: a `Study` trains each run once into `<runs_dir>/<config
hash>/` (`config_key`: the settings that differ from the defaults) and every later call, from any
figure, reuses it; an interrupted run resumes from its last checkpoint. Warm starts are runs too
(SFT seed k, `Study.warm_start_dir(k)`); `Study.train_all` trains warm starts and arms in parallel
single-core processes (workers.py). `summarize` / `scores` / `accuracies` are the numbers every table quotes of a
run; `run_variants` trains a figure's variants x warm starts x seeds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence

import numpy as np

from experiments.lib import workers  # imports no JAX
from experiments.lib.figstats import last_quarter, reward_collapse_iteration, run_mean
from sparserl_jax.config import TrainConfig, load_config, to_dict
from sparserl_jax.metrics_log import read_metrics
from sparserl_jax.train import Trainer

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
REPO = os.path.dirname(HERE)
DEFAULT_CONFIG = os.path.join(HERE, "configs", "default.yaml")
DEFAULT_RUNS = os.path.join(REPO, "runs", "figures")

# A seconds-long version of any experiment (tests and first checks).
SMOKE_OVERRIDES = (
    "sft.steps=5",
    "train.iterations=2",
    "train.eval_prompts=4",
    "rollout.prompts=2",
    "rollout.samples=4",
    "rl.update.minibatch_size=8",
    "rl.update.micro_batch_size=8",
    "rl.update.compile_ahead=false",  # two iterations compile only the programs they run
)

# An RL run from a warm start's weights (model.init_from): neither SFT phase runs again.
FROM_WARM_START = ("sft.steps=0", "sft.curriculum.steps=0")

# Final evaluations use at least this many held-out prompts (binomial SE <= 0.022; 128 prompts
# gave ~0.04). Evaluations are cached per run and prompt count, so raising it re-trains nothing.
EVAL_PROMPTS = 512

# Settings that do not change what a run computes: left out of its identity.
_NOT_IDENTITY = (
    "train.out_dir",
    "train.progress",
    "train.save_every",
    "train.keep_checkpoints",
    "rl.update.compile_ahead",
)


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
        *sections, name = dotted.split(".")
        functools.reduce(lambda node, key: node[key], sections, tree).pop(name, None)
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
        key = {"kv": dataclasses.asdict(kv_cfg), "n": n}
        if self.cfg.train.eval_temperature is not None:  # part of the identity only when set
            key["temperature"] = self.cfg.train.eval_temperature
        key = json.dumps(key, sort_keys=True)
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

    def __init__(
        self,
        config: str = DEFAULT_CONFIG,
        overrides: Sequence[str] = (),
        runs_dir: str = DEFAULT_RUNS,
        log: Callable = print,
        cores: list[int] | None = None,
    ):
        self.config = config
        self.cores = cores  # train_all's worker cores (default: this process's available ones)
        self.overrides = list(overrides)
        self.runs_dir = runs_dir
        self.log = log
        self.base = load_config([config], self.overrides)
        self._warm_dirs: dict[int, str] = {}
        self.arms: dict[str, dict] = {}  # every run this study returned: name -> resolved config

    def resolve(self, overrides: Sequence[str]) -> TrainConfig:
        """The config of the run of the base config + `overrides` (its identity: config_key)."""
        return load_config([self.config], self.overrides + ["train.progress=false", *overrides])

    def train(self, name: str, overrides: Sequence[str]) -> Run:
        """Train (or resume, or reuse when finished) the run of the base config + `overrides`."""
        cfg = self.resolve(overrides)
        out_dir = os.path.join(self.runs_dir, config_key(cfg))
        cfg = load_config(
            [self.config], self.overrides + ["train.progress=false", *overrides, f"train.out_dir={out_dir}"]
        )
        done = os.path.join(out_dir, "done.json")
        with _locked(out_dir):
            if not os.path.exists(done):
                t0 = time.perf_counter()
                self.log(f"[{name}] training in {out_dir}")
                Trainer(cfg, log=self.log).run()
                with open(done, "w") as f:
                    json.dump(
                        {"name": name, "overrides": list(overrides), "seconds": time.perf_counter() - t0}, f, indent=1
                    )
            else:
                self.log(f"[{name}] reusing {out_dir}")
        self.arms[name] = {"overrides": list(overrides), "run": os.path.basename(out_dir), "config": to_dict(cfg)}
        history = read_metrics(out_dir) if cfg.train.iterations else []
        return Run(name, cfg, out_dir, history)

    def warm_start_dir(self, warm: int = 0) -> str:
        """Warm start `warm`: SFT with train.seed=warm and no RL iterations (every arm with that
        `warm` starts from its weights)."""
        if warm not in self._warm_dirs:
            run = self.train(
                f"warm_start{warm}/sft", ["train.iterations=0", f"train.seed={warm}", "rl.mode=dense", "kv.policy=none"]
            )
            self._warm_dirs[warm] = run.out_dir
        return self._warm_dirs[warm]

    def arm(self, name: str, *, mode: str, policy: str, seed: int = 0, extra: Sequence[str] = (), warm: int = 0) -> Run:
        """RL from warm start `warm` with rollouts under `policy`, corrections `mode`, train.seed
        `seed`."""
        overrides = [
            f"model.init_from={self.warm_start_dir(warm)}",
            *FROM_WARM_START,
            f"rl.mode={mode}",
            f"kv.policy={policy}",
            f"train.seed={seed}",
            *extra,
        ]
        return self.train(name, overrides)

    def warm_start(self, policy: str | None = None, warm: int = 0) -> Run:
        """Warm start `warm` itself as a zero-iteration run (to evaluate it like any other model;
        its evaluation seed is train.seed + 1 with train.seed = warm)."""
        policy = policy or self.base.kv.policy
        return self.arm(
            "warm_start" if warm == 0 else f"warm_start{warm}",
            mode="dense",
            policy=policy,
            seed=warm,
            extra=["train.iterations=0"],
            warm=warm,
        )

    def train_all(self, specs: Sequence[dict], evals: Sequence[tuple[dict, int]] = ()) -> None:
        """Train what `study.arm(**spec)` would for every spec (warm starts first), in parallel
        single-core processes (one per available core; workers.py), and evaluate each final model
        under every (kv overrides, prompts) of `evals` there: later `arm` / `evaluate` calls read
        the cache. A spec {"warm_start": k} trains warm start k and evaluates it."""
        warms = sorted(
            {int(s.get("warm", 0)) for s in specs if "warm_start" not in s}
            | {int(s["warm_start"]) for s in specs if "warm_start" in s}
        )
        jobs = [{"warm_start": w} for w in warms] + [dict(s) for s in specs if "warm_start" not in s]
        args = (
            self.config,
            self.overrides,
            self.runs_dir,
            self.base.kv.policy,
            [[dict(kv), int(n)] for kv, n in evals],
        )
        workers.parallel_map(_train_job, [(*args, job) for job in jobs], self.cores)

    def train_runs(
        self, runs: Sequence[tuple[str, Sequence[str]]], evals: Sequence[tuple[dict, int]] = (), progress: bool = False
    ) -> list[Run]:
        """Train (or resume, or reuse) each (name, overrides) of the base config, no warm start
        involved, in parallel single-core processes (workers.py), evaluating each final model under
        every (kv overrides, prompts) of `evals` there; returns the runs, read here from the cache.
        `progress`: the workers print each iteration (long runs)."""
        jobs = [
            (
                self.config,
                self.overrides,
                self.runs_dir,
                name,
                [*o, f"train.progress={str(progress).lower()}"],
                [[dict(kv), int(n)] for kv, n in evals],
            )
            for name, o in runs
        ]
        workers.parallel_map(_run_job, jobs, self.cores)
        return [self.train(name, o) for name, o in runs]


def _run_job(job) -> str:
    """Worker of Study.train_runs: one run of the base config, trained and evaluated."""
    config, overrides, runs_dir, name, run_overrides, evals = job
    run = Study(config, overrides, runs_dir).train(name, run_overrides)
    _evaluate_and_release(run, evals)
    return run.out_dir


def _train_job(job) -> None:
    """Worker of Study.train_all: one warm start or one arm, trained and evaluated."""
    config, overrides, runs_dir, policy, evals, spec = job
    study = Study(config, overrides, runs_dir)
    if "warm_start" in spec:
        run = study.warm_start(policy, warm=spec["warm_start"])
    else:
        run = study.arm(**spec)
    _evaluate_and_release(run, evals)


def _evaluate_and_release(run: Run, evals) -> None:
    """A worker's evaluations of its run (cached in the run directory), then the trainer freed."""
    for kv, n in evals:
        run.evaluate(kv, n)
    run._trainer = None


# ----------------------------------------------------------------------------- numbers of a run


def summarize(run: Run) -> dict:
    """The training-time numbers every table quotes, and the reward rule's collapse iteration."""
    return summarize_history(run.history)


def summarize_history(h: list[dict]) -> dict:
    """summarize's numbers from a run's per-iteration metrics alone (e.g. a committed record)."""
    return {
        "train_reward_last25": last_quarter(h, "reward/mean"),
        "train_kv_saving": run_mean(h, "kv/saving"),
        "train_kv_saving_last25": last_quarter(h, "kv/saving"),
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
    return {
        "dense_acc": run.evaluate({"policy": "none"}, n=n)["accuracy"],
        "sparse_acc": sparse["accuracy"],
        "sparse_kv_saving": sparse["kv_saving"],
        **summarize(run),
    }


def accuracies(runs: Sequence[Run], kv_overrides: dict, n: int | None = None) -> list[float]:
    """Each run's final accuracy under its KV settings with `kv_overrides` applied (Run.evaluate,
    cached), on `n` held-out prompts: one number per seed."""
    return [r.evaluate(kv_overrides, n=n)["accuracy"] for r in runs]


def warm_rows(study: Study, warms: Sequence[int], n: int, policy: str | None = None) -> dict:
    """{warm start: its dense and sparse (`policy`, default the base config's) accuracy}."""
    policy = policy or study.base.kv.policy
    out = {}
    for w in warms:
        run = study.warm_start(policy, warm=w)
        sparse = run.evaluate({"policy": policy}, n=n)
        out[w] = {
            "dense_acc": run.evaluate({"policy": "none"}, n=n)["accuracy"],
            "sparse_acc": sparse["accuracy"],
            "sparse_kv_saving": sparse["kv_saving"],
        }
    return out


def run_variants(
    study: Study,
    names: Sequence[str],
    seeds: Sequence[int],
    arm_of: Callable[[str], tuple[str, str, Sequence[str]]],
    score: Callable[[Run], dict],
    evals: Sequence[tuple[dict, int]] = (),
    warms: Sequence[int] = (0,),
) -> tuple[dict, dict]:
    """Train (or reuse) every variant x warm start x seed; `arm_of(name)` gives its (rl.mode,
    kv.policy, extra overrides), `evals` the evaluations the workers run. Returns results[name] =
    [score(run) + its warm_start and seed, per run] and histories[name]."""
    arms = {name: arm_of(name) for name in names}
    units = [(w, s) for w in warms for s in seeds]

    def spec(n, w, s):
        return dict(
            name=f"{n}/seed{s}" if w == 0 else f"{n}/w{w}/seed{s}",
            mode=arms[n][0],
            policy=arms[n][1],
            seed=s,
            extra=list(arms[n][2]),
            warm=w,
        )

    study.train_all([spec(n, w, s) for n in names for w, s in units], evals)
    results, histories = {}, {}
    for name in names:
        runs = [(w, s, study.arm(**spec(name, w, s))) for w, s in units]
        histories[name] = [r.history for _, _, r in runs]
        results[name] = [{**score(r), "warm_start": w, "seed": s} for w, s, r in runs]
    return results, histories
