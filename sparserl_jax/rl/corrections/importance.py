"""Importance weights on xi at a level, truncated or masked (the IS family verl, AReaL and slime
ship, docs/implementation.md#the-correction-family); w is a constant (stop-gradient) and is not
normalised (verl's rollout_is_batch_normalize default):

  rho_t = xi at `level`: per token; the sequence product prod_t xi_t; the geometric mean
  clamp (truncated IS):  w_t = min(rho_t, hi), and >= lo when lo is set
  mask  (IcePop):        w_t = rho_t inside [lo, hi], 0 outside; the token stays in the loss's
                         denominator (verl keeps the response mask)

Three registry entries share this code, each a settings class with its published defaults:

  importance  token, clamp at 2                 (verl RolloutCorrectionConfig defaults, token level)
  seq_tis     sequence product, clamp at 2      (verl decoupled_seq_is)
  icepop      token, mask outside [0.5, 5]      (verl decoupled_token_icepop)

QuRL's token TIS at C = 2 is `tis` (tis.py). A run weights tokens by at most one correction."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Float

from sparserl_jax.rl.corrections.base import Mismatch, effective_sample_size, masked_mean
from sparserl_jax.rl.corrections.divergence import check_bounds
from sparserl_jax.rl.corrections.registry import register_each
from sparserl_jax.rl.corrections.xi import LEVELS, level_ratio
from sparserl_jax.validate import check_bool, check_in

ACTIONS = ("clamp", "mask")


@dataclasses.dataclass(frozen=True)
class ImportanceConfig:
    """Importance weight rho = xi at `level` ("token", "sequence" product, "geometric" mean),
    truncated to [lo, hi] ("clamp"; lo None: no lower bound) or zeroed outside [lo, hi] ("mask",
    IcePop; needs lo). `enabled` adds it to any mode without another weighting correction."""

    SECTION: ClassVar[str] = "importance"
    enabled: bool = False
    level: str = "token"
    action: str = "clamp"
    lo: float | None = None
    hi: float = 2.0

    def __post_init__(self):
        check_bool(f"{self.SECTION}.enabled", self.enabled)
        check_in(f"{self.SECTION}.level", self.level, LEVELS)
        check_in(f"{self.SECTION}.action", self.action, ACTIONS)
        check_bounds(self.SECTION, "ratio", self.lo, self.hi)
        if self.action == "mask" and self.lo is None:
            raise ValueError(f"{self.SECTION}.action='mask' (IcePop) needs a lower bound {self.SECTION}.lo")


@dataclasses.dataclass(frozen=True)
class SeqTisConfig(ImportanceConfig):
    """verl's Seq-TIS: w = min(prod_t xi_t, 2) on every token of the response."""

    SECTION: ClassVar[str] = "seq_tis"
    level: str = "sequence"


@dataclasses.dataclass(frozen=True)
class IcepopConfig(ImportanceConfig):
    """IcePop as verl ships it: w_t = xi_t inside [0.5, 5], 0 outside."""

    SECTION: ClassVar[str] = "icepop"
    action: str = "mask"
    lo: float | None = 0.5
    hi: float = 5.0


def importance_rho(m: Mismatch, cfg: ImportanceConfig) -> Float[Array, "B T"]:
    return level_ratio(m.log_xi, m.mask, cfg.level, m.clamp)


def importance_weight(m: Mismatch, cfg: ImportanceConfig) -> Float[Array, "B T"]:
    rho = importance_rho(m, cfg)
    if cfg.action == "mask":
        return jnp.where((rho >= cfg.lo) & (rho <= cfg.hi), rho, 0.0)
    w = jnp.minimum(rho, cfg.hi)
    return w if cfg.lo is None else jnp.maximum(w, cfg.lo)


def importance_metrics(m: Mismatch, cfg: ImportanceConfig) -> dict[str, Float[Array, ""]]:
    """<name>/out_of_bounds_frac: response tokens whose rho lies outside [lo, hi] (truncated or
    zeroed); <name>/ess: effective sample size of the weights over the response tokens,
    1 / mean((w / mean w)^2), in (0, 1] (verl's rollout_is_eff_sample_size)."""
    rho = importance_rho(m, cfg)
    out = (rho > cfg.hi) if cfg.lo is None else (rho > cfg.hi) | (rho < cfg.lo)
    return {
        f"{cfg.SECTION}/out_of_bounds_frac": masked_mean(out.astype(jnp.float32), m.mask),
        f"{cfg.SECTION}/ess": effective_sample_size(importance_weight(m, cfg), m.mask),
    }


_SOURCES = {
    ImportanceConfig: (
        "verl RolloutCorrectionConfig (rollout_is=token, threshold 2); AReaL action clamp",
        "w_t = min(xi_t, 2)",
        "verl, AReaL (clamp), TRL (token_truncate), slime (--use-tis), Tunix",
    ),
    SeqTisConfig: (
        "verl RolloutCorrectionConfig.decoupled_seq_is",
        "w_t = min(prod_s xi_s, 2)",
        "verl, TRL (sequence_truncate)",
    ),
    IcepopConfig: (
        "IcePop (Ring / Ant Ling team); verl decoupled_token_icepop",
        "w_t = xi_t if 0.5 <= xi_t <= 5 else 0",
        "verl",
    ),
}

CORRECTIONS = register_each(_SOURCES, weight=importance_weight, metrics=importance_metrics)
