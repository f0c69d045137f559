"""Experiment runs as single-core processes, so that their numbers do not depend on the machine.

XLA's CPU runtime sizes its thread pool by the cores the process may use and splits matmuls and
reductions over those threads, so the same run on 1 and on 2 cores differs in the last float bits
from the first step on, and a tiny RL run amplifies that into different results. (XLA_FLAGS
`--xla_cpu_multi_thread_eigen=false` does not change this on jax 0.10: measured.) Pinning a
process to one core before its first JAX computation makes the thread pool the same everywhere;
independent runs then go to parallel processes, one per available core, so a command gives the
same numbers on 1, 2 or 16 cores (tests/test_reliability.py checks 1 vs 2 cores under taskset).

This module imports no JAX: pinning must happen before the CPU backend starts.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, e.g. under taskset), in order."""
    return sorted(os.sched_getaffinity(0))


def _backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - layout of a future jax
        return True
    return bool(getattr(xla_bridge, "_backends", {1: None}))


def pin_to_one_core(core: int | None = None) -> bool:
    """Restrict this process to one core (the first available one unless `core` is given) before
    JAX starts its CPU backend. Returns False, changing nothing, when the backend already runs
    (e.g. inside a test session): pinning then would slow the process without making it
    deterministic."""
    if _backend_started():
        return False
    os.sched_setaffinity(0, {available_cores()[0] if core is None else core})
    return True


def _init_worker(cores) -> None:
    pin_to_one_core(cores.get())


def parallel_map(fn: Callable[[T], R], items: Iterable[T], cores: list[int] | None = None) -> list[R]:
    """[fn(item) for item in items], each call in a fresh single-core process (spawned, so no JAX
    state is inherited), one process per available core; results in the order of `items`. `fn`
    must be a module-level function and its items and results picklable.

    In a process whose JAX backend already runs (a test session), the calls run here, one after
    the other: that process cannot be made core-count independent anyway, and it saves each
    worker's start-up and compilation."""
    items = list(items)
    if _backend_started():
        return [fn(item) for item in items]
    if not items:
        return []
    cores = available_cores() if cores is None else list(cores)
    n = min(len(items), len(cores))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    for c in cores[:n]:
        queue.put(c)
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as pool:
        return list(pool.map(fn, items))
