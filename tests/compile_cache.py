"""A persistent JAX compilation cache for tests that compile the same programs again: Python
subprocesses (training runs killed and resumed, the fingerprint under two flag sets) and, inside
a test module, trainers built afresh for every arm of a study (their jitted closures are new
objects, so jit's own cache misses, while their programs are mostly the same). The first compile
writes the executable to disk; the next identical program loads it (a smoke training process:
about 20 s of CPU cold, 5 s warm).

One directory per test session, shared by the xdist workers. JAX keys an entry by the program,
the XLA flags and the jax version, so a process with other flags compiles for itself; entries
are only ever written and read on this machine. Not for a process that emulates another CPU
(the cache does not key on the host's instruction set) nor around tests that count their own
compilations (jax.monitoring's backend_compile events: a cache hit compiles nothing).
"""

from __future__ import annotations

import contextlib
import os


def _directory(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base  # xdist: one per worker
    cache = root / "jax_compilation_cache"
    cache.mkdir(exist_ok=True)
    return cache


def compile_cache_env(tmp_path_factory, env: dict | None = None) -> dict:
    """`env` (default: this process's environment) with the session's compilation cache on."""
    return {
        **(os.environ if env is None else env),
        "JAX_COMPILATION_CACHE_DIR": str(_directory(tmp_path_factory)),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


@contextlib.contextmanager
def compile_cache_in_process(tmp_path_factory):
    """The session's compilation cache in this process for the duration of the block, then off
    again (the tests after it compile for themselves)."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    saved = {
        name: getattr(jax.config, name)
        for name in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")
    }
    compilation_cache.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(_directory(tmp_path_factory)))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    try:
        yield
    finally:
        for name, value in saved.items():
            jax.config.update(name, value)
        compilation_cache.reset_cache()
