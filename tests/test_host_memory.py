"""train.host_memory (sparserl_jax/host_memory.py): malloc keeps XLA:CPU's freed buffers mapped.

The effect is read from the kernel's count of minor page faults in fresh processes (the setting
acts only before JAX's backend starts): with "system" every call of a program with a 128 MiB
result faults its pages in again, with "reuse" most calls none once the heap has grown to the
calls' working set. Counts, not times."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sparserl_jax import host_memory
from sparserl_jax.config import load_config

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(REPO, "experiments", "configs", "smoke.yaml")
ROWS, COLS = 1024, 32768  # float32: 128 MiB, above every threshold glibc serves from its heaps
PAGES = ROWS * COLS * 4 // 4096
glibc_only = pytest.mark.skipif(host_memory._glibc() is None, reason="mallopt is glibc's (this C library is not)")

FAULTS = """
import json, resource, sys
from sparserl_jax import host_memory
note = host_memory.configure(sys.argv[1])
import jax, jax.numpy as jnp
x = jnp.ones(({rows}, {cols}), jnp.float32)
double = jax.jit(lambda x: x * 2)
for _ in range({warmup}):  # the heap grows to the calls' working set (its holes settle)
    jax.block_until_ready(double(x))
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range({calls}):
    y = double(x)
    assert float(y[0, 0]) == 2.0
    del y
print(json.dumps({{"note": note, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / {calls}}}))
"""


def _faults_per_call(setting: str) -> dict:
    code = FAULTS.format(rows=ROWS, cols=COLS, warmup=8, calls=12)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code, setting], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@glibc_only
def test_reuse_keeps_the_buffers_mapped_between_calls():
    system, reuse, auto = (_faults_per_call(s) for s in ("system", "reuse", "auto"))
    assert system["note"].startswith("system") and reuse["note"].startswith("reuse")
    assert auto["note"].startswith("reuse (auto)")  # JAX_PLATFORMS=cpu: the CPU is the platform
    assert system["faults"] >= 0.9 * PAGES, system  # every call pages its result in again
    # after the warm-up a call now and then still grows the heap (a freed block one alignment pad
    # short of the next request): most calls fault nothing
    assert reuse["faults"] < 0.5 * PAGES and auto["faults"] < 0.5 * PAGES, (reuse, auto)


def test_after_the_backend_started_reuse_is_an_error_and_auto_says_so(monkeypatch):
    import jax

    # a Trainer built before this worker's backend started may have applied it: as if none had
    monkeypatch.setattr(host_memory, "_applied", [])

    jax.devices()  # this test process's backend runs
    with pytest.raises(ValueError, match="train.host_memory=reuse cannot act: JAX's backend has already started"):
        host_memory.configure("reuse")
    assert host_memory.configure("auto").startswith("system (auto: JAX's backend has already started")
    assert host_memory.configure("system") == "system: glibc's defaults"


def test_the_platform_is_read_without_starting_the_backend(monkeypatch):
    assert host_memory.cpu_platform("cpu") and host_memory.cpu_platform(" cpu,tpu")
    assert not host_memory.cpu_platform("cuda,cpu") and not host_memory.cpu_platform("tpu")
    monkeypatch.setattr(host_memory, "accelerator_plugins", lambda: [])
    assert host_memory.cpu_platform("")
    monkeypatch.setattr(host_memory, "accelerator_plugins", lambda: ["libtpu"])
    assert not host_memory.cpu_platform("")


def test_a_bad_setting_is_named():
    with pytest.raises(ValueError, match="train.host_memory"):
        host_memory.configure("hugepages")
    with pytest.raises(ValueError, match="train.host_memory"):
        load_config(overrides=["train.host_memory=hugepages"])
    assert load_config().train.host_memory == "auto"


@glibc_only
def test_the_train_command_sets_it_before_the_backend_starts(tmp_path):
    """`python -m sparserl_jax.train` applies train.host_memory before the compile cache starts
    JAX's backend (a stand-in trainer: the wiring, not a run)."""
    code = f"""
from sparserl_jax import host_memory, train
seen = []
class Recorder:
    def __init__(self, cfg):
        seen.append(list(host_memory._applied))
    def run(self):
        return []
train.Trainer = Recorder
train.main(["--config", {SMOKE!r}])
assert host_memory.backend_started()
print(seen)
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "SPARSERL_COMPILE_CACHE": str(tmp_path)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the command's own cache folder: it starts the backend
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "reuse (auto)" in out.stdout.strip().splitlines()[-1], out.stdout


class _Stop(Exception):
    """Raised by a stand-in at a command's first use of JAX."""


@pytest.mark.parametrize(
    "command, first_jax, argv",
    [
        ("generate", ("hf", "load_params"), ["--checkpoint", "ckpt", "--prompt", "hi"]),
        ("evaluate", ("distributed", "join"), ["--checkpoint", "ckpt", "--task", "arithmetic"]),
    ],
)
def test_the_commands_without_a_run_config_set_it_first(command, first_jax, argv, monkeypatch):
    """generate and evaluate apply --host-memory before anything starts JAX's backend (stand-ins
    stop each command at its first use of JAX: the wiring, not a run); a bad value is argparse's."""
    import importlib

    module = importlib.import_module(f"sparserl_jax.{command}")
    seen = []

    def stop(*args, **kwargs):
        seen.append("jax")
        raise _Stop

    monkeypatch.setattr(host_memory, "configure", lambda setting: seen.append(setting) or "")
    monkeypatch.setattr(getattr(module, first_jax[0]), first_jax[1], stop)
    with pytest.raises(_Stop):
        module.main([*argv, "--host-memory", "system"])
    with pytest.raises(_Stop):
        module.main(argv)
    assert seen == ["system", "jax", "auto", "jax"]
    with pytest.raises(SystemExit):
        module.main([*argv, "--host-memory", "hugepages"])
