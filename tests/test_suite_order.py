"""tests/conftest.py: the long tests start first (order kept otherwise), and a `--dist loadgroup`
run on the pytest / pytest-xdist pair that drops xdist's groups stops with one line."""

from types import SimpleNamespace

import conftest
import pytest


def _config(dist: str):
    return SimpleNamespace(option=SimpleNamespace(dist=dist))


def test_loadgroup_on_the_pair_that_drops_groups_stops(monkeypatch):
    releases = {"pytest": (9, 2), "pytest-xdist": (3, 8)}
    monkeypatch.setattr(conftest, "_release", lambda name: releases[name])
    with pytest.raises(pytest.UsageError, match=r"pytest<9\.2"):
        conftest.pytest_configure(_config("loadgroup"))
    conftest.pytest_configure(_config("no"))  # no groups asked for: nothing to lose
    releases["pytest"] = (9, 1)
    conftest.pytest_configure(_config("loadgroup"))  # the pinned pytest keeps the groups


def test_slow_tests_first_order_kept_otherwise():
    def item(name, slow, extended=False):
        marks = {m for m, on in (("slow", slow), ("extended", extended)) if on}
        return SimpleNamespace(name=name, get_closest_marker=lambda m: object() if m in marks else None)

    def config(extended):
        deselected = []
        hook = SimpleNamespace(pytest_deselected=lambda items: deselected.extend(items))
        return SimpleNamespace(getoption=lambda name: extended, hook=hook), deselected

    items = [item("a", False), item("b", True), item("c", False), item("d", True), item("e", True, True)]
    cfg, deselected = config(extended=True)
    conftest.pytest_collection_modifyitems(cfg, items)
    assert [i.name for i in items] == ["b", "d", "e", "a", "c"] and not deselected
    cfg, deselected = config(extended=False)  # the default tier: the extended tests deselected
    conftest.pytest_collection_modifyitems(cfg, items)
    assert [i.name for i in items] == ["b", "d", "a", "c"] and [i.name for i in deselected] == ["e"]
