"""xi_t = pi_old(o_t) / pi_sparse(o_t), the sparsity consistency ratio
(docs/methods.md#three-policies-xi-and-r; QuRL's rho = pi_prox / pi_behav,
docs/methods.md#quantized-rollouts): the mismatch between the dense old policy and the
behaviour policy that sampled the rollout (KV-evicted, quantized or stale). Every correction
reads it; it depends on pi_old and the sampler only, so it is fixed for a rollout batch."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from sparserl_jax.rl.corrections.base import Mismatch, masked_mean

# the ratio a rule reads: per token, per sequence (product) or geometric mean (docs/methods.md#sars)
LEVELS = ("token", "sequence", "geometric")


def log_xi_raw(
    old_logp: Float[Array, "B T"], sampler_logp: Float[Array, "B T"], mask: Bool[Array, "B T"]
) -> Float[Array, "B T"]:
    """log xi_t = log pi_old - log pi_sparse on response tokens, 0 elsewhere (unclamped)."""
    return jnp.where(mask, old_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32), 0.0)


def mismatch(
    old_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    clamp: float,
) -> Mismatch:
    """log xi and xi = exp(clip(log xi, +-clamp)) (the authors' SAFETY_BOUND before exp)."""
    raw = log_xi_raw(old_logp, sampler_logp, mask)
    return Mismatch(log_xi=raw, xi=jnp.exp(jnp.clip(raw, -clamp, clamp)), mask=mask, clamp=clamp)


def level_ratio(log_xi: Float[Array, "B T"], mask: Bool[Array, "B T"], level: str, clamp: float) -> Float[Array, "B T"]:
    """xi at a level, broadcast to [B, T]: per token, per sequence (product = exp of the sum of
    log ratios) or geometric mean (exp of their mean); the log is clamped before exp."""
    if level == "token":
        log_ratio = log_xi
    elif level == "sequence":
        log_ratio = jnp.sum(jnp.where(mask, log_xi, 0.0), axis=-1, keepdims=True)
    elif level == "geometric":
        log_ratio = masked_mean(log_xi, mask, axis=-1)[:, None]
    else:
        raise ValueError(f"sars level={level!r}: accepted values are {', '.join(LEVELS)}")
    return jnp.broadcast_to(jnp.exp(jnp.clip(log_ratio, -clamp, clamp)), log_xi.shape)
