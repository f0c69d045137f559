"""The rooms of the RL loop import in one direction (read from the source with ast):
train -> components (which builds the rollout source), rl/learner, run_state; rollout/ stands on
its own floor: it imports only rollout, model, kvcache, kernels, quant, distributed and the leaves
(validate, config_io, compile_clock), never the run's schema (config), components, rl, train or
any CLI, and imports nothing inside a function body; rl/ never imports rollout, train or
run_state; run_state imports neither; distributed imports no rollout, rl or train; config_io and
validate import nothing of the package; no import cycle spans two packages; and each room of the
loop imports on its own in a fresh interpreter."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PKG = REPO / "sparserl_jax"
LOOP = ["sparserl_jax.rollout.source", "sparserl_jax.rollout.stats", "sparserl_jax.rl.learner",
        "sparserl_jax.run_state", "sparserl_jax.train"]
ROOT = "sparserl_jax"  # the package itself: `from sparserl_jax import x` names it (its __init__ imports nothing)
ALLOWED = {  # a module (or package prefix) -> the only rooms of the package it may import
    "sparserl_jax.rollout": ("sparserl_jax.rollout", "sparserl_jax.model", "sparserl_jax.kvcache",
                             "sparserl_jax.kernels", "sparserl_jax.quant", "sparserl_jax.distributed",
                             "sparserl_jax.validate", "sparserl_jax.config_io", "sparserl_jax.compile_clock"),
    "sparserl_jax.config_io": (),
    "sparserl_jax.validate": (),
}
FORBIDDEN = {  # a module (or package prefix) -> what it must not import
    "sparserl_jax.rl": ("sparserl_jax.rollout", "sparserl_jax.train", "sparserl_jax.run_state"),
    "sparserl_jax.run_state": ("sparserl_jax.rollout", "sparserl_jax.rl", "sparserl_jax.train"),
    "sparserl_jax.distributed": ("sparserl_jax.rollout", "sparserl_jax.rl", "sparserl_jax.train"),
}
NO_DEFERRED_IMPORTS = ("sparserl_jax.rollout",)  # every import at the top, where a reader (and this test) sees it


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


def deferred_imports(text: str) -> list[str]:
    """The imports made inside a function body of a module's source, as 'line N: statement'."""
    return sorted({f"line {node.lineno}: {ast.unparse(node)}"
                   for fn in ast.walk(ast.parse(text)) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))})


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def violations(g: dict[str, set[str]]) -> list[str]:
    """Every import that ALLOWED does not allow or FORBIDDEN forbids."""
    found = {f"{m} imports {d}" for m, deps in g.items() for prefix, banned in FORBIDDEN.items()
             if _under(m, prefix) for d in deps if any(_under(d, b) for b in banned)}
    found |= {f"{m} imports {d}" for m, deps in g.items() for prefix, allowed in ALLOWED.items()
              if _under(m, prefix) for d in deps if d != ROOT and not any(_under(d, a) for a in allowed)}
    return sorted(found)


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
    g = graph()
    assert g[ROOT] == set()  # importing the package root brings nothing in
    assert violations(g) == []


def test_no_deferred_imports():
    """An import inside a function hides an edge from a reader (and often a cycle)."""
    found = [f"{m} {line}" for m, path in sorted(_modules().items())
             if any(_under(m, p) for p in NO_DEFERRED_IMPORTS) for line in deferred_imports(path.read_text())]
    assert found == []


def test_no_cycle_spans_two_packages():
    """Only a package's registry may import itself back (kvcache's policies do); the loop's
    modules are in no cycle at all."""
    found = cycles(graph())
    assert [c for c in found if len({_package(m) for m in c}) > 1] == []
    assert [c for c in found if set(c) & set(LOOP)] == []


def test_the_checks_can_fail():
    g = {"sparserl_jax.rl.learner": {"sparserl_jax.rollout.source"},
         "sparserl_jax.rollout.source": {"sparserl_jax.rl.learner", "sparserl_jax.config", ROOT,
                                         "sparserl_jax.model.config", "sparserl_jax.distributed"},
         "sparserl_jax.run_state": {"sparserl_jax.train"},
         "sparserl_jax.distributed": {"sparserl_jax.rollout.sampler", "sparserl_jax.model.sharding"},
         "sparserl_jax.config_io": {"sparserl_jax.validate"},
         "sparserl_jax.validate": {"sparserl_jax.config"}}
    assert violations(g) == ["sparserl_jax.config_io imports sparserl_jax.validate",
                             "sparserl_jax.distributed imports sparserl_jax.rollout.sampler",
                             "sparserl_jax.rl.learner imports sparserl_jax.rollout.source",
                             "sparserl_jax.rollout.source imports sparserl_jax.config",
                             "sparserl_jax.rollout.source imports sparserl_jax.rl.learner",
                             "sparserl_jax.run_state imports sparserl_jax.train",
                             "sparserl_jax.validate imports sparserl_jax.config"]
    assert cycles(g) == [["sparserl_jax.rl.learner", "sparserl_jax.rollout.source"]]
    assert "sparserl_jax.rollout.scheduler" in graph()["sparserl_jax.rollout.source"]  # edges are read


@pytest.mark.parametrize("room", ["config", "components", "evaluate", "sft", "generate", "dryrun",
                                  "rl.learner", "train", "run_state", "checkpoint", "tokenizer"])
def test_rollout_may_not_reach_up(room):
    """The whitelist refuses each room above rollout/ (and any room it does not name)."""
    assert violations({"sparserl_jax.rollout.engine": {f"sparserl_jax.{room}"}}) == [
        f"sparserl_jax.rollout.engine imports sparserl_jax.{room}"]


def test_a_deferred_import_is_found():
    text = ("import os\n\n\ndef fetch(x):\n    from sparserl_jax import distributed  # late\n\n"
            "    def inner():\n        import numpy as np\n    return distributed.to_host(x)\n")
    assert deferred_imports(text) == ["line 5: from sparserl_jax import distributed", "line 8: import numpy as np"]
    assert deferred_imports("import os\nfrom sparserl_jax import quant\n") == []


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
