"""The optimizer from OptimConfig: global-norm clipping, then AdamW on a learning-rate schedule.
Weight decay applies to every parameter, as torch.optim.AdamW does in the authors' code."""

from __future__ import annotations

import optax

from sparserl_jax.rl.config import OptimConfig


def make_schedule(cfg: OptimConfig) -> optax.Schedule:
    """Learning rate as a function of the optimizer step (0-based)."""
    if cfg.schedule == "constant":
        return optax.constant_schedule(cfg.lr)
    if cfg.schedule == "warmup":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps), optax.constant_schedule(cfg.lr)],
            [cfg.warmup_steps],
        )
    if cfg.schedule == "cosine":
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0,
            peak_value=cfg.lr,
            warmup_steps=cfg.warmup_steps,
            decay_steps=cfg.total_steps,
            end_value=cfg.lr * cfg.min_lr_ratio,
        )
    raise ValueError(f"optim.schedule={cfg.schedule!r}: accepted values are constant, warmup, cosine")


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """clip_by_global_norm(grad_clip) -> AdamW(schedule, b1, b2, eps, weight_decay)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(make_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay),
    )
