"""A persistent JAX compilation cache for the tests' Python subprocesses that compile the same
programs as one another (training runs killed and resumed, one- and two-process runs, the
fingerprint under two flag sets): the first process compiles, the next ones load the executable
from disk (a smoke training process: about 20 s of CPU cold, 5 s warm).

One directory per test session, shared by the xdist workers. JAX keys an entry by the program,
the XLA flags and the jax version, so a process with other flags compiles for itself; entries
are only ever written and read on this machine. Not for a process that emulates another CPU
(the cache does not key on the host's instruction set) or that counts its own compilations.
"""

from __future__ import annotations

import os


def compile_cache_env(tmp_path_factory, env: dict | None = None) -> dict:
    """`env` (default: this process's environment) with the session's compilation cache on."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base  # xdist: one per worker
    cache = root / "jax_compilation_cache"
    cache.mkdir(exist_ok=True)
    return {**(os.environ if env is None else env), "JAX_COMPILATION_CACHE_DIR": str(cache),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}
