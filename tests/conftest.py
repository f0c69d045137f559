"""The suite's compiler setting, its run order under pytest-xdist, and a check that its test
groups hold.

Compiler: XLA's LLVM backend at optimisation level 0 (below; docs/testing.md says what stays a
user's).

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
from importlib.metadata import version

import pytest

# Compiling is most of this suite's time (75% of test_engine's and test_sampler's), and its programs
# are small and run a few times: XLA's LLVM backend at optimisation level 0 compiles them a third
# faster (XLA's own HLO passes and the dot and reduction libraries are unchanged; the generated
# loops may round differently in the last place, which the tests' tolerances, derived from the
# computation, allow; bit-for-bit checks compare programs built with the same flags). Set before a
# test starts JAX's backend, inherited by the processes tests start (the default experiment's smoke
# test runs with a user's environment instead); a level already in XLA_FLAGS wins.
_OPT_LEVEL = "--xla_backend_optimization_level"
if _OPT_LEVEL not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_OPT_LEVEL}=0".strip()


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
