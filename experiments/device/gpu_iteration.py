"""The device check's `iteration` step: one trainer iteration (sparserl_jax/train.py: rollout,
rewards, scoring, update) at a real config's shape with random weights, its seconds split into
compile, rollout, scoring and update.

No weights reach the device, so the model is the config's architecture (an HF config.json, as the
update step reads it) initialised at random, and the prompts are the arithmetic task's (no dataset
either): random weights answer to the cap, so the rollout decodes every row's max_new_tokens.
Where the seconds come from: experiments/lib/step_timing.py (the step's compile, the rollout's wall
and compile time), and the wall and compile seconds (compile_clock) of the learner's step and of
its scoring (pi_old, pi_ref) inside it; the update is the learner's step less its scoring (its
host-side diagnostics included). Each phase is reported without the compile inside it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import tempfile
import time

from experiments.device.gpu_report import check
from experiments.device.gpu_sizes import HERE, Sizes


def iteration_config(sizes: Sizes, out_dir: str):
    """The step's TrainConfig: sizes.iteration_configs with its overrides, no checkpoint, the
    architecture of sizes.iteration_arch (else the config's model.arch) at random init."""
    from sparserl_jax.config import load_config
    from sparserl_jax.dryrun import model_config

    overrides = [
        *sizes.iteration_overrides,
        "model.checkpoint=null",
        f"train.out_dir={out_dir}",
        "train.progress=false",
    ]
    cfg = load_config(list(sizes.iteration_configs), overrides)
    if sizes.iteration_arch:
        arch, _ = model_config(cfg, sizes.iteration_arch)
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, arch=arch))
    return cfg, overrides


def _timed_into(spent: dict, key: str, fn):
    """`fn` adding each call's wall seconds to spent[key] and the compile seconds inside it to
    spent[key + "_compile"]."""
    from sparserl_jax import compile_clock

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        since, t0 = compile_clock.Since(), time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t0
            spent[key + "_compile"] += since.seconds

    return timed


def one_iteration(cfg, record) -> dict:
    """Trainer start (the reference saved), then one Trainer.step timed by phase."""
    from experiments.lib.step_timing import timed_steps
    from sparserl_jax.train import Trainer

    t0 = time.perf_counter()
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    trainer.start()
    out = {"build_and_start_s": time.perf_counter() - t0}
    record(out)
    spent = dict.fromkeys(("learner", "learner_compile", "score", "score_compile"), 0.0)
    with timed_steps():  # installs the compile clock the wrappers read
        # the learner's step (scoring, update, diagnostics) and its scoring inside, each timed
        learner, update = trainer.learner, trainer.learner.update
        learner.step = _timed_into(spent, "learner", learner.step)
        update._score_first = _timed_into(spent, "score", update._score_first)
        t0 = time.perf_counter()
        metrics = trainer.step()
        wall_s = time.perf_counter() - t0
    trainer.state.close()
    trainer.learner.close()
    m = metrics
    rows = cfg.rollout.prompts * cfg.rollout.samples
    tokens = rows * m["response/length_mean"]
    rollout_s = m["time/rollout_wall_s"] - m["time/rollout_compile_s"]
    out.update(
        rows=rows,
        max_new_tokens=cfg.rollout.max_new_tokens,
        response_length=m["response/length_mean"],
        iteration_s=wall_s,
        compile_s=m["time/compile_s"],
        compiles=int(m["compile/count"]),
        rollout_s=rollout_s,
        rollout_compile_s=m["time/rollout_compile_s"],
        score_s=spent["score"] - spent["score_compile"],
        score_compile_s=spent["score_compile"],
        update_s=spent["learner"] - spent["score"] - (spent["learner_compile"] - spent["score_compile"]),
        update_compile_s=spent["learner_compile"] - spent["score_compile"],
        reward_s=m.get("time/reward_s", 0.0),
        rollout_tokens=tokens,
        rollout_tokens_per_s=tokens / max(rollout_s, 1e-9),
        loss=m.get("update/loss", float("nan")),
        skipped=m.get("update/skipped", 0.0),
    )
    record(out)
    return out


def step_iteration(sizes: Sizes, ctx: dict, record):
    """The check's step (module doc); the run's folder is temporary (its reference checkpoint:
    the model's master weights)."""
    work = tempfile.mkdtemp(prefix="gpu_check_iteration_")
    try:
        cfg, overrides = iteration_config(sizes, os.path.join(work, "run"))
        m = cfg.model.arch
        result = {
            "config": [os.path.relpath(c, os.path.dirname(HERE)) for c in sizes.iteration_configs],
            "overrides": overrides,
            "model": f"L={m.n_layers}, D={m.d_model}, N/K={m.n_heads}/{m.n_kv_heads}, V={m.vocab_size}",
            "dtypes": f"{m.param_dtype} master, {m.dtype} compute",
            "kv": f"{cfg.kv.policy} {cfg.kv.budget}+{cfg.kv.buffer}" if not cfg.kv.is_dense else "dense",
        }
        result.update(one_iteration(cfg, lambda r: record({**result, **r})))
        record(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    r = result
    finite = math.isfinite(r["loss"]) and r["skipped"] == 0
    checks = [
        check("the iteration finished", f"{r['iteration_s']:.1f} s", "ran", r["iteration_s"] > 0),
        check(
            "loss finite (no step skipped)", f"loss {r['loss']:.4g}, skipped {r['skipped']:.0f}", "finite, 0", finite
        ),
    ]
    lines = [
        f"Config: {' + '.join(r['config'])} with {' '.join(r['overrides'])}; random weights ({r['model']}, "
        f"{r['dtypes']}), KV {r['kv']}; {r['rows']} rows x {r['max_new_tokens']} new tokens (mean response "
        f"{r['response_length']:.0f}). Phases without their compile; compile: all of it inside the iteration.",
        "",
        "| what | seconds |",
        "|---|---|",
        f"| compile (inside the iteration: {r['compiles']} programs) | {r['compile_s']:.1f} |",
        f"| rollout ({r['rollout_tokens']:.0f} tokens, {r['rollout_tokens_per_s']:.0f} tokens/s) "
        f"| {r['rollout_s']:.2f} (+ {r['rollout_compile_s']:.1f} compile) |",
        f"| scoring (pi_old, pi_ref) | {r['score_s']:.2f} (+ {r['score_compile_s']:.1f} compile) |",
        f"| update (with its diagnostics) | {r['update_s']:.2f} (+ {r['update_compile_s']:.1f} compile) |",
        f"| rewards | {r['reward_s']:.2f} |",
        f"| the whole iteration / trainer build and start before it | {r['iteration_s']:.1f} / "
        f"{r['build_and_start_s']:.1f} |",
    ]
    figure = (
        f"compile {r['compile_s']:.0f} s, rollout {r['rollout_s']:.1f} s ({r['rollout_tokens_per_s']:.0f} tok/s), "
        f"scoring {r['score_s']:.1f} s, update {r['update_s']:.1f} s; loss {r['loss']:.3g}"
    )
    return checks, lines, figure, result
