"""One import graph over sparserl_jax/ and kernels/ (installed as sparserl_jax.kernels), read
from the source with ast: every import, at the top of a module, under `if TYPE_CHECKING` or in a
function body, is an arrow.

- No cycle anywhere, inside a room or across rooms.
- The rooms (a top-level module, or a package with everything under it) stand on FLOORS: a room
  imports only rooms on lower floors, never one on its own floor or above; a new room must be
  given a floor. So kernels import nothing of the model, and the model nothing of rollout/ or rl/.
- experiments/ (installed under its own name) is no room: none imports it; its own floors are
  tests/test_layering_experiments.py's.
- No call-time import of the package anywhere: an import of sparserl_jax inside a function body
  hides an arrow from a reader (and, before this test, hid cycles). Third-party packages that a
  feature needs only when it runs (torch, transformers and gguf for a conversion, math_verify for
  a reward) may be imported where they are used; CALL_TIME_IMPORTS names any exception.
- The RL loop's own rules on top: rollout/ imports only what ALLOWED lists (never the run's schema
  config, components, rl, train or a CLI), run_state neither rollout/ nor rl/, the leaves nothing;
  each room of the loop imports on its own in a fresh interpreter.

docs/layout.md draws the floors. The checker's own tests plant cycles, upward and sideways imports,
a room without a floor and call-time imports in a toy graph, a toy source tree and the real graph
(kernels/sharded.py importing the model again), and see each found."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
ROOT = "sparserl_jax"  # the package itself: its __init__ imports nothing
TREES = {REPO / "sparserl_jax": ROOT, REPO / "kernels": f"{ROOT}.kernels"}  # as setup.py installs them
LOOP = [
    "sparserl_jax.rollout.source",
    "sparserl_jax.rollout.stats",
    "sparserl_jax.rl.learner",
    "sparserl_jax.run_state",
    "sparserl_jax.train",
]

# Bottom first. A room imports rooms on lower floors only.
FLOORS: tuple[tuple[str, ...], ...] = (
    (
        "validate",
        "config_io",
        "cli",
        "compile_clock",
        "metrics_log",
        "checkpoint",
        "tokenizer",
        "mesh_axes",
        "registry",
        "eval_metrics",
    ),  # leaves: nothing of the package
    ("kernels", "quant", "kvcache", "data", "host_memory"),  # attention kernels, quantization, KV cache, tasks, malloc
    ("model",),  # the transformer, HF import/export, sharding
    ("distributed", "fetch"),  # multi-process helpers; checkpoint download
    ("rollout", "rl"),  # sampling; the update
    ("config", "generate"),  # the run's schema; the generation CLI
    ("components", "run_state", "eval_suite"),  # what a run is built from; its directory; a suite's table
    ("evaluate", "sft", "dryrun", "export"),  # evaluation; the warm start; the memory plan; export to HF
    ("train",),  # the RL loop
)
ALLOWED = {  # a module (or package prefix) -> the only rooms of the package it may import
    "sparserl_jax.rollout": (
        "sparserl_jax.rollout",
        "sparserl_jax.model",
        "sparserl_jax.kvcache",
        "sparserl_jax.kernels",
        "sparserl_jax.quant",
        "sparserl_jax.distributed",
        "sparserl_jax.validate",
        "sparserl_jax.config_io",
        "sparserl_jax.compile_clock",
    ),
}
FORBIDDEN = {  # a module (or package prefix) -> what it must not import (beyond the floors)
    "sparserl_jax.run_state": ("sparserl_jax.rollout", "sparserl_jax.rl"),
}
CALL_TIME_IMPORTS: dict[str, str] = {}  # "module line N: statement" -> why it cannot be at the top


def _modules(trees=None) -> dict[str, Path]:
    """Module name -> source file, for every .py file of the trees (folder -> its package name)."""
    out = {}
    for folder, package in (TREES if trees is None else trees).items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            out[".".join([package, *parts])] = path
    return out


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from ... import` names, relative ones resolved against `module`."""
    if not node.level:
        return node.module or ""
    base = module.split(".")[: len(module.split(".")) - node.level + is_package]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path, known, module: str = "") -> set[str]:
    """The package modules `path` imports anywhere in it (top level, TYPE_CHECKING blocks, function
    bodies). `from a.b import c` is a.b.c when that is a module, else a.b."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            src = _absolute(node, module, path.name == "__init__.py")
            found |= {f"{src}.{a.name}" if f"{src}.{a.name}" in known else src for a in node.names}
    return {m for m in found if m in known}


def graph(trees=None) -> dict[str, set[str]]:
    mods = _modules(trees)
    return {m: imports(p, mods, m) - {m} for m, p in mods.items()}


def room(mod: str) -> str:
    """sparserl_jax.<room>: a top-level module, or a package with everything under it."""
    return ".".join(mod.split(".")[:2])


def floor_of(floors=FLOORS) -> dict[str, int]:
    """sparserl_jax.<room> -> its floor, 1 for the ground floor (the first of `floors`)."""
    return {f"{ROOT}.{r}": i for i, rooms in enumerate(floors, start=1) for r in rooms}


def upward(g: dict[str, set[str]], floors=FLOORS) -> list[str]:
    """Every import of a room on the same floor or above, and every room without a floor."""
    level = floor_of(floors)
    found = {f"{room(m)} has no floor (add it to FLOORS)" for m in g if m != ROOT and room(m) not in level}
    found |= {
        f"{m} imports {d} (floor {level[room(m)]} -> {level[room(d)]})"
        for m, deps in g.items()
        for d in deps
        if room(m) != room(d) and room(m) in level and room(d) in level and level[room(d)] >= level[room(m)]
    }
    found |= {f"{m} imports {d}" for m, deps in g.items() for d in deps if d == ROOT or m == ROOT}
    return sorted(found)


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def violations(g: dict[str, set[str]]) -> list[str]:
    """Every import that ALLOWED does not allow or FORBIDDEN forbids."""
    found = {
        f"{m} imports {d}"
        for m, deps in g.items()
        for prefix, banned in FORBIDDEN.items()
        if _under(m, prefix)
        for d in deps
        if any(_under(d, b) for b in banned)
    }
    found |= {
        f"{m} imports {d}"
        for m, deps in g.items()
        for prefix, allowed in ALLOWED.items()
        if _under(m, prefix)
        for d in deps
        if not any(_under(d, a) for a in allowed)
    }
    return sorted(found)


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
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
    return sorted(out)


def call_time_imports(text: str, package: str = ROOT) -> list[str]:
    """The imports of `package` (or relative ones) made inside a function body, as
    'line N: statement'."""

    def ours(node):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
        return getattr(node, "level", 0) or any(_under(n, package) for n in names)

    return sorted(
        {
            f"line {node.lineno}: {ast.unparse(node)}"
            for fn in ast.walk(ast.parse(text))
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
            if isinstance(node, (ast.Import, ast.ImportFrom)) and ours(node)
        }
    )


# ----------------------------------------------------------------------------- the package


def test_no_cycle():
    assert cycles(graph()) == []


def test_rooms_stand_on_floors():
    g = graph()
    assert g[ROOT] == set()  # importing the package root brings nothing in
    assert upward(g) == []


def test_the_loop_rules():
    assert violations(graph()) == []


def test_no_room_imports_the_experiments():
    """experiments/ (installed as `experiments`) stands above every floor: the package and the
    kernels never import it."""
    experiments = {"experiments", *_modules({REPO / "experiments": "experiments"})}
    assert {m: sorted(imports(p, experiments, m)) for m, p in _modules().items() if imports(p, experiments, m)} == {}


def test_no_call_time_package_imports():
    """An import of the package inside a function hides an arrow from a reader (and often a
    cycle)."""
    found = [f"{m} {line}" for m, path in sorted(_modules().items()) for line in call_time_imports(path.read_text())]
    assert [f for f in found if f not in CALL_TIME_IMPORTS] == []
    assert sorted(set(CALL_TIME_IMPORTS) - set(found)) == []  # no stale exception


def test_every_room_on_one_floor_and_every_floor_room_exists():
    rooms = [r for floor in FLOORS for r in floor]
    assert len(rooms) == len(set(rooms))
    assert sorted(f"{ROOT}.{r}" for r in rooms) == sorted({room(m) for m in _modules()} - {ROOT})


def test_layout_draws_the_floors():
    """docs/layout.md's table of floors is FLOORS (top floor first)."""
    rows = re.findall(r"^\| (\d+) \| (.+?) \|", (REPO / "docs/layout.md").read_text(), re.M)
    drawn = {int(n): tuple(re.findall(r"`(\w+)`", rooms)) for n, rooms in rows}
    assert drawn == {i: floor for i, floor in enumerate(FLOORS, start=1)}


