"""experiments/ as a house of its own, read from the source with ast like the package
(tests/test_layering.py): one import graph over experiments/, every import an arrow.

- No cycle.
- Floors: lib/ (the shared library) imports nothing of experiments/ outside lib/; the modules
  of real/ and device/ that are not scripts import lib/ and the library modules of real/ (device/
  also its own); a script (a module with an `if __name__ == "__main__":` block) stands on top.
- No module imports a script: what two scripts share lives in a library module.
- The entry points that set the process's environment before JAX starts (CPU pinning, the
  portable CPU numerics, XLA flags, the emulated CPU) import no JAX at all when imported; no
  script starts a JAX backend when imported (each sets its environment in main()).

docs/layout.md draws the folders. The checker's own test plants a script-to-script import, a
sideways import and a cycle in a toy graph and sees each found."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_layering import cycles, imports

REPO = Path(__file__).resolve().parent.parent
TREE = REPO / "experiments"
LIB = "experiments.lib"
# entry points whose main() sets the environment JAX reads when it starts: importing them must not
# import JAX (tests below run each in a fresh interpreter)
NO_JAX_AT_IMPORT = (
    "experiments.bench.bench_precision",
    "experiments.bench.bench_vs_trl",
    "experiments.bench.dot_bits",
    "experiments.bench.fingerprint",
    "experiments.bench.profile_cpu",
    "experiments.device.gpu_check",
    "experiments.real.calibrate",
)


def modules() -> dict[str, Path]:
    out = {}
    for path in TREE.rglob("*.py"):
        parts = list(path.relative_to(TREE).with_suffix("").parts)
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        out[".".join(["experiments", *parts])] = path
    return out


def is_script(path: Path) -> bool:
    """A module with an `if __name__ == "__main__":` block at its top level."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and "__name__" in ast.unparse(node.test):
            return True
    return False


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports(p, mods, m) - {m} for m, p in mods.items()}


def _under(mod: str, prefix: str) -> bool:
    return mod == prefix or mod.startswith(prefix + ".")


def allowed(mod: str, scripts: set[str]) -> tuple[str, ...]:
    """The prefixes `mod` may import (None of them a script; see problems)."""
    if _under(mod, LIB):
        return (LIB,)
    if mod in scripts or mod == "experiments":
        return ("experiments",)
    if _under(mod, "experiments.real"):
        return (LIB, "experiments.real")
    if _under(mod, "experiments.device"):
        return (LIB, "experiments.real", "experiments.device")
    return (LIB,)  # a package's __init__ (imports nothing today)


def problems(g: dict[str, set[str]], scripts: set[str]) -> list[str]:
    """Every import of a script, and every import outside what the importer's floor allows."""
    found = {f"{m} imports the script {d}" for m, deps in g.items() for d in deps if d in scripts}
    found |= {
        f"{m} imports {d} (not on a floor below it)"
        for m, deps in g.items()
        for d in deps
        if d != "experiments" and not any(_under(d, a) for a in allowed(m, scripts))
    }
    return sorted(found)


def test_no_cycle():
    assert cycles(graph()) == []


def test_floors_and_no_script_imports_a_script():
    mods = modules()
    scripts = {m for m, p in mods.items() if is_script(p)}
    assert "experiments.default" in scripts and "experiments.lib.figlib" not in scripts
    assert not any(_under(s, LIB) for s in scripts)  # the library holds no script
    assert problems(graph(), scripts) == []


def test_the_graph_reads_the_tree():
    g = graph()
    assert "experiments.lib.default_experiment" in g["experiments.default"]
    assert "experiments.lib.figlib" in g["experiments.figures.fig_b_budget"]
    assert "experiments.real.collapse_plan" in g["experiments.device.gpu_study"]


def test_the_checks_can_fail():
    """A planted script-to-script import, a library module importing a script and a real/ module
    importing device/, and a cycle."""
    scripts = {"experiments.figures.fig_b", "experiments.figures.fig_c"}
    g = {
        "experiments.figures.fig_b": {"experiments.figures.fig_c", "experiments.lib.figlib"},
        "experiments.figures.fig_c": {"experiments.lib.figlib"},
        "experiments.lib.figlib": {"experiments.lib.figplot"},
        "experiments.lib.figplot": {"experiments.lib.figlib", "experiments.figures.fig_c"},
        "experiments.real.measure": {"experiments.device.gpu_report"},
    }
    assert problems(g, scripts) == [
        "experiments.figures.fig_b imports the script experiments.figures.fig_c",
        "experiments.lib.figplot imports experiments.figures.fig_c (not on a floor below it)",
        "experiments.lib.figplot imports the script experiments.figures.fig_c",
        "experiments.real.measure imports experiments.device.gpu_report (not on a floor below it)",
    ]
    assert cycles(g) == [["experiments.figures.fig_c", "experiments.lib.figlib", "experiments.lib.figplot"]]


def _fresh(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO / "tests")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("module", NO_JAX_AT_IMPORT)
def test_entry_points_that_set_the_environment_import_no_jax(module):
    got = _fresh(
        f"import importlib, json, sys; importlib.import_module({module!r}); print(json.dumps('jax' in sys.modules))"
    )
    assert got is False, f"importing {module} imports JAX before its main() sets the environment"


def test_no_script_starts_jax_when_imported():
    """Every script imported in one fresh interpreter: JAX may be imported, never started."""
    scripts = sorted(m for m, p in modules().items() if is_script(p))
    code = (
        "import importlib, json, sys\n"
        f"for m in {scripts!r}: importlib.import_module(m)\n"
        "started = 'jax' in sys.modules and bool(sys.modules['jax._src.xla_bridge']._backends)\n"
        "print(json.dumps(started))"
    )
    assert _fresh(code) is False
