"""Owns the supervised warm start: a task's ideal responses taught before RL (cross-entropy).
Must not touch RL state: no optimizer state, pi_ref, checkpoints or rollouts of the RL run.

Cross-entropy on response tokens only, so that RL starts from a policy that sometimes succeeds.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from sparserl_jax import components
from sparserl_jax.config import SFTConfig, TrainConfig
from sparserl_jax.model import transformer
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.tokenizer import Tokenizer


def demonstration_batch(
    task, tokenizer: Tokenizer, rng: np.random.Generator, n: int, width: int, render: Callable[[str], str] | None = None
):
    """[n, width] tokens (prompt + ideal response + EOS, right-padded) and the response mask
    aligned with token_logprobs (position t scores tokens[t + 1]). `render` turns a task prompt
    into the text the sampler sees (e.g. wrapped in the chat template); default: as is."""
    eos = tokenizer.eos_token_ids[0]
    tokens = np.full((n, width), tokenizer.pad_token_id, np.int32)
    mask = np.zeros((n, width), bool)
    for i, (prompt, _) in enumerate(task.sample(rng, n)):
        p = tokenizer.encode(render(prompt) if render else prompt)
        r = tokenizer.encode(task.demonstration(prompt, rng=rng)) + [eos]
        seq = (p + r)[:width]
        tokens[i, : len(seq)] = seq
        mask[i, len(p) - 1 : len(seq) - 1] = True
    return tokens, mask


def sft_warm_start(
    params,
    model_cfg: ModelConfig,
    task,
    tokenizer: Tokenizer,
    cfg: SFTConfig,
    *,
    seed: int,
    width: int,
    curriculum_task=None,
    curriculum_width: int = 0,
    render: Callable[[str], str] | None = None,
    log=print,
):
    """cfg.curriculum.steps AdamW steps on `curriculum_task` (demonstrations `curriculum_width`
    wide), if any, then cfg.steps on `task`; returns (params, last loss). `render`: see
    demonstration_batch."""
    loss = float("nan")
    if cfg.curriculum.steps:
        if curriculum_task is None or curriculum_width <= 0:
            raise ValueError("sft.curriculum.steps > 0 needs the curriculum's task and width")
        params, loss = _sft_phase(
            params,
            model_cfg,
            curriculum_task,
            tokenizer,
            cfg,
            cfg.curriculum.steps,
            rng_stream=(seed, 20_000_003),
            width=curriculum_width,
            name="sft curriculum",
            render=render,
            log=log,
        )
    if cfg.steps:
        params, loss = _sft_phase(
            params,
            model_cfg,
            task,
            tokenizer,
            cfg,
            cfg.steps,
            rng_stream=(seed, 10_000_019),
            width=width,
            name="sft",
            render=render,
            log=log,
        )
    return params, loss


def run_warm_start(params, cfg: TrainConfig, parts: components.Components, curriculum_task, *, log=print):
    """A run's warm start: sft_warm_start with the widths of its config (prompt + the rollout's
    max new tokens, or sft.curriculum.max_new_tokens for the curriculum); None when the run has
    no SFT steps or no synthetic task (data.task) to draw demonstrations from."""
    sft, prompt_len, max_new = cfg.sft, cfg.data.max_prompt_len, cfg.rollout.max_new_tokens
    if not (sft.steps or sft.curriculum.steps) or parts.task is None:
        return None
    params, _ = sft_warm_start(
        params,
        parts.model_cfg,
        parts.task,
        parts.tokenizer,
        sft,
        seed=cfg.train.seed,
        width=prompt_len + max_new,
        curriculum_task=curriculum_task,
        curriculum_width=prompt_len + (sft.curriculum.max_new_tokens or max_new),
        render=components.render_prompt(cfg, parts.tokenizer),
        log=log,
    )
    return params


def _sft_phase(
    params,
    model_cfg: ModelConfig,
    task,
    tokenizer: Tokenizer,
    cfg: SFTConfig,
    steps: int,
    *,
    rng_stream: tuple[int, int],
    width: int,
    name: str,
    render,
    log,
):
    """`steps` AdamW steps (warmup-cosine schedule, a fresh optimizer) on fresh demonstration
    batches; batch i is drawn from default_rng([*rng_stream, i])."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, min(cfg.warmup_steps, max(steps - 1, 1)), max(steps, 2), cfg.lr * 0.1
    )
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.01))
    opt_state = optimizer.init(params)

    @jax.jit
    def step(params, opt_state, tokens, mask):
        def loss_fn(p):
            logp, _ = transformer.token_logprobs(p, model_cfg, tokens)
            return -jnp.sum(logp * mask) / jnp.maximum(jnp.sum(mask), 1)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    loss = float("nan")
    for i in range(steps):
        rng = np.random.default_rng([*rng_stream, i])
        tokens, mask = demonstration_batch(task, tokenizer, rng, cfg.batch_size, width, render=render)
        params, opt_state, loss = step(params, opt_state, tokens, mask)
        if (i + 1) % max(steps // 5, 1) == 0 or i == steps - 1:
            log(f"{name} step {i + 1}/{steps}: loss {float(loss):.4f}")
    return params, float(loss)
