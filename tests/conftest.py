"""The suite's compiler setting, its run order under pytest-xdist, and a check that its test
groups hold.

Compiler: XLA's LLVM backend at optimisation level 0 and its classic fusion emitters (below;
docs/testing.md says what stays a user's).

Order: the long tests (marked `slow`) start first. xdist hands tests to its workers in
collection order (the `xdist_group` groups first, the largest before the smaller); a long test
collected last leaves the other worker idle while it runs, while starting the long ones first
lets the short ones fill the gaps, so the workers finish together. Only the order changes: no
test depends on another having run.

Groups: tests marked `xdist_group(name)` share compiled programs (or a compilation cache) on one
worker. xdist tells a group by a suffix it writes into each node id; pytest 9.2 keeps node ids
elsewhere and drops the suffix, so every group silently splits over the workers and compiles
its programs twice (requirements-test.txt pins pytest below 9.2); with that pair installed the
run stops at once and says so.
"""

import os
import subprocess
import sys
from importlib.metadata import version

import pytest

from sparserl_jax.cli import COMPILE_CACHE_ENV

# Compiling is most of this suite's time (80% of test_train's, test_rl_bucketed's and test_sampler's),
# and its programs are small and run a few times. Two XLA settings compile them faster:
# - the LLVM backend at optimisation level 0 (a third faster);
# - XLA CPU's classic loop emitters for fusions instead of its MLIR fusion emitters (the three
#   modules above: 366 -> 113 s of compiling, 467 -> 204 s in all, on an AMD Zen 3).
# XLA's own HLO passes and the dot and reduction libraries are unchanged; the generated loops may
# round differently in the last place, which the tests' tolerances, derived from the computation,
# allow; bit-for-bit checks compare programs built with the same flags. Set before a test starts
# JAX's backend, inherited by the processes tests start (pytest-xdist's workers included; the
# default experiment's smoke test runs with a user's environment instead); a setting already in
# XLA_FLAGS wins, and one this XLA does not know is left out (XLA stops at an unknown flag).
# name -> (the suite's value, XLA's default: what a user's program gets)
TEST_XLA_SETTINGS = {"xla_backend_optimization_level": (0, 3), "xla_cpu_use_fusion_emitters": (False, True)}
TEST_XLA_FLAGS = tuple(f"--{name}={str(test).lower()}" for name, (test, _) in TEST_XLA_SETTINGS.items())


def _known_to_xla(flags: list[str]) -> bool:
    """Whether a JAX process starts its CPU backend with `flags` in XLA_FLAGS."""
    env = {**os.environ, "XLA_FLAGS": " ".join(flags), "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0


def _add_test_xla_flags() -> None:
    given = os.environ.get("XLA_FLAGS", "").split()
    names = {f.split("=", 1)[0] for f in given}
    wanted = [f for f in TEST_XLA_FLAGS if f.split("=", 1)[0] not in names]
    if not wanted:
        return  # set already (an xdist worker inherits its controller's)
    if not _known_to_xla(given + wanted):
        wanted = [f for f in wanted if _known_to_xla(given + [f])]
    os.environ["XLA_FLAGS"] = " ".join(given + wanted)


_add_test_xla_flags()

# No test writes to a user's home: the training CLI's persistent compilation cache
# (train.compile_cache, sparserl_jax/cli.py) is off here and in the processes tests start; a test
# that wants one names its folder in JAX_COMPILATION_CACHE_DIR (tests/compile_cache.py), which wins.
os.environ[COMPILE_CACHE_ENV] = ""


def _release(name: str) -> tuple[int, ...]:
    return tuple(int(p) for p in version(name).split(".")[:2] if p.isdigit())


def pytest_configure(config):
    if (
        getattr(config.option, "dist", "no") == "loadgroup"
        and _release("pytest") >= (9, 2)
        and _release("pytest-xdist") <= (3, 8)
    ):
        raise pytest.UsageError(
            f"--dist loadgroup: pytest {version('pytest')} drops pytest-xdist {version('pytest-xdist')}'s "
            "test groups (every xdist_group would split over the workers); install the pinned pytest "
            "(requirements-test.txt: pytest<9.2)"
        )


@pytest.fixture(scope="session")
def user_compiler() -> dict:
    """compiler_options for `Lowered.compile` that give a program the compiler a user's gets: XLA's
    defaults for the settings above that are in force (tests that check the compiled program)."""
    given = {f.split("=", 1)[0].lstrip("-") for f in os.environ.get("XLA_FLAGS", "").split()}
    return {name: default for name, (_, default) in TEST_XLA_SETTINGS.items() if name in given}


def pytest_addoption(parser):
    parser.addoption(
        "--extended",
        action="store_true",
        help="also run the extended tier: end-to-end tests whose code paths the default tier covers "
        "more cheaply (docs/testing.md#two-tiers); CI runs the default tier",
    )


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--extended"):
        extended = [item for item in items if item.get_closest_marker("extended") is not None]
        if extended:
            config.hook.pytest_deselected(items=extended)
            items[:] = [item for item in items if item.get_closest_marker("extended") is None]
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: order kept within each
