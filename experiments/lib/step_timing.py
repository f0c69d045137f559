"""Wall and compile time of each training step, measured the same way for every arm (the batch
scheduler and SortedRL alike), for the SortedRL benchmarks (profile_sorted, fig_sortedrl,
bench_sorted).

Inside `timed_steps()` each Trainer.step of this process adds to its metrics
  time/step_s              the step's wall time (rollout, rewards, scoring, update, diagnostics),
  time/compile_s           the compile time inside the step (sparserl_jax.compile_clock: tracing,
                           lowering and XLA compilation, each second counted once),
  time/rollout_wall_s      the rollout source's wall time (its `next`: what time/rollout_s times),
  time/rollout_compile_s   the compile time inside it,
  compile/count            the XLA compilations inside the step.
`timed_workers()` does the same in the processes figlib's Study.train_all trains its runs in.
`account()` turns a run's history into the fair numbers: the whole run's wall time with compile
(every arm compiles once: included the same way) and without it, and the steady state (the update
batches after the first group) per update batch with compile time excluded.
"""

from __future__ import annotations

import contextlib
import functools
import time

from sparserl_jax import compile_clock
from sparserl_jax.rollout import source as sources
from sparserl_jax.train import Trainer

KEYS = ("time/step_s", "time/compile_s", "time/rollout_wall_s", "time/rollout_compile_s", "compile/count")


def _timed_step(step):
    @functools.wraps(step)
    def timed(self, *args, **kwargs):
        since, tic = compile_clock.Since(), time.perf_counter()
        metrics = step(self, *args, **kwargs)
        metrics["time/step_s"] = time.perf_counter() - tic
        metrics["time/compile_s"] = since.seconds
        metrics["compile/count"] = float(since.compiles)
        metrics.update(getattr(self.source, "_timing", {}))
        return metrics

    return timed


def _timed_next(next_):
    @functools.wraps(next_)
    def timed(self, *args, **kwargs):
        since, tic = compile_clock.Since(), time.perf_counter()
        batch = next_(self, *args, **kwargs)
        self._timing = {"time/rollout_wall_s": time.perf_counter() - tic, "time/rollout_compile_s": since.seconds}
        return batch

    return timed


@contextlib.contextmanager
def timed_steps():
    """Time every Trainer.step (and its rollout) of this process while inside (module doc)."""
    compile_clock.install()
    classes = [c for c in set(sources.SOURCES.values()) if "next" in vars(c)]
    saved = [(Trainer, "step", Trainer.step)] + [(c, "next", vars(c)["next"]) for c in classes]
    Trainer.step = _timed_step(Trainer.step)
    for c in classes:
        c.next = _timed_next(vars(c)["next"])
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def _in_timed_steps(fn, item):
    with timed_steps():
        return fn(item)


@contextlib.contextmanager
def timed_workers(figlib):
    """Run figlib's worker jobs (Study.train_all) inside timed_steps, in whatever process runs
    them (spawned workers, or this one inside a test session)."""
    workers = figlib.workers
    parallel_map = workers.parallel_map

    def timed_map(fn, items, cores=None):
        return parallel_map(functools.partial(_in_timed_steps, fn), items, cores)

    workers.parallel_map = timed_map
    try:
        yield
    finally:
        workers.parallel_map = parallel_map


def account(history: list[dict], batches_per_iteration: int, first_group_batches: int) -> dict:
    """The fair numbers of one run (module doc). `batches_per_iteration`: update batches an
    iteration trains (the batch arm: n; SortedRL: 1); the steady state leaves out the first
    `first_group_batches` update batches (the first group, which compiles), unless the run has
    no more."""
    missing = [k for k in KEYS if history and k not in history[0]]
    if missing:
        raise KeyError(
            f"the run's metrics lack {missing}: it was trained outside "
            "step_timing.timed_steps (delete the cached run to retrain it)"
        )
    if first_group_batches % batches_per_iteration:
        raise ValueError(
            f"the first group's {first_group_batches} update batches are not whole "
            f"iterations of {batches_per_iteration}"
        )
    skip = first_group_batches // batches_per_iteration
    steady = history[skip:] or history  # a run of one group (smoke runs): all of it
    tot = lambda k, rows=history: float(sum(r[k] for r in rows))  # noqa: E731
    steady_batches = max(len(steady) * batches_per_iteration, 1)
    return {
        "update_batches": len(history) * batches_per_iteration,
        "wall_s": tot("time/step_s"),  # compile included, as in every arm
        "compile_s": tot("time/compile_s"),
        "compiles": tot("compile/count"),
        "wall_s_no_compile": tot("time/step_s") - tot("time/compile_s"),
        "steady_update_batches": len(steady) * batches_per_iteration,
        "steady_compiles": tot("compile/count", steady),
        "steady_s_per_batch": (tot("time/step_s", steady) - tot("time/compile_s", steady)) / steady_batches,
        "steady_rollout_s_per_batch": (tot("time/rollout_wall_s", steady) - tot("time/rollout_compile_s", steady))
        / steady_batches,
    }
