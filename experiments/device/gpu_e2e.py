"""The device check's end-to-end step: the default experiment's config at smoke size trained with a
checkpoint every iteration, evaluated, stopped and resumed (its metrics compared with the
uninterrupted run's), then `python experiments/default.py --smoke` in what is left of the budget."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import jax

from experiments.device import gpu_report
from experiments.device.gpu_report import check
from experiments.device.gpu_sizes import DEFAULT_CONFIG, HERE, Sizes
from experiments.lib.figstats import untimed


def resume_check(overrides, work: str, record) -> dict:
    """The default experiment's config at smoke size: a run of n iterations with a checkpoint
    after every one, evaluated under sparse and dense inference; then a copy of it that lost its
    last checkpoint (killed after logging iteration n, before saving it) resumes from iteration
    n - 1, and its iteration n is compared with the uninterrupted run's."""
    from jax.experimental.compilation_cache import compilation_cache

    from sparserl_jax.config import load_config
    from sparserl_jax.metrics_log import read_metrics
    from sparserl_jax.train import Trainer

    compilation_cache.reset_cache()  # the resumed trainer's programs are the first one's: loaded
    jax.config.update("jax_compilation_cache_dir", os.path.join(work, "compile_cache"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)

    def cfg(run: str):
        return load_config(
            [DEFAULT_CONFIG],
            [*overrides, f"train.out_dir={os.path.join(work, run)}", "train.progress=false", "train.save_every=1"],
        )

    base = cfg("a")
    n = base.train.iterations
    t0 = time.perf_counter()
    trainer = Trainer(base, log=lambda *a, **k: None)
    trainer.run()
    dense_kv = dataclasses.replace(base.kv, policy="none")
    evals = {
        "sparse": trainer.evaluate(n=base.train.eval_prompts)["accuracy"],
        "dense": trainer.evaluate(kv_cfg=dense_kv, n=base.train.eval_prompts)["accuracy"],
    }
    first_s = time.perf_counter() - t0
    record({"uninterrupted_s": first_s, "evaluation": evals})
    shutil.copytree(os.path.join(work, "a"), os.path.join(work, "b"))
    shutil.rmtree(os.path.join(work, "b", "checkpoints", str(n)))
    t0 = time.perf_counter()
    logged = []
    Trainer(cfg("b"), log=lambda *a, **k: logged.append(" ".join(map(str, a)))).run()
    resumed_s = time.perf_counter() - t0
    a, b = ([untimed(r) for r in read_metrics(os.path.join(work, run))] for run in ("a", "b"))
    diffs = {
        k: abs(b[-1][k] - a[-1][k]) / max(abs(a[-1][k]), 1e-12)
        for k in a[-1]
        if isinstance(a[-1][k], (int, float)) and k in b[-1]
    }
    worst = max(diffs, key=diffs.get) if diffs else None
    return {
        "iterations": n,
        "steps_a": [r["step"] for r in a],
        "steps_b": [r["step"] for r in b],
        "resumed_line": next((s for s in logged if "resumed" in s), None),
        "evaluation": evals,
        "max_rel_diff": diffs.get(worst, 0.0),
        "worst_metric": worst if diffs.get(worst) else None,
        "metrics_compared": len(diffs),
        "uninterrupted_s": first_s,
        "resumed_s": resumed_s,
        "eval_prompts": base.train.eval_prompts,
        "kv": f"{base.kv.policy} {base.kv.budget}+{base.kv.buffer}",
    }


def summarise_default(out: str) -> dict:
    """Per arm: dense / sparse accuracy and the train rollouts' KV saving, from a default
    experiment's results.json; the warm start's accuracies."""
    with open(os.path.join(out, "results.json")) as f:
        data = json.load(f)
    arms = {
        arm: {k: [r[k] for r in rows] for k in ("dense_acc", "sparse_acc", "train_kv_saving")}
        for arm, rows in data["per_seed"].items()
    }
    return {"arms": arms, "warm_starts": data["warm_starts"], "wall_s": (data.get("provenance") or {}).get("wall_s")}


def run_killing_group(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
    """(exit code or None past `timeout`, the output's tail) of `cmd` run in its own process
    group, all of which (its worker processes too) is killed past the timeout."""
    proc = subprocess.Popen(
        cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
        return proc.returncode, output[-2000:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        return None, (output or "")[-2000:] + f"\ntimed out after {timeout:.0f} s"


def step_e2e(sizes: Sizes, ctx: dict, record):
    """Training, evaluation, checkpoint and resume of the default experiment at smoke size."""
    overrides = sizes.e2e_overrides
    if overrides is None:  # what `python experiments/default.py --smoke` sets
        from experiments.lib import figlib

        overrides = (*figlib.smoke_overrides(DEFAULT_CONFIG), "train.iterations=2")
    work = tempfile.mkdtemp(prefix="gpu_check_e2e_")
    result = {"resume": resume_check(overrides, work, lambda r: record({"resume": r}))}
    record(result)
    r = result["resume"]
    checks = [
        check(
            "the copy resumes from its last checkpoint and logs every iteration once",
            f"steps {r['steps_b']} vs {r['steps_a']}",
            "equal",
            r["steps_a"] == r["steps_b"],
        ),
        check(
            "resumed iteration's metrics vs the uninterrupted run's (max relative difference)",
            f"{r['max_rel_diff']:.2e}" + (f" ({r['worst_metric']})" if r["worst_metric"] else ""),
            "<= 1e-5",
            r["max_rel_diff"] <= 1e-5,
        ),
    ]
    resumed = r["resumed_line"] or "no 'resumed' line logged"
    lines = [
        f"walk_key_rkv.yaml ({r['kv']}) with {' '.join(overrides)}: {r['iterations']} iterations "
        f"with a checkpoint after each, then evaluated on {r['eval_prompts']} prompts "
        f"({r['uninterrupted_s']:.0f} s): "
        f"dense inference {r['evaluation']['dense']:.3f}, sparse {r['evaluation']['sparse']:.3f}. "
        "A copy without "
        f"its last checkpoint resumed ({r['resumed_s']:.0f} s; {resumed}); {r['metrics_compared']} metrics of "
        f"iteration {r['iterations']} compared."
    ]
    figure = (
        f"resume {'exact' if checks[1]['passed'] else 'DIFFERS'} (max rel. diff {r['max_rel_diff']:.1e}); "
        f"eval dense {r['evaluation']['dense']:.2f} / sparse {r['evaluation']['sparse']:.2f}"
    )
    if sizes.run_default:
        out = os.path.join(ctx["out"], "e2e", "default")
        cmd = [
            sys.executable,
            os.path.join(HERE, "default.py"),
            "--smoke",
            "--seeds",
            "0",
            "--warm-starts",
            "0",
            "--out",
            out,
            "--runs-dir",
            os.path.join(work, "runs"),
        ]
        left = ctx["deadline"] - time.time() - 5
        env = {
            **os.environ,
            "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # its arms share the device
            # and load the programs the resume check compiled (the same config and shapes)
            "JAX_COMPILATION_CACHE_DIR": os.path.join(work, "compile_cache"),
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
        }
        t0 = time.perf_counter()
        rc, tail = run_killing_group(cmd, env, max(left, 1))
        seconds = time.perf_counter() - t0
        ok = rc == 0 and os.path.exists(os.path.join(out, "results.json"))
        last = tail.splitlines()[-1] if tail.strip() else ""
        default = {
            "command": " ".join(cmd[1:]),
            "returncode": rc,
            "seconds": seconds,
            **(summarise_default(out) if ok else {"error": gpu_report.one_line(last)}),
        }
        result["default"] = default
        if rc is None:  # out of the check's time: a budget to revise, not a wrong result
            checks.append(
                check(
                    "python experiments/default.py --smoke --seeds 0 --warm-starts 0 finishes",
                    f"killed after {seconds:.0f} s",
                    "within the step's budget",
                    False,
                    kind="goal",
                )
            )
        else:
            checks.append(
                check(
                    "python experiments/default.py --smoke --seeds 0 --warm-starts 0",
                    f"exit {rc}",
                    "0, results.json written",
                    ok,
                )
            )
        if ok:
            lines += [
                "",
                f"`{default['command']}`: {seconds:.0f} s; results in e2e/default/results.md.",
                "",
                "| arm | dense acc | sparse acc | train KV saving |",
                "|---|---|---|---|",
            ]
            lines += [
                f"| {arm} | {v['dense_acc'][0]:.3f} | {v['sparse_acc'][0]:.3f} | {v['train_kv_saving'][0]:.1%} |"
                for arm, v in default["arms"].items()
            ]
            figure += f"; default --smoke {seconds:.0f} s, 3 arms trained and evaluated"
        else:
            lines += ["", f"`{default['command']}` failed ({default['error']}); its output: steps/e2e.log"]
            print(tail)
    else:
        lines += [
            "",
            "`python experiments/default.py --smoke` is not run at this size (minutes of CPU: "
            "tests/test_experiments.py runs it).",
        ]
    shutil.rmtree(work, ignore_errors=True)
    return checks, lines, figure, result
