"""Provenance: what produced a result (the command with its pinning, the commit, the portable CPU
settings, the machine, jax, cores, wall time), recorded in every results.json and written as one
sentence under results.md's title; for results from before it was recorded, what git says. The one
place that reads the commit (`commit`) and the CPU (`cpu_model`): the benchmarks' machine lines
take them from here too. Imports no JAX.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Sequence

from experiments.lib import workers  # imports no JAX

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The commit that turned the portable CPU settings on (workers.py): results committed before it
# ran with the host's own numerics.
PORTABLE_SINCE = "de5812a"


def _git(*args: str) -> str | None:
    return _git_in(REPO, *args)


def commit() -> str | None:
    """The commit a copy of the tree was made from where SPARSERL_COMMIT names it (a lent GPU
    machine receives the working tree with a .git that can be older than it), else the checkout's
    commit (12 hex digits), None outside a git checkout."""
    return os.environ.get("SPARSERL_COMMIT") or _git("rev-parse", "--short=12", "HEAD")


def uncommitted_changes(ignoring: tuple[str, ...] = ()) -> bool:
    """Whether tracked files differ from the commit; False where SPARSERL_COMMIT names the commit
    (whoever set it says the tree is that commit's) or outside a checkout. `ignoring`: paths whose
    changes do not count (a command's own committed output, which it rewrites as it goes)."""
    if os.environ.get("SPARSERL_COMMIT"):
        return False
    inside = [os.path.abspath(p) for p in ignoring if _inside(os.path.abspath(p), REPO)]
    excluded = [f":(exclude){p}" for p in inside]  # git refuses a pathspec outside the checkout
    return bool(_git("status", "--porcelain", "--untracked-files=no", "--", REPO, *excluded))


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(folder)]) == os.path.realpath(folder)


def library_commit() -> str | None:
    """The commit of the checkout the imported sparserl_jax package comes from, when that is another
    checkout than this one's experiments (a long study run with its library pinned in a worktree);
    None when they are the same checkout or it is not a git checkout."""
    import sparserl_jax

    lib = os.path.dirname(os.path.dirname(os.path.realpath(sparserl_jax.__file__)))
    if lib == os.path.realpath(REPO) or _git_in(lib, "rev-parse", "--show-toplevel") != lib:
        return None  # the same checkout, or a package not at a checkout's top (an installed copy)
    head = _git_in(lib, "rev-parse", "--short=12", "HEAD")
    dirty = _git_in(lib, "status", "--porcelain", "--untracked-files=no")
    return head and head + (" with uncommitted changes" if dirty else "")


def package_commit(prov: dict) -> str | None:
    """The commit of the sparserl_jax package a provenance names: its library checkout's where it
    ran from another (library_commit), else its own."""
    lib = prov.get("library_commit")
    return (lib.split()[0] if lib else None) or prov.get("commit")


def package_changes(since: str | None, until: str | None) -> int | None:
    """How many commits changed the sparserl_jax package from commit `since` to `until` (0: the same
    package code), None where git cannot tell (a commit unknown here)."""
    if not since or not until:
        return None
    count = _git("rev-list", "--count", f"{since}..{until}", "--", "sparserl_jax")
    return int(count) if count and count.isdigit() else None


def _git_in(folder: str, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=folder, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


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


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in first.splitlines() if ":" in line)}


def cpu_model() -> str:
    """The CPU's model name, family and model, and whether it has AVX-512 (a fingerprint records
    it without comparing it: another CPU with AVX2 should give the same hashes)."""
    info = _cpuinfo()
    if not info:
        return "?"
    avx512 = "avx512f" in info.get("flags", "").split()
    return (
        f"{info.get('model name', '?')} (family {info.get('cpu family', '?')} model "
        f"{info.get('model', '?')}, {'AVX-512' if avx512 else 'no AVX-512'})"
    )


def cpu_slug() -> str:
    """This CPU as a file name: vendor and line, family and model (e.g. amd-epyc-family25-model17,
    the name of the default experiment's replicate from that machine)."""
    info = _cpuinfo()
    name = re.sub(r"\((r|tm)\)", " ", info.get("model name", "unknown").lower())
    words = re.findall(r"[a-z]+", name)[:2] or ["unknown"]
    return "-".join([*words, f"family{info.get('cpu family', '')}", f"model{info.get('model', '')}"])


def cpu_flags(names: Sequence[str]) -> dict[str, bool]:
    """Which of the CPU flags `names` (as /proc/cpuinfo spells them) this CPU has."""
    flags = set(_cpuinfo().get("flags", "").split())
    return {name: name in flags for name in names}


# The fields every results.md's provenance sentence names (tests/test_provenance.py): what is
# unknown for a result is written "not recorded".
FIELDS = ("commit", "tree", "CPU", "jax", "cores", "wall time")
NOT_RECORDED = "not recorded"