def test_the_graph_reads_both_trees():
    g = graph()
    assert "sparserl_jax.kernels" in g["sparserl_jax.model.transformer"]  # kernels/ is in the graph
    assert "sparserl_jax.mesh_axes" in g["sparserl_jax.kernels.sharded"]
    assert "sparserl_jax.rollout.scheduler" in g["sparserl_jax.rollout.source"]  # edges are read
    assert "sparserl_jax.kvcache" in g["sparserl_jax.rollout.sampler"]  # `from pkg import module`


# ----------------------------------------------------------------------------- the checker


def test_the_checks_can_fail():
    """A toy graph with a cycle, an upward import, a sideways one and a room without a floor."""
    floors = (("validate",), ("kvcache", "data"), ("model",))
    g = {
        "sparserl_jax.model.transformer": {"sparserl_jax.kvcache.cache"},
        "sparserl_jax.kvcache.cache": {"sparserl_jax.model.config", "sparserl_jax.validate"},
        "sparserl_jax.model.config": {"sparserl_jax.model.transformer"},
        "sparserl_jax.data.tasks": {"sparserl_jax.kvcache", "sparserl_jax.validate"},
        "sparserl_jax.kvcache": set(),
        "sparserl_jax.validate": set(),
        "sparserl_jax.newroom": {"sparserl_jax.validate"},
    }
    assert cycles(g) == [["sparserl_jax.kvcache.cache", "sparserl_jax.model.config", "sparserl_jax.model.transformer"]]
    assert upward(g, floors) == [
        "sparserl_jax.data.tasks imports sparserl_jax.kvcache (floor 2 -> 2)",
        "sparserl_jax.kvcache.cache imports sparserl_jax.model.config (floor 2 -> 3)",
        "sparserl_jax.newroom has no floor (add it to FLOORS)",
    ]
    assert violations(
        {
            "sparserl_jax.rollout.engine": {"sparserl_jax.config", "sparserl_jax.model"},
            "sparserl_jax.run_state": {"sparserl_jax.rl.update"},
        }
    ) == [
        "sparserl_jax.rollout.engine imports sparserl_jax.config",
        "sparserl_jax.run_state imports sparserl_jax.rl.update",
    ]


