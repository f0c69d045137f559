"""Finished runs that outlive the machine: one small JSON record per run, written (and, if asked,
committed to git) the moment the run finishes, so a study longer than one machine's lease goes on
elsewhere from what is committed.

A record holds what a results table and figure need and nothing heavy (no checkpoints): the run's
name and plan (arm, seed), its identity (figruns.config_key of the resolved config, which a later
study compares before reusing it), the resolved config, the per-iteration metrics history, its
evaluations, and provenance (the commit and tree state at the run's start, CPU model, jax version,
cores, wall time of the process that finished it). A study re-run trains only the planned runs
without a matching record (a run directory left on the same machine resumes from its checkpoint).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterable

SCHEMA = 1


def path_of(records_dir: str, name: str) -> str:
    """<records_dir>/<name with '/' as '-'>.json, e.g. naive/seed0 -> naive-seed0.json."""
    return os.path.join(records_dir, name.replace("/", "-") + ".json")


def write(records_dir: str, record: dict) -> str:
    """Write `record` (it must have "name" and "config_key") atomically; returns its path."""
    for field in ("name", "config_key"):
        if field not in record:
            raise ValueError(f"a run record needs {field!r}; got fields {sorted(record)}")
    os.makedirs(records_dir, exist_ok=True)
    path = path_of(records_dir, record["name"])
    with open(path + ".tmp", "w") as f:
        json.dump({"schema": SCHEMA, **record}, f, indent=1, default=float)
        f.write("\n")
    os.replace(path + ".tmp", path)
    return path


def read(records_dir: str, name: str, config_key: str | None = None) -> dict | None:
    """The record of run `name`, or None when there is none or (given `config_key`) it records
    another configuration than the one planned now."""
    path = path_of(records_dir, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        record = json.load(f)
    if record.get("schema") != SCHEMA:
        raise ValueError(f"{path}: record schema {record.get('schema')!r}, this code reads {SCHEMA}")
    if config_key is not None and record["config_key"] != config_key:
        return None
    return record


def missing(records_dir: str, planned: Iterable[tuple[str, str]]) -> list[str]:
    """The names of the planned (name, config_key) runs that have no matching record."""
    return [name for name, key in planned if read(records_dir, name, key) is None]


def adopt(records_dir: str, planned: Iterable[tuple[str, str]], others: Iterable[str]) -> list[str]:
    """Copy into `records_dir` each planned (name, config_key) run it lacks whose record another
    study holds in one of the `others` folders with the same name and identity (the same resolved
    config is the same run, whichever plan asked for it); the copy names its source in
    "adopted_from". Returns the paths written."""
    written = []
    others = [o for o in others if os.path.abspath(o) != os.path.abspath(records_dir)]
    for name, key in planned:
        if read(records_dir, name, key) is not None:
            continue
        for other in others:
            record = read(other, name, key)
            if record is not None:
                record.pop("schema")
                source = os.path.relpath(path_of(other, name), os.path.dirname(os.path.abspath(records_dir)))
                written.append(write(records_dir, {**record, "adopted_from": source}))
                break
    return written


def commit(path: str, message: str) -> bool:
    """Commit the record at `path` alone, in the git checkout that holds it (other staged or
    unstaged changes stay as they are; a study may run from a clean checkout of its commit and
    write its records into another).
    Returns whether a commit was made; a failure (no git, nothing to commit) is printed, not raised:
    the record is on disk either way."""
    folder, name = os.path.split(os.path.abspath(path))  # git of the checkout that holds the record
    detail = ""
    for attempt in range(5):  # another process may hold the index for a moment
        try:
            subprocess.run(
                ["git", "add", "--", name], cwd=folder, check=True, capture_output=True, text=True, timeout=60
            )
            subprocess.run(
                ["git", "commit", "-q", "-m", message, "--only", "--", name],
                cwd=folder,
                check=True,
                capture_output=True,
                text=True,
                timeout=60,
            )
            return True
        except (OSError, subprocess.SubprocessError) as e:
            detail = (getattr(e, "stderr", "") or str(e)).strip()
            if "index.lock" not in detail:
                break
            time.sleep(2.0 * (attempt + 1))
    print(f"record {path} not committed: {detail}", flush=True)
    return False
