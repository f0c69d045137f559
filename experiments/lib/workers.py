"""Experiment runs as single-core processes with portable CPU numerics, so that their numbers do
not depend on the machine.

Two things make XLA's CPU results machine-dependent, and a tiny RL run amplifies last-bit
differences into different results (an eviction decision flips, then the whole trajectory):

1. Core count. XLA's CPU runtime sizes its thread pool by the cores the process may use and
   splits matmuls and reductions over those threads. (XLA_FLAGS `--xla_cpu_multi_thread_eigen=false`
   does not change this on jax 0.10: measured.) Pinning a process to one core before its first JAX
   computation makes the thread pool the same everywhere; independent runs go to parallel
   processes, one per available core (tests/test_reliability.py checks 1 vs 2 cores under taskset).
2. The CPU's instruction set, through code chosen at run time rather than compiled by XLA
   (measured on jax 0.10.2; experiments/results/default/reproducibility.md):
   - YNNPACK fusions (dots, reductions; on by default) dispatch on the CPU's own features and run
     AVX-512 kernels where the CPU has them; `--xla_cpu_max_isa` does not reach them;
   - the dots XLA leaves to Eigen run oneDNN's sgemm, JIT-compiled for the CPU's ISA;
   - "platform-dependent math" lets XLA emit approximate instructions (rsqrt), whose bits differ
     between CPU generations and vendors;
   - LLVM compiles XLA's own fusions for the host's features.
   PORTABLE_CPU_ENV turns YNNPACK fusions and platform-dependent math off and caps XLA's LLVM code
   and oneDNN at AVX2, so every x86-64 CPU with AVX2 and FMA runs the same instructions: a Zen 5
   with AVX-512 gives bit for bit what an emulated EPYC Rome (Zen 2) or Haswell gives
   (tests/test_portable_cpu.py, under qemu-user). Set SPARSERL_PORTABLE_CPU=0 to keep the host's
   fastest code (and machine-dependent numbers).

This module imports no JAX: both must be set before the CPU backend starts.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from typing import TypeVar

from sparserl_jax import host_memory  # imports no JAX

T = TypeVar("T")
R = TypeVar("R")


# XLA_FLAGS and the environment variables that make CPU numerics the same on every AVX2 machine.
PORTABLE_XLA_FLAGS = (
    "--xla_cpu_experimental_ynn_fusion_type=",  # no YNNPACK fusions (runtime ISA dispatch)
    "--xla_cpu_enable_platform_dependent_math=false",  # no approximate rsqrt & co.
    "--xla_cpu_max_isa=AVX2",  # LLVM-compiled fusions: the same vector code on AVX2 and AVX-512
)
PORTABLE_CPU_ENV = {"ONEDNN_MAX_CPU_ISA": "AVX2"}  # Eigen's oneDNN sgemm: AVX2 kernels everywhere


def portable_cpu_enabled() -> bool:
    return os.environ.get("SPARSERL_PORTABLE_CPU", "1") not in ("0", "false", "no")


def set_portable_cpu_env(environ=os.environ) -> bool:
    """Add PORTABLE_XLA_FLAGS to XLA_FLAGS (flags the user set already win) and set
    PORTABLE_CPU_ENV in `environ`, unless SPARSERL_PORTABLE_CPU=0. Must run before JAX starts its
    CPU backend (a child process inherits it). Returns whether the settings are on."""
    if not portable_cpu_enabled():
        return False
    flags = environ.get("XLA_FLAGS", "").split()
    given = {f.split("=", 1)[0] for f in flags}
    flags += [f for f in PORTABLE_XLA_FLAGS if f.split("=", 1)[0] not in given]
    environ["XLA_FLAGS"] = " ".join(flags)
    for name, value in PORTABLE_CPU_ENV.items():
        environ.setdefault(name, value)
    return True


def available_cores() -> list[int]:
    """The cores this process may run on (its affinity mask, e.g. under taskset), in order."""
    return sorted(os.sched_getaffinity(0))


# Compiled programs persist here across processes (JAX's compilation cache): the parallel runs of
# a study compile each program once, later runs load it. Keyed by the program, jax version and
# XLA flags, so it changes no number; JAX_COMPILATION_CACHE_DIR set by the user wins.
COMPILE_CACHE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "runs", "compile_cache"
)


def use_compile_cache(environ=os.environ) -> None:
    """Point JAX's persistent compilation cache at COMPILE_CACHE (unless one is set) before JAX
    starts (a child process inherits it)."""
    environ.setdefault("JAX_COMPILATION_CACHE_DIR", COMPILE_CACHE)


def pin_to_one_core(core: int | None = None) -> bool:
    """Restrict this process to one core (the first available one unless `core` is given), set
    the portable CPU numerics (set_portable_cpu_env) and the shared compilation cache
    (use_compile_cache) before JAX starts its CPU backend. Returns False, changing nothing, when
    the backend already runs (e.g. inside a test session): pinning then would slow the process
    without making it deterministic."""
    if host_memory.backend_started():
        return False
    set_portable_cpu_env()
    use_compile_cache()
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
    if host_memory.backend_started():
        return [fn(item) for item in items]
    if not items:
        return []
    cores = available_cores() if cores is None else list(cores)
    n = min(len(items), len(cores))
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    for c in cores[:n]:
        queue.put(c)
    # two malloc arenas a process: XLA's CPU buffers come and go through glibc's malloc, whose
    # per-thread arenas otherwise hold gigabytes of freed memory in parallel real-model runs
    with (
        env_defaults(MALLOC_ARENA_MAX="2"),
        ProcessPoolExecutor(n, mp_context=ctx, initializer=_init_worker, initargs=(queue,)) as pool,
    ):
        return list(pool.map(fn, items))


@contextlib.contextmanager
def env_defaults(**values: str):
    """Environment variables for the processes started inside the block (those already set keep
    their values), then the environment as it was: a caller's process, a test's included, keeps
    nothing of them."""
    before = dict(os.environ)
    for name, value in values.items():
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        for name in values:
            if name in before:
                os.environ[name] = before[name]
            else:
                os.environ.pop(name, None)
