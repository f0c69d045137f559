"""Rejection by a divergence statistic (the family verl and AReaL ship, docs/implementation.md#the-correction-family):
a response token leaves the loss's numerator when the statistic of xi at its aggregation is
outside the bounds (divergence.py):

  keep_t  iff  bounds(aggregate_{t in response}(statistic(log xi_t)))

and, with `denominator="after"`, its denominator too (as SARS's rejections and verl's modified
response mask); with `denominator="before"` the denominator keeps counting it (AReaL's
ppo_actor_loss_fn: sum_t keep_t l_t / #(loss mask before rejection), so rejecting does not scale
up the kept tokens' gradients by N_before / N_kept; rl/loss.py).

Four registry entries share this code, each a settings class with its published defaults:

  rejection  ratio per token, keep xi in (0, 5], denominator before   (AReaL RejectionSamplingConfig)
  geo_rs     k1 mean, |mean log xi| <= log 1.001, after               (verl decoupled_geo_rs: the geometric mean)
  seq_mask   k1 sum, prod_t xi_t in [0.5, 2], after                   (verl decoupled_seq_is_rs, its mask)
  k3_rs      k3 mean <= 0.01, after                                   (verl decoupled_k3_rs)

Any of them joins any mode with `rl.<name>.enabled=true`; every field is a setting
(`rl.k3_rs.aggregation=max` is verl's seq_max_k3, which replaced the min-xi veto there;
`rl.geo_rs.denominator=before` counts Geo-RS's rejections as AReaL would)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from sparserl_jax.rl.corrections.base import DENOMINATORS, Mismatch, masked_mean
from sparserl_jax.rl.corrections.divergence import (
    AGGREGATIONS,
    STATISTICS,
    check_bounds,
    statistic_value,
    within_bounds,
)
from sparserl_jax.rl.corrections.registry import register_each
from sparserl_jax.validate import check_bool, check_in


@dataclasses.dataclass(frozen=True)
class RejectionConfig:
    """Reject the tokens whose statistic of xi, at `aggregation` over their response, is outside
    [lo, hi] (divergence.py states each statistic's bounds; lo None: ratio unbounded below, k1
    1 / hi). `denominator`: the loss's denominator counts the response tokens "after" the
    rejection (rejected tokens leave it too) or "before" it (they still count: AReaL's).
    `enabled` adds it to any mode. Defaults: AReaL's RejectionSamplingConfig (ratio, token level,
    upper 5, no lower bound) with AReaL's denominator. AReaL's mask action also weights each kept
    token by its raw xi (behave_imp_weight): `rl.importance.enabled=true` with importance.hi equal
    to this hi adds that (tests/test_correction_family.py checks the pair against AReaL's loss)."""

    SECTION: ClassVar[str] = "rejection"
    enabled: bool = False
    statistic: str = "ratio"
    aggregation: str = "token"
    lo: float | None = None
    hi: float = 5.0
    denominator: str = "before"

    def __post_init__(self):
        check_bool(f"{self.SECTION}.enabled", self.enabled)
        check_in(f"{self.SECTION}.statistic", self.statistic, STATISTICS)
        check_in(f"{self.SECTION}.aggregation", self.aggregation, AGGREGATIONS)
        check_bounds(self.SECTION, self.statistic, self.lo, self.hi)
        check_in(f"{self.SECTION}.denominator", self.denominator, DENOMINATORS)


@dataclasses.dataclass(frozen=True)
class GeoRsConfig(RejectionConfig):
    """verl's Geo-RS: the geometric mean of xi over a response within [0.999, 1.001] (its k1
    mean, -mean log xi, within [log 0.999, log 1.001]): length-invariant."""

    SECTION: ClassVar[str] = "geo_rs"
    statistic: str = "k1"
    aggregation: str = "mean"
    lo: float | None = 0.999
    hi: float = 1.001
    denominator: str = "after"


@dataclasses.dataclass(frozen=True)
class SeqMaskConfig(RejectionConfig):
    """verl's sequence mask (Seq-MIS): the product of xi over a response within [0.5, 2] (its k1
    sum within [log 0.5, log 2]); a long response drifts out of any fixed band (length bias)."""

    SECTION: ClassVar[str] = "seq_mask"
    statistic: str = "k1"
    aggregation: str = "sum"
    lo: float | None = 0.5
    hi: float = 2.0
    denominator: str = "after"


@dataclasses.dataclass(frozen=True)
class K3RsConfig(RejectionConfig):
    """verl's K3-RS: the mean over a response of k3 = xi - 1 - log xi at most 0.01."""

    SECTION: ClassVar[str] = "k3_rs"
    statistic: str = "k3"
    aggregation: str = "mean"
    hi: float = 0.01
    denominator: str = "after"


def rejection_keep(m: Mismatch, cfg: RejectionConfig) -> Bool[Array, "B T"]:
    """The tokens the rule keeps (on and off the response mask)."""
    value = statistic_value(m.log_xi, m.mask, cfg.statistic, cfg.aggregation, m.clamp)
    return within_bounds(value, cfg.statistic, cfg.lo, cfg.hi)


def rejection_accept(m: Mismatch, cfg: RejectionConfig) -> tuple[Bool[Array, "B T"], None]:
    return rejection_keep(m, cfg), None


def rejection_denominator(cfg: RejectionConfig) -> str:
    return cfg.denominator


def rejection_metrics(m: Mismatch, cfg: RejectionConfig) -> dict[str, Float[Array, ""]]:
    """<name>/reject_frac: the response tokens this rule rejects (alone); <name>/statistic_mean:
    its statistic's mean over the response tokens."""
    value = statistic_value(m.log_xi, m.mask, cfg.statistic, cfg.aggregation, m.clamp)
    out = within_bounds(value, cfg.statistic, cfg.lo, cfg.hi)
    return {
        f"{cfg.SECTION}/reject_frac": masked_mean((~out).astype(jnp.float32), m.mask),
        f"{cfg.SECTION}/statistic_mean": masked_mean(value, m.mask),
    }


_SOURCES = {
    RejectionConfig: (
        "AReaL RejectionSamplingConfig (action mask)",
        "keep iff xi_t <= 5; rejected tokens still counted in the denominator",
        "AReaL (action mask), verl (rollout_rs)",
    ),
    GeoRsConfig: (
        "verl RolloutCorrectionConfig.decoupled_geo_rs",
        "keep iff log 0.999 <= -mean_t log xi_t <= log 1.001",
        "verl, AReaL (ratio, sequence, mean)",
    ),
    SeqMaskConfig: (
        "verl decoupled_seq_is_rs (rollout_rs seq_sum_k1)",
        "keep iff log 0.5 <= -sum_t log xi_t <= log 2",
        "verl; TRL's sequence_mask zeroes the weight instead",
    ),
    K3RsConfig: (
        "verl RolloutCorrectionConfig.decoupled_k3_rs",
        "keep iff mean_t (xi_t - 1 - log xi_t) <= 0.01",
        "verl",
    ),
}

CORRECTIONS = register_each(
    _SOURCES, accept=rejection_accept, denominator=rejection_denominator, metrics=rejection_metrics
)