def test_a_planted_stair_in_the_real_graph_is_found():
    """kernels/sharded.py importing model/sharding.py again (as it did at call time): an upward
    import and a cycle through the model's transformer."""
    g = graph()
    g["sparserl_jax.kernels.sharded"].add("sparserl_jax.model.sharding")
    assert upward(g) == ["sparserl_jax.kernels.sharded imports sparserl_jax.model.sharding (floor 2 -> 3)"]
    assert any(
        {"sparserl_jax.kernels.sharded", "sparserl_jax.model.sharding", "sparserl_jax.model.transformer"} <= set(c)
        for c in cycles(g)
    )


def test_a_planted_source_tree_is_read(tmp_path):
    """Files, not just dicts: a toy package whose modules import each other (one of them at call
    time, one under TYPE_CHECKING, one relatively) and a second tree installed under it."""
    pkg, kern = tmp_path / "sparserl_jax", tmp_path / "kernels"
    (pkg / "kvcache").mkdir(parents=True)
    kern.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kvcache" / "__init__.py").write_text("from .config import KVConfig\n")
    (pkg / "kvcache" / "config.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from sparserl_jax.model import cfg\n"
    )
    (pkg / "model.py").write_text(
        "from sparserl_jax import kernels\n\n\ndef f():\n    from sparserl_jax.kvcache import config\n"
    )
    (kern / "__init__.py").write_text("import numpy\n")
    g = graph({pkg: ROOT, kern: f"{ROOT}.kernels"})
    assert g == {
        "sparserl_jax": set(),
        "sparserl_jax.kvcache": {"sparserl_jax.kvcache.config"},
        "sparserl_jax.kvcache.config": {"sparserl_jax.model"},
        "sparserl_jax.model": {"sparserl_jax.kernels", "sparserl_jax.kvcache.config"},
        "sparserl_jax.kernels": set(),
    }
    assert cycles(g) == [["sparserl_jax.kvcache.config", "sparserl_jax.model"]]
    assert upward(g, (("kernels", "kvcache"), ("model",))) == [
        "sparserl_jax.kvcache.config imports sparserl_jax.model (floor 1 -> 2)"
    ]
    assert call_time_imports((pkg / "model.py").read_text()) == ["line 5: from sparserl_jax.kvcache import config"]


def test_a_call_time_import_is_found():
    text = (
        "import os\n\n\ndef fetch(x):\n    from sparserl_jax import distributed  # late\n\n"
        "    def inner():\n        import numpy as np\n        from . import quant\n"
        "    return distributed.to_host(x)\n"
    )
    assert call_time_imports(text) == ["line 5: from sparserl_jax import distributed", "line 9: from . import quant"]
    assert call_time_imports("import os\nfrom sparserl_jax import quant\n") == []


@pytest.mark.parametrize(
    "room_name",
    [
        "config",
        "components",
        "evaluate",
        "sft",
        "generate",
        "dryrun",
        "rl.learner",
        "train",
        "run_state",
        "checkpoint",
        "tokenizer",
    ],
)
def test_rollout_may_not_reach_up(room_name):
    """The whitelist refuses each room above rollout/ (and any room it does not name)."""
    assert violations({"sparserl_jax.rollout.engine": {f"sparserl_jax.{room_name}"}}) == [
        f"sparserl_jax.rollout.engine imports sparserl_jax.{room_name}"
    ]


# ----------------------------------------------------------------------------- the loop


@pytest.mark.parametrize("module", LOOP)
def test_imports_alone(module):
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_module_docstrings_say_what_each_room_owns():
    """Each room of the loop, and the rollout/ and rl/ packages, opens with what it owns and what
    it must not touch."""
    mods = _modules()
    for name in [*LOOP, "sparserl_jax.rollout", "sparserl_jax.rl"]:
        doc = ast.get_docstring(ast.parse(mods[name].read_text())) or ""
        first_two = " ".join(doc.splitlines()[:2])
        assert "Owns" in first_two and ("not" in first_two), (name, first_two)
