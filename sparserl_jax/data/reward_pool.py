"""The rewards of a batch of responses at the speed of the rollout: each response checked by the
reward its row's data_source names (rewards.SOURCE_REWARDS) or the run's own, serially or in a pool
of worker processes, each check under a wall-clock limit.

Serial (data.reward_pool.workers=0, the default) calls each reward in this process as the learner
always has: only a reward's own limit applies (math's symbolic check, timeout_s). The pool, kept
for the run, runs every check in a worker under `timeout_s` whatever the reward: SIGALRM in the
worker interrupts a check in Python code (a hung sympy simplification), and a check still running
max(GRACE_S, timeout_s) later (stuck in C code, where signals wait) has the pool's workers killed;
a fresh pool, started at once, checks the rows left. A check past its limit scores 0 and is
counted (reward/timeouts), as is one whose worker died twice under it (out of memory, a crash).
Workers start by forkserver (spawn where there is none): fork would copy the learner's process
with JAX's threads mid-flight.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing
import os
import signal
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ALL_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from sparserl_jax.data import rewards
from sparserl_jax.data.rewards import SOURCE_REWARDS, RewardFn, get_timed_reward
from sparserl_jax.validate import check_at_least, check_bool, check_positive

log = logging.getLogger(__name__)

GRACE_S = 1.0  # past timeout_s + this (or + timeout_s, whichever is more) a check's worker is killed
POLL_S = 0.05  # how often the pool's hung checks are looked for
CHUNKS_PER_WORKER = 4  # a batch's checks go out in about this many chunks per worker (fewer round trips)
MAX_CHUNK = 32


@dataclasses.dataclass(frozen=True)
class RewardPoolConfig:
    """data.reward_pool: `workers` processes check the rewards (0: serially in the learner's own
    process, as before); every check of the pool runs under `timeout_s` seconds, and math's
    symbolic check under it in either mode. `by_source`: a row's data_source picks its reward
    (rewards.SOURCE_REWARDS); false, or a data_source not listed there: data.reward (or the task's)."""

    workers: int = 0
    timeout_s: float = rewards.DEFAULT_TIMEOUT_S
    by_source: bool = True

    def __post_init__(self):
        check_at_least("data.reward_pool.workers", self.workers, 0)
        check_positive("data.reward_pool.timeout_s", self.timeout_s)
        check_bool("data.reward_pool.by_source", self.by_source)


def chunks(n: int, workers: int) -> list[range]:
    """Rows 0..n-1 in consecutive chunks, about CHUNKS_PER_WORKER per worker, at most MAX_CHUNK rows each."""
    size = max(1, min(MAX_CHUNK, math.ceil(n / max(1, workers * CHUNKS_PER_WORKER))))
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


class _Timeout(BaseException):
    """SIGALRM in a worker's check; BaseException so that a reward's `except Exception` lets it through."""


def _alarm(signum, frame):
    raise _Timeout()


def timed_check(fn: RewardFn, response: str, label: str, timeout_s: float) -> tuple[float, bool]:
    """(reward, timed out) of one check on this process's main thread, interrupted by SIGALRM after
    timeout_s (0.0 then). A reward's own limit (math's) nests inside and counts as timed out too."""
    before, timed_out = rewards.timeouts(), False
    previous = signal.signal(signal.SIGALRM, _alarm)
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            value = float(fn(response, label))
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Timeout:  # also when the alarm came as the check returned: at its limit either way
        value, timed_out = 0.0, True
    finally:
        signal.signal(signal.SIGALRM, previous)
    return value, timed_out or rewards.timeouts() != before


# ----------------------------------------------------------------------------- the worker side

_SLOT: tuple | None = None  # in a worker: (row being checked per worker, its start time, this worker's index)


def _init_worker(rows, started, pids, counter, warm) -> None:
    global _SLOT
    with counter.get_lock():
        index = counter.value
        counter.value += 1
    pids[index] = os.getpid()
    _SLOT = (rows, started, index)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the learner's to handle
    rewards.warm_up()  # before any check's clock starts
    with warm.get_lock():
        warm.value += 1


def _check_chunk(items: list[tuple[int, RewardFn, str, str]], timeout_s: float) -> list[tuple[float, bool]]:
    """A worker's checks of (row, reward, response, label), each under timeout_s; the row being
    checked and its start are written where the parent sees them (the start first)."""
    rows, started, index = _SLOT
    out = []
    try:
        for row, fn, response, label in items:
            started[index] = time.monotonic()
            rows[index] = row
            out.append(timed_check(fn, response, label, timeout_s))
    finally:
        rows[index] = -1
    return out


# ----------------------------------------------------------------------------- the checker


class _Pool:
    """A process pool with the shared table of each worker's current row, start time and pid."""

    def __init__(self, workers: int):
        methods = multiprocessing.get_all_start_methods()
        ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
        self.rows = ctx.Array("q", [-1] * workers)
        self.started = ctx.Array("d", workers)
        self.pids = ctx.Array("q", workers)
        self.warm = ctx.Value("i", 0)  # workers that have loaded sympy and math-verify
        initargs = (self.rows, self.started, self.pids, ctx.Value("i", 0), self.warm)
        self.executor = ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=initargs)
        for _ in range(workers):  # start every worker now: they warm up while the run goes on
            self.executor.submit(int)

    def hung(self, limit_s: float) -> list[int]:
        """Rows whose check has run longer than limit_s (the row is read before its start time, which
        a worker writes first: a row read with a later check's start is never called hung)."""
        now, out = time.monotonic(), []
        for k in range(len(self.rows)):
            row = self.rows[k]
            if row >= 0 and now - self.started[k] > limit_s:
                out.append(row)
        return out

    def close(self, *, kill: bool = False) -> None:
        """Shuts the pool down; `kill`: its (live, hung) workers are killed first."""
        if kill:
            for pid in (p for p in self.pids[:] if p > 0):  # 0: a worker never started (os.kill(0) is the group)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.executor.shutdown(wait=True, cancel_futures=True)


