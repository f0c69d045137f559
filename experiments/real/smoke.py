"""What the real-model scripts share to run on a tiny checkpoint in seconds (their --smoke, the
tests), and the real-model config loaded from any working directory. Imports no JAX (the
benchmarks import it before they set the CPU settings JAX reads when it starts)."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAT_ARITHMETIC = os.path.join(REPO, "experiments", "configs", "real", "smollm2_chat_arithmetic.yaml")

# A rollout batch of 2 prompts x 2 samples, learned in micro-batches of 2, with the prompts' width
# the tiny checkpoint's char tokenizer needs.
SMOKE_BATCH = (
    "rollout.prompts=2",
    "rollout.samples=2",
    "data.max_prompt_len=160",
    "rl.update.minibatch_size=4",
    "rl.update.micro_batch_size=2",
    "rl.update.score_batch_size=4",
)


def load_real_config(overrides: list[str], config: str = CHAT_ARITHMETIC):
    """`config` with `overrides` (a TrainConfig); a model.checkpoint relative to the repository
    (the configs' checkpoints/...) made absolute, so a script runs from any directory."""
    from sparserl_jax.config import load_config

    cfg = load_config([config], overrides)
    if cfg.model.checkpoint and not os.path.isabs(cfg.model.checkpoint):
        cfg = load_config([config], [*overrides, f"model.checkpoint={os.path.join(REPO, cfg.model.checkpoint)}"])
    return cfg
