"""experiments/bench/bench_commits.py at smoke size: each side's sparserl_jax extracted from git and
imported under its own modules, the two programs alternating; the same commit on both sides gives
the same gradients bit for bit, and this process's own modules are back afterwards."""

import json
import subprocess
import sys

import pytest

import sparserl_jax
from experiments.bench import bench_commits as bc


def _head() -> str:
    out = subprocess.run(["git", "-C", bc.REPO, "rev-parse", "HEAD"], capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"not a git checkout ({out.stderr.strip()}): the benchmark extracts commits with git")
    return out.stdout.strip()


def test_the_same_commit_on_both_sides_gives_the_same_gradients(tmp_path):
    head = _head()
    own = sparserl_jax.__file__
    out = tmp_path / "bc.json"
    data = bc.main(["--base", "HEAD", "--head", head, "--smoke", "--out", str(out)])
    base, other = data["sides"]["base"], data["sides"]["head"]
    assert base["commit"] == other["commit"] == head  # both extracted from git, not this tree's files
    assert data["grad_apart"] == 0.0
    assert data["pairs"]["n"] == 3 and base["step_s"] > 0 and base["temp_bytes"] == other["temp_bytes"]
    assert sys.modules["sparserl_jax"].__file__ == own  # this process's modules restored
    assert json.loads(out.read_text())["sides"] == data["sides"]
    md = (tmp_path / "bc.md").read_text()
    assert f"| revision | HEAD ({head[:12]}) | {head} ({head[:12]}) | |" in md


def test_a_revision_git_does_not_know_is_named(tmp_path):
    _head()
    with pytest.raises(SystemExit, match="no-such-rev"):
        bc.main(["--base", "no-such-rev", "--smoke", "--out", str(tmp_path / "x.json")])
