"""How the process's malloc serves XLA:CPU's buffers (train.host_memory).

XLA:CPU takes every program call's outputs and temporaries from glibc's malloc, which serves a
block over its mmap threshold with a fresh mapping and unmaps it when freed: every call then pays
one page fault per 4 KiB of them, and the kernel zeroes each page (a [512, 49,152] float32 result:
24,577 faults a call; the learner's micro-batch step of SmolLM2-135M: about 570,000). "reuse" keeps
freed memory in the process for the next call (one arena for every thread, no mmap, no trim), so
after the first iteration the blocks are already mapped; it changes no number. The price is
memory: freed blocks stay in the process, and a block one alignment pad short of the next request
leaves a hole (the real model's learner step: 0.87x the time, 1.20x the largest resident set;
experiments/results/bench_host_memory.md). It has to be set before JAX's backend starts (the
backend's threads take their arenas then).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.metadata
import importlib.util
import os
import sys

from sparserl_jax.validate import check_in

HOST_MEMORY = ("auto", "reuse", "system")  # auto: reuse where the CPU is JAX's platform
# glibc's mallopt parameters (malloc.h) and the values "reuse" sets
M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
REUSE = ((M_ARENA_MAX, 1), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1))
ACCELERATOR_MODULES = ("libtpu",)  # found without a jax_plugins entry point (jax's own TPU lookup)
_applied: list[str] = []  # what configure did in this process, once it acted


def backend_started() -> bool:
    """Whether this process's JAX backend has started (jax.devices() or a first array)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - layout of a future jax
        return True
    return bool(getattr(xla_bridge, "_backends", {1: None}))


def cpu_platform(platforms: str | None = None) -> bool:
    """Whether JAX will run on the CPU, read without starting its backend: the first entry of
    `platforms` (None: jax_platforms, else $JAX_PLATFORMS) where one is named, else whether no
    accelerator plugin is installed (a jax_plugins entry point or module, or libtpu)."""
    if platforms is None:
        platforms = os.environ.get("JAX_PLATFORMS", "")
        if "jax" in sys.modules:
            platforms = sys.modules["jax"].config.jax_platforms or platforms
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not accelerator_plugins()


def accelerator_plugins() -> list[str]:
    """The accelerator plugins JAX would find here: jax_plugins entry points, the jax_plugins
    namespace package, libtpu."""
    found = [e.name for e in importlib.metadata.entry_points(group="jax_plugins")]
    found += [m for m in ("jax_plugins", *ACCELERATOR_MODULES) if importlib.util.find_spec(m) is not None]
    return found


def _glibc():
    """This process's glibc (None elsewhere: musl, macOS, Windows)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
        return libc
    except (OSError, AttributeError):
        return None


def configure(setting: str) -> str:
    """Apply train.host_memory (HOST_MEMORY) to this process, before JAX's backend starts, and
    return what it did in a sentence (for the run's log). "reuse" where it cannot act (the backend
    already started, no glibc) is an error; "auto" then leaves malloc alone and says why."""
    check_in("train.host_memory", setting, HOST_MEMORY)
    if _applied:  # for the process's life
        return _applied[0] if setting != "system" else f"{_applied[0]}; system came too late to undo it"
    if setting == "system":
        return "system: glibc's defaults"
    if setting == "auto" and not cpu_platform():
        return "system (auto: JAX's platform is not the CPU)"
    why = None
    if backend_started():
        why = "JAX's backend has already started (its threads hold their arenas)"
    libc = _glibc() if why is None else None
    if why is None and libc is None:
        why = "this process's C library is not glibc"
    if why is not None:
        if setting == "reuse":
            raise ValueError(f"train.host_memory=reuse cannot act: {why}; use auto or system")
        return f"system (auto: {why})"
    failed = [param for param, value in REUSE if libc.mallopt(param, value) != 1]
    if failed:
        raise RuntimeError(f"train.host_memory={setting}: glibc's mallopt refused parameters {failed}")
    _applied.append(
        f"reuse ({setting}): freed buffers stay mapped for the next program call (one arena, no mmap, no trim)"
    )
    return _applied[0]


def add_host_memory_arg(p: argparse.ArgumentParser) -> None:
    """--host-memory for the commands without a run config (generate, evaluate): train.host_memory's
    values, applied by the command before JAX's backend starts."""
    p.add_argument(
        "--host-memory",
        choices=HOST_MEMORY,
        default="auto",
        help="how malloc serves XLA:CPU's buffers, as train.host_memory (auto: reuse on the CPU)",
    )