def provenance(cores: Sequence[int], seconds: float | None) -> dict:
    """What produced a result: commit (and whether the tree had uncommitted changes), the portable
    CPU settings (workers.py), the machine, the jax version, the cores and the wall time. Called
    with `seconds` None at a run's start (its commit and tree then), the wall time added at the end."""
    import jax

    lib = library_commit()
    return {
        "commit": commit(),
        **({"library_commit": lib} if lib else {}),
        "uncommitted_changes": uncommitted_changes(),
        **({"commit_at": "start"} if seconds is None else {}),
        "portable_cpu": workers.portable_cpu_enabled(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpu": cpu_model(),
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "cores": len(cores),
        "wall_s": None if seconds is None else round(seconds, 1),
    }


def _fields(commit: str, tree: str, cpu: str | None, jax: str | None, cores: int | None, wall_s: float | None) -> str:
    """The six fields, each named, "not recorded" where unknown."""
    nr = NOT_RECORDED
    return (
        f"commit {commit}; tree {tree}; CPU {cpu or nr}; jax {jax or nr}; "
        f"cores {nr if cores is None else cores}; wall time {nr if wall_s is None else f'{wall_s:.0f} s'}"
    )


def report_head(title: str, data: dict) -> list[str]:
    """A benchmark report's first lines: its title, the command that wrote it, its provenance."""
    return [f"# {title}", "", f"`{data['command']}`", "", provenance_line(data), ""]


def provenance_line(data: dict, results_json: str | None = None) -> str:
    """results.md's provenance sentence, from data['provenance'] (or, for results that did not
    record it, what git says of their results.json): the commit at the start of the run, whether
    the tree was clean, CPU model, jax version, cores and wall time (FIELDS), "not recorded" where
    unknown; the command is results.md's line above it."""
    p = data.get("provenance")
    nr = NOT_RECORDED
    results = data.get("results") if isinstance(data.get("results"), dict) else {}
    legacy_wall = (data.get("legacy") or {}).get("wall_s") or data.get("wall_s") or results.get("seconds")
    legacy_cores = data.get("cores") or (data.get("meta") or {}).get("cores")
    unknown_tree = f"clean: {nr}"
    if p and p.get("recorded") is False:  # results from before figlib recorded it: what git says
        numerics = (
            "the portable CPU numerics (their default since)" if p["portable_cpu"] else "the host's own CPU numerics"
        )
        commit = f"{nr} (its numbers were committed in {p['results_commit']})"
        return (
            f"Provenance: {_fields(commit, unknown_tree, None, None, legacy_cores, legacy_wall)}; "
            f"committed {'after' if p['portable_cpu'] else 'before'} the portable CPU settings ({PORTABLE_SINCE}), "
            f"so it ran with {numerics}; each arm's config {nr}."
        )
    if p:
        at = (
            "at the start of the run"
            if p.get("commit_at") == "start"
            else f"when the run finished (at its start: {nr})"
        )
        tree = {True: "with uncommitted changes", False: "clean"}.get(p.get("uncommitted_changes"), unknown_tree)
        portable = {
            True: "on",
            False: "off (SPARSERL_PORTABLE_CPU=0)",
            "host": "off (a benchmark of this CPU: its own numerics)",
        }.get(p.get("portable_cpu"), nr)
        arms = " Every run's resolved config: [arms.json](arms.json)." if p.get("arms_json") else ""
        commit = f"{p['commit']} {at}" if p.get("commit") else nr
        if p.get("library_commit"):  # the library imported from another checkout
            commit += f" (its sparserl_jax package from commit {p['library_commit']})"
        fields = _fields(commit, tree, p.get("cpu"), p.get("jax"), p.get("cores"), p.get("wall_s"))
        return f"Provenance: {fields}; portable CPU settings {portable} (experiments/lib/workers.py).{arms}"
    if results_json is None:
        return f"Provenance: {_fields(nr, unknown_tree, None, None, legacy_cores, legacy_wall)}."
    rel = os.path.relpath(os.path.abspath(results_json), REPO)
    commits = (_git("log", "--format=%h %ad", "--date=short", "--", rel) or "").splitlines()
    if not commits:
        return f"Provenance: {_fields(nr, unknown_tree, None, None, legacy_cores, legacy_wall)} (before figlib recorded it)."
    first, last = commits[-1], commits[0]
    where = f"committed in {last}" if first == last else f"first committed in {first}, last changed in {last}"
    after = [_git("merge-base", "--is-ancestor", PORTABLE_SINCE, c.split()[0]) is not None for c in (first, last)]
    numerics = (
        "after the portable CPU settings ({0}), so it ran with the portable CPU numerics"
        if all(after)
        else "before the portable CPU settings ({0}), so it ran with the host CPU numerics"
        if not any(after)
        else "across the portable CPU settings ({0}): its CPU numerics not recorded"
    ).format(PORTABLE_SINCE)
    return (
        f"Provenance: {_fields(f'{nr} (its results.json was {where})', unknown_tree, None, None, legacy_cores, legacy_wall)}; "
        f"committed {numerics}; no arms.json."
    )


def write_report(path: str, data: dict, markdown: str, *, indent: int = 1) -> None:
    """A benchmark's numbers at `path` (JSON) and its markdown beside it (the same name, .md),
    the folder made if need be."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=indent)
    with open(os.path.splitext(path)[0] + ".md", "w") as f:
        f.write(markdown if markdown.endswith("\n") else markdown + "\n")
