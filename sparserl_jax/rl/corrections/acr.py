"""Adaptive Clipping Range (QuRL, docs/methods.md#acr): the PPO upper clip bound is divided by

  r_acr = min(1, C / rho),   rho = pi_prox / pi_behav (= xi)
  objective  min(rho, C) * min(R A, clip(R, 1 - eps, (1 + eps) / r_acr) A)

Only the upper bound moves, and only where rho > C. `rl.acr.enabled=true` adds it to any mode
(to stack quantized and sparse rollouts)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from sparserl_jax.rl.corrections.base import Correction, Mismatch, masked_mean
from sparserl_jax.rl.corrections.registry import register
from sparserl_jax.validate import check_bool, check_positive


@dataclasses.dataclass(frozen=True)
class AcrConfig:
    """QuRL Adaptive Clipping Range: r_acr = min(1, C / rho); the PPO upper clip bound becomes
    (1 + eps_high) / r_acr, so it moves only where rho > C. QuRL uses the same C as TIS (open).
    `enabled` adds ACR to any mode (the qurl mode has it without)."""

    enabled: bool = False
    c: float = 2.0

    def __post_init__(self):
        check_bool("acr.enabled", self.enabled)
        check_positive("acr.c", self.c)


def acr_ratio(xi: Float[Array, "B T"], c: float) -> Float[Array, "B T"]:
    """QuRL's r = min(1, C / rho): below 1 only where rho > C."""
    return jnp.minimum(1.0, c / xi)


def acr_clip_scale(m: Mismatch, cfg: AcrConfig) -> Float[Array, "B T"]:
    return acr_ratio(m.xi, cfg.c)


def acr_metrics(m: Mismatch, cfg: AcrConfig) -> dict[str, Float[Array, ""]]:
    """acr/active_frac: the response tokens whose upper clip moved (rho > C)."""
    return {"acr/active_frac": masked_mean((m.xi > cfg.c).astype(jnp.float32), m.mask)}


CORRECTION = register(
    Correction(
        name="acr",
        settings=AcrConfig,
        clip_scale=acr_clip_scale,
        metrics=acr_metrics,
        source="QuRL (adaptive clipping range)",
        formula="PPO upper clip (1 + eps) / min(1, 2 / xi_t)",
        frameworks="QuRL",
    )
)
