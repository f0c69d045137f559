"""The package as a user installs it (`pip install .`, `pip install git+<url>`): the wheel built
from the source tree holds every module of it, and every module imports from a fresh virtual
environment, run from outside the checkout. An editable install (what CI and development use)
would hide a package the wheel leaves out, so this builds and installs a real wheel."""

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# what a build reads: the metadata, setup.py's package discovery and the three source folders
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "requirements.txt", "sparserl_jax", "kernels", "experiments")
# the folder of each package in the source tree (kernels/ installs as sparserl_jax.kernels)
ROOTS = {
    "sparserl_jax": REPO / "sparserl_jax",
    "sparserl_jax.kernels": REPO / "kernels",
    "experiments": REPO / "experiments",
}
CHECKOUT_ONLY = "experiments.figures"  # setup.py keeps the figure scripts out of the wheel


def module_names(roots: dict[str, Path]) -> list[str]:
    """Dotted names of the modules in each folder tree (a package by its __init__'s name)."""
    names = set()
    for package, root in roots.items():
        for path in root.rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            parts = parts[:-1] if parts[-1] == "__init__" else parts
            names.add(".".join((package, *parts)))
    return sorted(names)


def wheel_module_names() -> list[str]:
    """The source tree's modules the wheel holds: all but the checkout-only figure scripts."""
    return [n for n in module_names(ROOTS) if n != CHECKOUT_ONLY and not n.startswith(CHECKOUT_ONLY + ".")]


# Run by the fresh environment's python in isolated mode (-I: neither the working directory nor
# PYTHONPATH on sys.path): import every module the installed package holds, say where it came from.
IMPORT_EVERY_MODULE = r"""
import importlib, json, pathlib, sys, traceback
import experiments, sparserl_jax
names = set()
for package in (sparserl_jax, experiments):
    root = pathlib.Path(package.__file__).parent
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).with_suffix("").parts
        names.add(".".join((package.__name__, *(parts[:-1] if parts[-1] == "__init__" else parts))))
names = sorted(names)
files, failed = {}, {}
for name in names:
    try:
        files[name] = importlib.import_module(name).__file__
    except BaseException:
        failed[name] = traceback.format_exc(limit=1).strip().splitlines()[-1]
print(json.dumps({"names": names, "files": files, "failed": failed, "sys_path": sys.path}))
"""


def test_module_names_of_a_tree(tmp_path):
    """The source-tree listing the install test compares with: packages by their __init__."""
    (tmp_path / "a" / "b").mkdir(parents=True)
    for f in ("a/__init__.py", "a/x.py", "a/b/__init__.py", "a/b/__main__.py", "a/notes.txt"):
        (tmp_path / f).write_text("")
    assert module_names({"p": tmp_path / "a"}) == ["p", "p.b", "p.b.__main__", "p.x"]
    assert "sparserl_jax.kernels.sharded" in module_names(ROOTS)
    assert "sparserl_jax.quant.config" in module_names(ROOTS)
    assert "experiments.real.measure" in module_names(ROOTS)


@pytest.mark.slow
def test_wheel_installs_every_module(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns(
        "__pycache__", "*.pyc", "*.egg-info", "build", "results"
    )  # not experiments' results
    for name in BUILD_INPUTS:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)

    def run(*cmd, cwd=tmp_path):
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (cmd, proc.stdout[-3000:], proc.stderr[-3000:])
        return proc.stdout

    # no build isolation: the test environment's setuptools builds it, nothing is downloaded
    run(
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp_path / "dist"),
        "./src",
    )
    (wheel,) = (tmp_path / "dist").glob("sparserl_jax-*.whl")
    # A fresh environment whose dependencies (jax, flax, ...) are the test environment's: its
    # site-packages added as a plain path, so the editable install's import hook there never runs.
    env = tmp_path / "env"
    run(sys.executable, "-m", "venv", "--without-pip", str(env))
    python = env / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    site = Path(run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip())
    (site / "test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel))

    out = tmp_path / "elsewhere"  # the working directory: neither the checkout nor the build copy
    out.mkdir()
    got = json.loads(run(str(python), "-I", "-c", IMPORT_EVERY_MODULE, cwd=out).splitlines()[-1])
    assert not [p for p in got["sys_path"] if p and Path(p).resolve() in (REPO, src)]
    assert got["names"] == wheel_module_names(), "the wheel's modules differ from the source tree's"
    assert "experiments.lib.figlib" in got["names"] and "experiments.figures.fig_b_budget" not in got["names"]
    assert got["failed"] == {}, got["failed"]
    outside = {n: f for n, f in got["files"].items() if not Path(f).resolve().is_relative_to(site.resolve())}
    assert outside == {}, f"imported from outside the installed wheel: {outside}"
