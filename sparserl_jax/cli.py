"""The shared shell of the command-line entry points (train, evaluate, generate, dryrun): one-line
errors, and the persistent compilation cache a command turns on at its start."""

from __future__ import annotations

import hashlib
import os
import platform
import sys
from collections.abc import Callable

# train.compile_cache's default: compiled programs persist here across runs (JAX keys an entry by
# the program, the device kind, the XLA flags and the jax version, so a hit changes no number)
DEFAULT_COMPILE_CACHE = "~/.cache/sparserl_jax/xla"
# a folder that replaces the command's setting ("" turns the cache off): the test suite sets it
# (tests/conftest.py) so that no test writes to a user's home
COMPILE_CACHE_ENV = "SPARSERL_COMPILE_CACHE"
# programs that compile faster than this are not written (JAX's default is 1 s; the learner's
# programs of a real model take tens of seconds, a tiny model's smoke run's ~0.1-1 s each)
MIN_COMPILE_SECS = 0.2


class RunFailed(RuntimeError):
    """A run that cannot go on (diverged training, non-finite outputs): one line, exit status 1."""


def run(main: Callable[[], object]) -> None:
    """Run `main`; a bad setting or a missing file (ValueError, FileNotFoundError, whose messages
    name the setting or path) becomes a one-line error and exit status 2 instead of a traceback,
    a RunFailed one line and exit status 1."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)


def compile_cache_folder(setting: str | None, platform_name: str) -> str | None:
    """The folder a command's programs are cached in: $SPARSERL_COMPILE_CACHE when it is set, else
    `setting` (train.compile_cache); None when that is "" or None (off). `~` is the user's home.
    On the CPU backend, a subfolder per instruction set: JAX does not key a CPU entry on the host's
    (a home shared by machines of two CPU generations would load code one cannot run)."""
    folder = os.environ.get(COMPILE_CACHE_ENV, setting)
    if not folder:
        return None
    folder = os.path.expanduser(folder)
    return os.path.join(folder, f"cpu-{host_isa()}") if platform_name == "cpu" else folder


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str]:
    """The first processor's instruction-set flags in `cpuinfo` (x86 "flags", Arm "Features");
    [] where there is no such file or line."""
    try:
        with open(cpuinfo) as f:
            return next((line.split(":", 1)[1].split() for line in f if line.startswith(("flags", "Features"))), [])
    except OSError:
        return []


def host_isa() -> str:
    """12 hex digits naming this CPU's instruction set (its flags in /proc/cpuinfo; the machine
    and processor names where there is none)."""
    text = " ".join(sorted(cpu_flags())) or f"{platform.machine()} {platform.processor()}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def use_compile_cache(setting: str | None) -> str | None:
    """Turn on JAX's persistent compilation cache in `compile_cache_folder(setting)`, once at a
    command's start, and return the folder (None: off). A folder JAX's own configuration already
    names (JAX_COMPILATION_CACHE_DIR, or a caller's jax.config) is kept and returned: a study's
    workers and the test suite's processes share theirs. Entries are never evicted: delete the
    folder to reclaim its space."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    if jax.config.jax_compilation_cache_dir:
        return jax.config.jax_compilation_cache_dir
    folder = compile_cache_folder(setting, jax.default_backend())
    if folder is None:
        return None
    compilation_cache.reset_cache()  # JAX reads the folder at its first compile: read it again
    jax.config.update("jax_compilation_cache_dir", folder)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    return folder
