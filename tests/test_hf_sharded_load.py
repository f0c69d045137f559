"""A checkpoint read straight into its shards (components.build_model on a mesh, hf.load_params
with shardings): on 8 fake CPU devices no device ever holds more than its own blocks of the
params, each process reads each tensor's bytes once, in the master dtype (float32 from a bfloat16
file), and the values are the whole load's bit for bit. The worker (tests/hf_sharded_load_worker.py)
first measures the old path (the whole params on device 0, then laid out) and checks that its
meter sees it exceed the bound, so the bound can fail."""

from __future__ import annotations

import json
import pathlib

import pytest
from test_sharding import run_on_fake_devices

TESTS = pathlib.Path(__file__).parent


@pytest.mark.slow  # a process of its own on 8 fake devices: two meshes, each loaded twice
def test_checkpoint_loads_into_its_shards_on_8_devices(tmp_path):
    out = run_on_fake_devices("hf_sharded_load_worker.py", "HF_SHARDED_LOAD_OK", str(tmp_path))
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [r["mesh"] for r in rows] == [[1, 8, 1], [2, 2, 2]]
    for r in rows:  # the old path put the whole model on device 0; the new one its blocks only
        assert r["before_peak"]["0"] >= r["master_bytes"]
        assert max(r["after_peak"].values()) <= max(r["blocks"].values()) < r["master_bytes"] / 2
