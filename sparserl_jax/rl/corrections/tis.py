"""Truncated importance sampling (QuRL's FlashRL baseline, docs/methods.md#tis): weight each
token by the behaviour ratio rho = pi_prox / pi_behav (= xi), truncated at C:

  w_t = min(rho_t, C)      objective  min(rho, C) * min(R A, clip(R, 1 - eps, 1 + eps) A)

No normalisation; w is a constant (stop-gradient)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float

from sparserl_jax.rl.corrections.base import Correction, Mismatch
from sparserl_jax.rl.corrections.registry import register
from sparserl_jax.validate import check_positive


@dataclasses.dataclass(frozen=True)
class TisConfig:
    """QuRL truncated importance sampling: w = min(rho, cap), rho = pi_prox / pi_behav (= xi)."""

    cap: float = 2.0

    def __post_init__(self):
        check_positive("tis.cap", self.cap)


def tis_weight(m: Mismatch, cfg: TisConfig) -> Float[Array, "B T"]:
    """w_t = min(rho_t, C)."""
    return jnp.minimum(m.xi, cfg.cap)


CORRECTION = register(
    Correction(
        name="tis",
        settings=TisConfig,
        weight=tis_weight,
        source="QuRL's FlashRL baseline (truncated IS)",
        formula="w_t = min(xi_t, 2)",
        frameworks="verl, AReaL, TRL (token_truncate), slime (--use-tis), Tunix",
    )
)
