"""Sparsity-Aware Rejection Sampling (Sparse-RL, docs/methods.md#sars): drop the tokens, and
veto the responses, whose xi = pi_old / pi_sparse says the compressed sampler went where the
dense policy would not. Rejected tokens leave both the numerator and the denominator of the loss
average.

  token rule:     keep o_t iff token_lo <= xi_t <= token_hi          (authors: [0.5, 1.5])
  sequence veto:  drop response i iff min_t xi_t < veto_threshold     (authors: 1e-4)

either rule reading xi per token, per sequence (prod_t xi_t) or as a geometric mean."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from sparserl_jax.rl.corrections.base import Correction, Mismatch
from sparserl_jax.rl.corrections.registry import register
from sparserl_jax.rl.corrections.xi import LEVELS, level_ratio
from sparserl_jax.validate import (
    check_at_least,
    check_bool,
    check_in,
    check_number,
    check_positive,
)


@dataclasses.dataclass(frozen=True)
class SarsConfig:
    """Sparsity-Aware Rejection Sampling on xi = pi_old / pi_sparse (docs/methods.md#sars).

    Token rule: reject where the ratio at `token_level` is outside [token_lo, token_hi] (at
    "sequence"/"geometric" level the whole response is rejected). Sequence veto: reject the whole
    response when the ratio at `veto_level` is below `veto_threshold` ("token": min_t xi_t)."""

    token_rule: bool = True
    token_lo: float = 0.5
    token_hi: float = 1.5
    token_level: str = "token"
    veto: bool = True
    veto_threshold: float = 1e-4
    veto_level: str = "token"

    def __post_init__(self):
        check_bool("sars.token_rule", self.token_rule)
        check_bool("sars.veto", self.veto)
        check_in("sars.token_level", self.token_level, LEVELS)
        check_in("sars.veto_level", self.veto_level, LEVELS)
        check_at_least("sars.token_lo", self.token_lo, 0, integer=False)
        check_number("sars.token_hi", self.token_hi)
        if not self.token_hi > self.token_lo:
            raise ValueError(f"sars.token_hi={self.token_hi} must be > sars.token_lo={self.token_lo}")
        check_positive("sars.veto_threshold", self.veto_threshold)


def sars(
    log_xi: Float[Array, "B T"], mask: Bool[Array, "B T"], cfg: SarsConfig, clamp: float
) -> tuple[Bool[Array, "B T"], Bool[Array, " B"]]:
    """Sparsity-Aware Rejection Sampling: (accepted response tokens, vetoed responses).

    A token is kept when its ratio at `token_level` lies in [token_lo, token_hi] and its response
    is not vetoed (ratio at `veto_level` below `veto_threshold`; at "token" level: min_t xi_t)."""
    keep = mask
    if cfg.token_rule:
        ratio = level_ratio(log_xi, mask, cfg.token_level, clamp)
        keep = keep & (ratio >= cfg.token_lo) & (ratio <= cfg.token_hi)
    veto_B = jnp.zeros(mask.shape[:1], bool)
    if cfg.veto:
        ratio = level_ratio(log_xi, mask, cfg.veto_level, clamp)
        veto_B = jnp.any(mask & (ratio < cfg.veto_threshold), axis=-1)
    return keep & ~veto_B[:, None], veto_B


def sars_accept(m: Mismatch, cfg: SarsConfig) -> tuple[Bool[Array, "B T"], Bool[Array, " B"]]:
    """SARS reads the unclamped log xi (its levels clamp after summing)."""
    return sars(m.log_xi, m.mask, cfg, m.clamp)


CORRECTION = register(
    Correction(
        name="sars",
        settings=SarsConfig,
        accept=sars_accept,
        source="Sparse-RL (Luo et al. 2026), the authors' slime mis.py",
        formula="keep iff 0.5 <= xi_t <= 1.5; drop the response iff min_t xi_t < 1e-4",
        frameworks="Sparse-RL's slime fork",
    )
)
