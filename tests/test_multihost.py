"""sparserl_jax.distributed: two local processes (gloo over 127.0.0.1, 4 fake CPU devices each)
run the sharded model over one global 2x2x2 mesh and match a single-process reference; the
single-process behaviour of initialize and the data-loading helpers is checked in-process."""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

from sparserl_jax import distributed
from sparserl_jax.model import sharding as shd

TESTS = pathlib.Path(__file__).parent
TIMEOUT_S = 240  # a hung collective fails the test instead of hanging it
GLOO_MISSING = re.compile(r"gloo\W.*(not (available|supported|implemented|built)|unavailable)", re.I)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(procs: list[subprocess.Popen], timeout_s: int = TIMEOUT_S) -> list[tuple[str, str]]:
    """(stdout, stderr) of every process. A run that hangs past `timeout_s` fails the test; one
    whose jaxlib lacks gloo CPU collectives skips it."""
    try:
        outputs = [p.communicate(timeout=timeout_s) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        logs = [p.communicate() for p in procs]
        pytest.fail(f"multi-process run hung past {timeout_s} s:\n" + "\n".join(e[-3000:] for _, e in logs))
    failed = [e for p, (_, e) in zip(procs, outputs) if p.returncode]
    if failed and any(GLOO_MISSING.search(e) for e in failed):
        pytest.skip("this jaxlib has no gloo CPU collectives: " + failed[0][-500:])
    return outputs


def test_two_processes_match_single_process_reference():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=4"])
    env["JAX_PLATFORMS"] = "cpu"
    port, n = free_port(), 2
    procs = [
        subprocess.Popen(
            [sys.executable, str(TESTS / "multihost_worker.py"), str(i), str(n), str(port)],
            env=env,
            cwd=TESTS,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(n)
    ]
    outputs = wait_all(procs)
    failed = [(i, o, e) for i, (p, (o, e)) in enumerate(zip(procs, outputs)) if p.returncode]
    assert not failed, "\n".join(f"process {i}:\n{o[-2000:]}\n{e[-5000:]}" for i, o, e in failed)

    rows = []
    for i, (out, _) in enumerate(outputs):
        assert f"MULTIHOST_WORKER_OK {i}" in out, out
        start, stop = map(int, re.search(rf"ROWS {i} (\d+) (\d+)", out).groups())
        rows.extend(range(start, stop))
    assert sorted(rows) == [0, 1, 2, 3]  # the processes load disjoint rows covering the batch


def test_initialize_is_a_noop_without_a_coordinator(monkeypatch):
    for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(var, raising=False)
    assert distributed.initialize() is False
    assert distributed.initialize(num_processes=1) is False
    assert not jax.distributed.is_initialized()
    assert distributed.process_count() == 1 and distributed.process_index() == 0
    assert distributed.is_coordinator()
    distributed.sync("single process: no barrier needed")


def test_initialize_names_missing_or_bad_settings(monkeypatch):
    for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"num_processes=2 needs a coordinator"):
        distributed.initialize(num_processes=2)
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "127.0.0.1:1")
    with pytest.raises(ValueError, match=r"num_processes=None and process_id=None"):
        distributed.initialize()
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "2")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "2")
    with pytest.raises(ValueError, match=r"process_id=2 must be in \[0, num_processes=2\)"):
        distributed.initialize()
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "zero")
    with pytest.raises(ValueError, match=r"JAX_PROCESS_ID='zero' must be an integer"):
        distributed.initialize()
    assert not jax.distributed.is_initialized()


def _record_initialize(monkeypatch, error: Exception | None = None) -> list:
    """Replace jax.distributed.initialize by a recorder of its (args, kwargs): nothing joins."""
    calls = []

    def fake(*args, **kwargs):
        calls.append((args, kwargs))
        if error is not None:
            raise error

    monkeypatch.setattr(jax.distributed, "initialize", fake)
    monkeypatch.setattr(jax.distributed, "is_initialized", lambda: False)
    return calls


def test_distributed_auto_calls_jax_initialize_with_no_arguments(monkeypatch):
    """--distributed auto: jax.distributed.initialize() with no arguments, JAX's cluster detection
    filling in coordinator, process count and id (the variables, even when set, are not read);
    off a cluster, an error naming the flag and the explicit alternative."""
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "10.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "4")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "2")
    calls = _record_initialize(monkeypatch)
    assert distributed.join("auto") is True
    assert calls == [((), {})]
    _record_initialize(monkeypatch, ValueError("coordinator_address should be defined."))
    with pytest.raises(ValueError, match=r"--distributed auto: JAX detected no cluster .* use --distributed env"):
        distributed.join("auto")
    with pytest.raises(ValueError, match=r"--distributed='slurm': accepted values are \('env', 'auto'\)"):
        distributed.join("slurm")


def test_distributed_env_reads_the_three_variables_as_before(monkeypatch):
    """--distributed env (the default): initialize() as before, the coordinator, process count and
    id from the three variables, and a single process (no call) without them."""
    calls = _record_initialize(monkeypatch)
    for var in (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID):
        monkeypatch.delenv(var, raising=False)
    assert distributed.join() is False and distributed.join("env") is False and calls == []
    monkeypatch.setenv(distributed.ENV_COORDINATOR, "10.0.0.1:1234")
    monkeypatch.setenv(distributed.ENV_NUM_PROCESSES, "4")
    monkeypatch.setenv(distributed.ENV_PROCESS_ID, "2")
    assert distributed.join("env") is True
    assert calls == [
        (
            (),
            dict(
                coordinator_address="10.0.0.1:1234",
                num_processes=4,
                process_id=2,
                local_device_ids=None,
                initialization_timeout=300,
            ),
        )
    ]


@pytest.mark.parametrize("entry", ["train", "evaluate"])
def test_entry_points_pass_their_distributed_flag(entry, monkeypatch, capsys):
    """python -m sparserl_jax.train / evaluate --distributed {env,auto}: the mode reaches join
    before anything else runs (default env); another value is refused with the accepted ones."""
    import importlib

    module = importlib.import_module(f"sparserl_jax.{entry}")
    modes = []

    class Joined(Exception):
        pass

    def fake_join(mode="env"):
        modes.append(mode)
        raise Joined

    monkeypatch.setattr(distributed, "join", fake_join)
    base = ["--checkpoint", "unused"] if entry == "evaluate" else []
    for flags, mode in (([], "env"), (["--distributed", "auto"], "auto"), (["--distributed", "env"], "env")):
        with pytest.raises(Joined):
            module.main(base + flags)
        assert modes[-1] == mode
    with pytest.raises(SystemExit):
        module.main(base + ["--distributed", "slurm"])
    assert "invalid choice: 'slurm' (choose from" in capsys.readouterr().err


def test_single_process_batch_helpers():
    mesh = shd.make_mesh(shd.MeshConfig())
    assert distributed.local_batch_slice(mesh, 6) == slice(0, 6)
    local_BxT = np.asarray(jax.random.randint(jax.random.key(4), (6, 3), 0, 100))
    batch = distributed.host_local_to_global({"tokens": local_BxT}, mesh)
    assert batch["tokens"].sharding.is_equivalent_to(shd.data_sharding(mesh), 2)
    np.testing.assert_array_equal(distributed.to_host(batch)["tokens"], local_BxT)
