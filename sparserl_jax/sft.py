"""Supervised warm-start: teach a from-scratch model a task's ideal responses (cross-entropy on
response tokens only), so that RL starts from a policy that sometimes succeeds."""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp
import optax

from sparserl_jax.config import SFTConfig
from sparserl_jax.model import transformer
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.tokenizer import Tokenizer


def demonstration_batch(task, tokenizer: Tokenizer, rng: np.random.Generator, n: int, width: int):
    """[n, width] tokens (prompt + ideal response + EOS, right-padded) and the response mask
    aligned with token_logprobs (position t scores tokens[t + 1])."""
    eos = tokenizer.eos_token_ids[0]
    tokens = np.full((n, width), tokenizer.pad_token_id, np.int32)
    mask = np.zeros((n, width), bool)
    for i, (prompt, _) in enumerate(task.sample(rng, n)):
        p = tokenizer.encode(prompt)
        r = tokenizer.encode(task.demonstration(prompt, rng=rng)) + [eos]
        seq = (p + r)[:width]
        tokens[i, : len(seq)] = seq
        mask[i, len(p) - 1 : len(seq) - 1] = True
    return tokens, mask


def sft_warm_start(params, model_cfg: ModelConfig, task, tokenizer: Tokenizer, cfg: SFTConfig,
                   *, seed: int, width: int, log=print):
    """Run cfg.steps AdamW steps on fresh demonstration batches; returns (params, last loss)."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, cfg.lr, min(cfg.warmup_steps, max(cfg.steps - 1, 1)), max(cfg.steps, 2), cfg.lr * 0.1
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
    for i in range(cfg.steps):
        rng = np.random.default_rng([seed, 10_000_019, i])
        tokens, mask = demonstration_batch(task, tokenizer, rng, cfg.batch_size, width)
        params, opt_state, loss = step(params, opt_state, tokens, mask)
        if (i + 1) % max(cfg.steps // 5, 1) == 0 or i == cfg.steps - 1:
            log(f"sft step {i + 1}/{cfg.steps}: loss {float(loss):.4f}")
    return params, float(loss)
