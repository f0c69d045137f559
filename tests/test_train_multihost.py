"""The trainer and the evaluator across processes: `python -m sparserl_jax.train` (with
train.eval_every) and `python -m sparserl_jax.evaluate` as two processes (gloo over 127.0.0.1,
2 fake CPU devices each) on one global data 2 x fsdp 2 mesh give the same per-iteration metrics,
evaluation accuracy included, and the same evaluation samples as one process on 4 fake devices
with the same mesh shape."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from test_multihost import free_port, wait_all

ROOT = pathlib.Path(__file__).parent.parent
TIMEOUT_S = 400  # a hung collective fails the test instead of hanging it
TIMING = ("time/", "throughput/")
# smoke.yaml, smaller: 8 rows, one prompt width (one compile per function), an entropy bonus so
# the update moves the weights although the 2-step warm start earns no reward yet
OVERRIDES = [
    "train.progress=false",
    "train.iterations=2",
    "train.save_every=2",
    "mesh.data=2",
    "mesh.fsdp=2",
    "rollout.prompts=2",
    "data.max_prompt_len=16",
    "sft.steps=2",
    "data.task_options.max_value=1",
    "rl.loss.entropy_coef=0.01",
    "train.eval_every=2",
    "train.eval_prompts=6",
]
# 5 prompts x 2 samples: 10 rows, padded to a multiple of data x fsdp = 4 on the mesh
EVALUATE = [
    "--task",
    "arithmetic",
    "--n",
    "5",
    "--k",
    "2",
    "--max-new-tokens",
    "8",
    "--batch-size",
    "10",
    "--temperature",
    "1.0",
]


def _env(devices: int, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "device_count" not in f]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    env["JAX_PLATFORMS"] = "cpu"
    return {**env, **extra}


def _train(out_dir: pathlib.Path, env: dict) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "sparserl_jax.train",
        "--config",
        str(ROOT / "experiments/configs/smoke.yaml"),
        f"train.out_dir={out_dir}",
        *OVERRIDES,
    ]
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _evaluate(run_dir: pathlib.Path, out_json: pathlib.Path, env: dict) -> subprocess.Popen:
    argv = [
        sys.executable,
        "-m",
        "sparserl_jax.evaluate",
        "--checkpoint",
        str(run_dir),
        *EVALUATE,
        "--output-json",
        str(out_json),
    ]
    return subprocess.Popen(argv, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _metrics(out_dir: pathlib.Path) -> list[dict]:
    with open(out_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.mark.extended
@pytest.mark.slow
@pytest.mark.xdist_group("multihost")
def test_two_process_training_matches_one_process(tmp_path):
    port = free_port()
    procs = [
        _train(tmp_path / "one", _env(4)),  # the single-process reference, alongside
        *(
            _train(
                tmp_path / "two",
                _env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
            )
            for i in range(2)
        ),
    ]
    outputs = wait_all(procs, TIMEOUT_S)
    failed = [(i, e) for i, (p, (_, e)) in enumerate(zip(procs, outputs)) if p.returncode]
    assert not failed, "\n".join(f"process {i}:\n{e[-5000:]}" for i, e in failed)

    one, two = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [r["step"] for r in two] == [1, 2]  # written once, by process 0
    assert two[-1]["update/grad_norm"] > 0 and "eval/accuracy" in two[-1]
    for r1, r2 in zip(one, two):
        assert r1.keys() == r2.keys()
        for k in r1:
            np.testing.assert_allclose(r2[k], r1[k], rtol=1e-5, atol=1e-5, err_msg=k)
    assert (tmp_path / "two" / "config.yaml").exists()
    assert sorted(os.listdir(tmp_path / "two" / "checkpoints")) == ["2"]
    assert "sft step 2/2" in outputs[1][0] + outputs[1][1]  # process 0 logs,
    assert "sft step" not in outputs[2][0] + outputs[2][1]  # process 1 does not

    # python -m sparserl_jax.evaluate on the trained run: two processes equal one
    port = free_port()
    procs = [
        _evaluate(tmp_path / "two", tmp_path / "one.json", _env(4)),
        *(
            _evaluate(
                tmp_path / "two",
                tmp_path / "two.json",
                _env(2, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i)),
            )
            for i in range(2)
        ),
    ]
    outputs = wait_all(procs, TIMEOUT_S)
    failed = [(i, e) for i, (p, (_, e)) in enumerate(zip(procs, outputs)) if p.returncode]
    assert not failed, "\n".join(f"process {i}:\n{e[-5000:]}" for i, e in failed)
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert len(two["samples"]) == 10 and two["n_prompts"] == 5
    assert [s["response"] for s in two["samples"]] == [s["response"] for s in one["samples"]]
    for k in ("accuracy", "mean_length", "kv_saving"):  # count ratios of the same responses
        np.testing.assert_allclose(two[k], one[k], rtol=1e-6, err_msg=k)
    assert "avg@2" in outputs[1][0] and "avg@2" not in outputs[2][0]  # process 0 reports
