"""The rooms of the RL loop import in one direction (read from the source with ast):
train -> rollout/source, rl/learner, run_state; rollout/ and rl/ never import each other, nor
train or run_state; run_state imports neither; no import cycle spans two packages; and each room
of the loop imports on its own in a fresh interpreter."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "sparserl_jax"
LOOP = ["sparserl_jax.rollout.source", "sparserl_jax.rollout.stats", "sparserl_jax.rl.learner",
        "sparserl_jax.run_state", "sparserl_jax.train"]
FORBIDDEN = {  # a module (or package prefix) -> what it must not import
    "sparserl_jax.rollout": ("sparserl_jax.rl", "sparserl_jax.train", "sparserl_jax.run_state"),
    "sparserl_jax.rl": ("sparserl_jax.rollout", "sparserl_jax.train", "sparserl_jax.run_state"),
    "sparserl_jax.run_state": ("sparserl_jax.rollout", "sparserl_jax.rl", "sparserl_jax.train"),
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PKG.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports(path: Path, known) -> set[str]:
    """The package modules `path` imports anywhere in it (module level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in known}


def graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: imports(p, mods) - {m} for m, p in mods.items()}


def violations(g: dict[str, set[str]]) -> list[str]:
    def under(mod, prefix):
        return mod == prefix or mod.startswith(prefix + ".")

    return [f"{m} imports {d}" for m, deps in sorted(g.items()) for prefix, banned in FORBIDDEN.items()
            if under(m, prefix) for d in sorted(deps) if any(under(d, b) for b in banned)]


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def _package(mod: str) -> str:
    parts = mod.split(".")
    return ".".join(parts[:2])  # sparserl_jax.<room>


def test_rooms_import_in_one_direction():
    assert violations(graph()) == []


def test_no_cycle_spans_two_packages():
    """Only a package's registry may import itself back (kvcache's policies do); the loop's
    modules are in no cycle at all."""
    found = cycles(graph())
    assert [c for c in found if len({_package(m) for m in c}) > 1] == []
    assert [c for c in found if set(c) & set(LOOP)] == []


def test_the_checks_can_fail():
    g = {"sparserl_jax.rl.learner": {"sparserl_jax.rollout.source"},
         "sparserl_jax.rollout.source": {"sparserl_jax.rl.learner"},
         "sparserl_jax.run_state": {"sparserl_jax.train"}}
    assert violations(g) == ["sparserl_jax.rl.learner imports sparserl_jax.rollout.source",
                             "sparserl_jax.rollout.source imports sparserl_jax.rl.learner",
                             "sparserl_jax.run_state imports sparserl_jax.train"]
    assert cycles(g) == [["sparserl_jax.rl.learner", "sparserl_jax.rollout.source"]]
    assert "sparserl_jax.rollout.scheduler" in graph()["sparserl_jax.rollout.source"]  # edges are read


@pytest.mark.parametrize("module", LOOP)
def test_imports_alone(module):
    proc = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True,
                          cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_module_docstrings_say_what_each_room_owns():
    """Each room of the loop, and the rollout/ and rl/ packages, opens with what it owns and what
    it must not touch."""
    mods = _modules()
    for name in [*LOOP, "sparserl_jax.rollout", "sparserl_jax.rl"]:
        doc = ast.get_docstring(ast.parse(mods[name].read_text())) or ""
        first_two = " ".join(doc.splitlines()[:2])
        assert "Owns" in first_two and ("not" in first_two), (name, first_two)