class RewardChecker:
    """Rewards of many (response, label, data_source) rows: `check` returns rewards [N] float32 and
    which checks ran past their limit [N] bool. `reward` checks the rows no data_source claims.
    With cfg.workers > 0 the pool starts here (its workers load sympy meanwhile) and is kept until
    `close` (or this object is collected)."""

    def __init__(self, reward: RewardFn, cfg: RewardPoolConfig | None = None):
        self.default, self.cfg = reward, RewardPoolConfig() if cfg is None else cfg
        self._by_name: dict[str, RewardFn] = {}
        self._pool: _Pool | None = None
        if self.cfg.workers:
            self._start()

    def reward_for(self, data_source: str | None) -> RewardFn:
        """The reward of a row of `data_source` (rewards.SOURCE_REWARDS when cfg.by_source), else the default."""
        name = SOURCE_REWARDS.get(data_source) if self.cfg.by_source and data_source else None
        if name is None:
            return self.default
        if name not in self._by_name:
            self._by_name[name] = get_timed_reward(name, self.cfg.timeout_s)
        return self._by_name[name]

    def check(
        self, responses: Sequence[str], labels: Sequence[str], data_sources: Sequence[str | None] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        if len(labels) != len(responses) or (data_sources is not None and len(data_sources) != len(responses)):
            raise ValueError(
                f"reward check: {len(responses)} responses, {len(labels)} labels and "
                f"{'no' if data_sources is None else len(data_sources)} data_sources must be as many"
            )
        fns = [self.reward_for(d) for d in (data_sources or [None] * len(responses))]
        if not self.cfg.workers:
            out = []
            for fn, response, label in zip(fns, responses, labels):
                before = rewards.timeouts()
                out.append((fn(response, label), rewards.timeouts() != before))
        else:
            out = self._pooled(fns, responses, labels)
        values = np.array([v for v, _ in out], np.float32).reshape(-1)
        return values, np.array([t for _, t in out], bool).reshape(-1)

    # ------------------------------------------------------------------ the pool

    def _start(self) -> None:
        self._pool = _Pool(self.cfg.workers)
        self._finalizer = weakref.finalize(self, self._pool.close)

    @property
    def worker_pids(self) -> list[int]:
        """The pool's worker processes (none when serial or not started): for measurements."""
        return [] if self._pool is None else [p for p in self._pool.pids[:] if p > 0]

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        """Returns once every worker of the pool has started and warmed up (a no-op when serial):
        for measurements that must not count the start."""
        end = time.monotonic() + timeout_s
        while self._pool is not None and self._pool.warm.value < self.cfg.workers:
            if time.monotonic() > end:
                raise TimeoutError(f"data.reward_pool.workers={self.cfg.workers}: not ready after {timeout_s:g}s")
            time.sleep(POLL_S)

    def _pooled(self, fns, responses, labels) -> list[tuple[float, bool]]:
        out: list[tuple[float, bool] | None] = [None] * len(responses)
        todo, strikes = list(range(len(responses))), {}
        while todo:
            left, started = self._round(todo, fns, responses, labels, out, strikes)
            if len(left) == len(todo) and not started:  # the pool died before it checked a row
                raise RuntimeError(
                    f"data.reward_pool.workers={self.cfg.workers}: the reward pool's workers died before "
                    "checking a row; see their error above, or check serially with data.reward_pool.workers=0"
                )
            todo = left
        return out

    def _round(self, todo: list[int], fns, responses, labels, out, strikes: dict[int, int]) -> tuple[list[int], bool]:
        """Checks the rows `todo` on the pool (started if need be). When a hung check or a dead
        worker takes the pool down: the rows left unchecked (for a fresh pool) and whether any row
        was being checked then. A hung row scores 0 at once; a row being checked when a worker died
        (any worker: the pool's others go down with it) is checked again, and scores 0 the second time."""
        if self._pool is None:
            self._start()
        pool, limit = self._pool, self.cfg.timeout_s
        futures = {}
        for part in chunks(len(todo), self.cfg.workers):
            rows = [todo[i] for i in part]
            items = [(r, fns[r], responses[r], labels[r]) for r in rows]
            futures[pool.executor.submit(_check_chunk, items, limit)] = rows
        pending, lost = set(futures), []
        while pending:
            done, pending = wait(pending, timeout=POLL_S, return_when=ALL_COMPLETED)
            for f in done:
                try:
                    out_rows = f.result()
                except BrokenProcessPool:
                    lost.append(f)
                    continue
                for r, result in zip(futures[f], out_rows):
                    out[r] = result
            hung = pool.hung(limit + max(GRACE_S, limit))
            if hung or lost:
                running = hung or pool.hung(0.0)
                for r in running:
                    strikes[r] = strikes.get(r, 0) + (2 if hung else 1)
                failed = [r for r in running if strikes[r] >= 2]
                for r in failed:  # scored 0, counted
                    out[r] = (0.0, True)
                log.warning(
                    "reward pool went down (%s, rows being checked: %s); rows scored 0: %s; restarting it",
                    f"a check ran past {limit:g}s + grace" if hung else "a worker died",
                    running,
                    failed,
                )
                self._finalizer.detach()
                pool.close(kill=bool(hung))  # a dead worker's pool has no live worker left
                self._start()  # the next pool warms up at once, for the rows left or the next batch
                return [r for f in (*pending, *lost) for r in futures[f] if out[r] is None], bool(running)
        return [], True

    def close(self) -> None:
        """Shuts the pool down (its workers exit); a later check starts a fresh one."""
        if self._pool is not None:
            self._finalizer.detach()
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RewardChecker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
