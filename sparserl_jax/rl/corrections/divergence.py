"""The pieces the rejection and importance-weight family is built from (rejection.py,
importance.py; docs/implementation.md#the-correction-family): a statistic of log xi per token,
its aggregation over a response, and the bounds a rule keeps. xi = pi_old / pi_sampler (verl's
r = pi_train / pi_rollout in its decoupled mode; AReaL's pi_proximal / pi_behave).

  statistic   ratio  xi_t, aggregated in log space (sum: the sequence product prod_t xi_t;
                     mean: the geometric mean, length-invariant; max: max_t xi_t); the log is
                     clamped at +-rl.log_ratio_clamp after aggregating (as SARS's levels)
              k1     -log xi_t                 (verl's sign: k1 estimates KL(pi_sampler || pi_old))
              k2     (log xi_t)^2 / 2
              k3     xi_t - 1 - log xi_t
              k1..k3 read log xi clamped at +-rl.log_ratio_clamp per token, then aggregate
              (verl rollout_corr_helper.compute_rollout_rejection_mask)
  aggregation token | sum | mean | max over a response's tokens (max: 0 for an empty response)
  bounds      ratio  lo <= value <= hi (no lower bound when lo is None)
              k1     log lo <= value <= log hi (lo None: 1 / hi, verl's default)
              k2, k3 value <= hi (the divergences are >= 0: no lower bound)
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from sparserl_jax.rl.corrections.base import masked_mean
from sparserl_jax.rl.corrections.xi import level_ratio

STATISTICS = ("ratio", "k1", "k2", "k3")
AGGREGATIONS = ("token", "sum", "mean", "max")
# the ratio's aggregations in log space are xi.py's levels
_RATIO_LEVEL = {"token": "token", "sum": "sequence", "mean": "geometric"}


def token_divergence(log_xi: Float[Array, "B T"], statistic: str, clamp: float) -> Float[Array, "B T"]:
    """k1, k2 or k3 per token, from log xi clamped at +-clamp."""
    lr = jnp.clip(log_xi, -clamp, clamp)
    if statistic == "k1":
        return -lr
    if statistic == "k2":
        return 0.5 * lr * lr
    if statistic == "k3":
        return jnp.exp(lr) - 1.0 - lr
    raise ValueError(f"statistic={statistic!r} is not a divergence: accepted values are k1, k2, k3")


def aggregate(values: Float[Array, "B T"], mask: Bool[Array, "B T"], aggregation: str) -> Float[Array, "B T"]:
    """Per token ("token"), or a response's sum, mean or max broadcast to its tokens."""
    if aggregation == "token":
        return values
    if aggregation == "sum":
        seq = jnp.sum(jnp.where(mask, values, 0.0), axis=-1)
    elif aggregation == "mean":
        seq = masked_mean(values, mask, axis=-1)
    elif aggregation == "max":
        seq = jnp.max(jnp.where(mask, values, -jnp.inf), axis=-1)
        seq = jnp.where(jnp.any(mask, axis=-1), seq, 0.0)
    else:
        raise ValueError(f"aggregation={aggregation!r}: accepted values are {', '.join(AGGREGATIONS)}")
    return jnp.broadcast_to(seq[:, None], values.shape)


def statistic_value(
    log_xi: Float[Array, "B T"], mask: Bool[Array, "B T"], statistic: str, aggregation: str, clamp: float
) -> Float[Array, "B T"]:
    """The statistic a rule reads, at its aggregation, on every position (see the module doc)."""
    if statistic == "ratio":
        if aggregation == "max":
            return aggregate(jnp.exp(jnp.clip(log_xi, -clamp, clamp)), mask, "max")
        return level_ratio(log_xi, mask, _RATIO_LEVEL[aggregation], clamp)
    return aggregate(token_divergence(log_xi, statistic, clamp), mask, aggregation)


def within_bounds(value: Float[Array, "B T"], statistic: str, lo: float | None, hi: float) -> Bool[Array, "B T"]:
    """Where the statistic keeps its token (see the module doc's bounds)."""
    if statistic == "ratio":
        keep = value <= hi
        return keep if lo is None else keep & (value >= lo)
    if statistic == "k1":
        lo_ratio = 1.0 / hi if lo is None else lo
        return (value >= math.log(lo_ratio)) & (value <= math.log(hi))
    return value <= hi


def check_bounds(section: str, statistic: str, lo: float | None, hi: float) -> None:
    """hi > 0; lo (when given) > 0 and < hi for the ratio and k1, absent for k2 and k3."""
    if not (isinstance(hi, (int, float)) and not isinstance(hi, bool) and hi > 0):
        raise ValueError(f"{section}.hi={hi!r} must be a number > 0")
    if lo is None:
        return
    if statistic in ("k2", "k3"):
        raise ValueError(
            f"{section}.lo={lo!r}: the {statistic} statistic is >= 0 and has only an upper bound; leave lo unset"
        )
    if not (isinstance(lo, (int, float)) and not isinstance(lo, bool) and 0 < lo < hi):
        raise ValueError(f"{section}.lo={lo!r} must be a number in (0, {section}.hi={hi})")
