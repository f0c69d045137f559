"""Provenance: what produced a result (the command with its pinning, the commit, the portable CPU
settings, the machine, jax, cores, wall time), recorded in every results.json and written as one
sentence under results.md's title; for results from before it was recorded, what git says.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Sequence

import workers  # imports no JAX
from figruns import REPO

# The commit that turned the portable CPU settings on (workers.py): results committed before it
# ran with the host's own numerics.
PORTABLE_SINCE = "de5812a"


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def command_line(cores: Sequence[int] | None = None) -> str:
    """This process's command as the docs write it, with the pinning it ran under: `taskset -c`
    when the command may use fewer cores than the machine has, SPARSERL_PORTABLE_CPU=0 when the
    portable CPU settings were off."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO) if sys.argv[0] else "?"
    prefix = [] if workers.portable_cpu_enabled() else ["SPARSERL_PORTABLE_CPU=0"]
    cores = list(workers.available_cores() if cores is None else cores)
    if len(cores) < (os.cpu_count() or len(cores)):
        prefix += ["taskset", "-c", ",".join(map(str, cores))]
    return " ".join([*prefix, "python", script, *sys.argv[1:]])


def cpu_model() -> str:
    """The CPU's model name, family and model, and whether it has AVX-512."""
    try:
        with open("/proc/cpuinfo") as f:
            info = dict(line.split(":", 1) for line in f.read().split("\n\n")[0].splitlines() if ":" in line)
    except OSError:
        return "?"
    info = {k.strip(): v.strip() for k, v in info.items()}
    avx512 = "avx512f" in info.get("flags", "").split()
    return (f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model "
            f"{info.get('model', '?')}, {'AVX-512' if avx512 else 'no AVX-512'})")


def provenance(cores: Sequence[int], seconds: float | None) -> dict:
    """What produced a result: commit (and whether the tree had uncommitted changes), the portable
    CPU settings (workers.py), the machine, the jax version, the cores and the wall time."""
    import jax

    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {"commit": _git("rev-parse", "--short=12", "HEAD"), "uncommitted_changes": bool(dirty),
            "portable_cpu": workers.portable_cpu_enabled(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "cpu": cpu_model(), "jax": jax.__version__, "python": sys.version.split()[0],
            "cores": len(cores), "wall_s": None if seconds is None else round(seconds, 1)}


def provenance_line(data: dict, results_json: str | None = None) -> str:
    """results.md's provenance sentence, from data['provenance'] (or, for results that did not
    record it, what git says of their results.json)."""
    p = data.get("provenance")
    if p and p.get("recorded") is False:  # results from before figlib recorded it: what git says
        numerics = ("the portable CPU numerics (their default since)" if p["portable_cpu"] else
                    "the host's own CPU numerics")
        return (f"Provenance: not recorded by the run; its numbers were committed in {p['results_commit']}, "
                f"{'after' if p['portable_cpu'] else 'before'} the portable CPU settings ({PORTABLE_SINCE}), "
                f"so it ran with {numerics}; machine, jax version and each arm's config not recorded.")
    if p:
        commit = f"{p['commit']}{' with uncommitted changes' if p['uncommitted_changes'] else ''}"
        portable = "on" if p["portable_cpu"] else "off (SPARSERL_PORTABLE_CPU=0)"
        wall = "" if p["wall_s"] is None else f"; wall time {p['wall_s']:.0f} s"
        arms = " Every run's resolved config: [arms.json](arms.json)." if p.get("arms_json") else ""
        return (f"Provenance: commit {commit}; portable CPU settings {portable} (experiments/workers.py); "
                f"{p['cpu']}; jax {p['jax']}; {p['cores']} core(s){wall}.{arms}")
    if results_json is None:
        return "Provenance: not recorded."
    rel = os.path.relpath(os.path.abspath(results_json), REPO)
    commit = _git("log", "-1", "--format=%h %ad", "--date=short", "--", rel)
    if not commit:
        return "Provenance: not recorded by this run (before figlib recorded it)."
    before = _git("merge-base", "--is-ancestor", PORTABLE_SINCE, commit.split()[0]) is None
    return (f"Provenance: not recorded by this run (before figlib recorded it); its results.json was "
            f"committed in {commit}, {'before' if before else 'after'} the portable CPU settings "
            f"({PORTABLE_SINCE}), so it ran with {'the host' if before else 'the portable'} CPU numerics; "
            "no arms.json.")
