"""What a behaviour-policy correction is: a settings class (its RLConfig section, under the
correction's name) and what it contributes to the loss (docs/methods.md#sars, #ibr, #tis, #acr):

  accept      a token accept mask and an optional sequence veto   (SARS; IBR's "mask" mode)
  denominator whether its rejected tokens still count in the loss's denominator (AReaL's rule)
  weight      a per-token weight w_t, optionally normalised        (IBR, TIS)
  clip_scale  a factor r_t dividing the PPO upper clip bound       (ACR's r_acr)
  metrics     its own scalar diagnostics

Every hook reads the theta-independent `Mismatch` of a batch and the correction's settings.
compose.py combines the corrections a mode names: accept = AND of the masks, at most one weight,
the clip scales multiplied."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


@dataclasses.dataclass(frozen=True)
class Mismatch:
    """What every correction reads: xi = pi_old / pi_sparse on the response tokens of a batch."""

    log_xi: Float[Array, "B T"]  # log pi_old - log pi_sparse on response tokens, 0 elsewhere
    xi: Float[Array, "B T"]  # exp(clip(log_xi, +-clamp)); 1 outside the response mask
    mask: Bool[Array, "B T"]  # the response tokens
    clamp: float  # rl.log_ratio_clamp: every log-ratio is clipped to +-clamp before exp


# accept(m, settings) -> (keep [B, T] or None, veto [B] or None): keep is False on every token the
# correction rejects (a vetoed response's tokens included); veto marks responses removed whole.
AcceptFn = Callable[[Mismatch, Any], tuple[Bool[Array, "B T"] | None, Bool[Array, " B"] | None]]
# weight(m, settings) -> w [B, T] before normalisation (compose.py zeroes it outside the mask).
WeightFn = Callable[[Mismatch, Any], Float[Array, "B T"]]
# normalise(settings) -> (how, over): how in NORMALISATIONS, over in NORMALISE_OVER.
NormaliseFn = Callable[[Any], tuple[str, str]]
# clip_scale(m, settings) -> r [B, T]: the PPO upper clip bound becomes (1 + eps_high) / r.
ClipScaleFn = Callable[[Mismatch, Any], Float[Array, "B T"]]
# denominator(settings) -> "after" or "before" (DENOMINATORS): which count of tokens the loss's
# denominator takes for the correction's rejections (None: "after").
DenominatorFn = Callable[[Any], str]
# metrics(m, settings) -> {"<name>/<metric>": scalar}
MetricsFn = Callable[[Mismatch, Any], dict[str, Float[Array, ""]]]

# How a weighting correction's w is normalised to mean 1 (docs/methods.md#ibr): over the whole
# rollout batch, over each micro-batch (the authors' code), or not at all; the mean is taken over
# the valid response tokens or over the accepted ones.
NORMALISATIONS = ("global", "micro_batch", "none")
NORMALISE_OVER = ("valid", "accepted")

# What the loss's denominator counts of a correction's rejected tokens: "after" the rejection
# (they leave the numerator and the denominator: SARS, verl's modified response mask) or "before"
# it (they leave the numerator only: AReaL's ppo_actor_loss_fn divides by the loss mask's count
# taken before its rejection sampling, so rejecting does not scale up the kept tokens' gradients).
DENOMINATORS = ("after", "before")


@dataclasses.dataclass(frozen=True)
class Correction:
    """A behaviour-policy correction. `settings` is its config class: RLConfig has a field named
    `name` holding one (rl.<name>.* in YAML and overrides); a settings class with an `enabled`
    field lets `rl.<name>.enabled=true` add the correction to any mode (ACR's)."""

    name: str
    settings: type
    accept: AcceptFn | None = None
    denominator: DenominatorFn | None = None
    weight: WeightFn | None = None
    normalise: NormaliseFn | None = None
    clip_scale: ClipScaleFn | None = None
    metrics: MetricsFn | None = None
    # for the table in docs/implementation.md (python -m sparserl_jax.rl.correction_table)
    source: str = ""  # the paper or code it comes from
    formula: str = ""  # what it does to a token, at its defaults
    frameworks: str = ""  # the frameworks that ship it

    def __post_init__(self):
        if not dataclasses.is_dataclass(self.settings):
            raise ValueError(
                f"correction {self.name!r}: settings must be a dataclass (its RLConfig section), got {self.settings!r}"
            )
        if self.accept is None and self.weight is None and self.clip_scale is None:
            raise ValueError(f"correction {self.name!r} contributes nothing: give it an accept, weight or clip_scale")
        if self.normalise is not None and self.weight is None:
            raise ValueError(f"correction {self.name!r}: normalise needs a weight")
        if self.denominator is not None and self.accept is None:
            raise ValueError(f"correction {self.name!r}: denominator needs an accept")


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
    """Mean of x over mask (0 where the mask is empty)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask, x, 0.0), axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1.0)


def effective_sample_size(w: Array, mask: Array) -> Array:
    """1 / mean((w / mean w)^2) over the mask, in (0, 1]: the effective sample size of weights w
    as a fraction (verl's rollout_is_eff_sample_size; mean w + 1e-8 in the denominator)."""
    wn = w / (masked_mean(w, mask) + 1e-8)
    return 1.0 / masked_mean(wn * wn, mask)


def masked_quantiles(x: Array, mask: Array, qs: tuple[float, ...]) -> list[Array]:
    """Quantiles of x over mask (linear interpolation, as numpy.quantile); 1 if the mask is
    empty."""
    n = jnp.sum(mask)
    x_sorted = jnp.sort(jnp.where(mask, x, jnp.inf).reshape(-1))
    out = []
    for q in qs:
        pos = q * jnp.maximum(n - 1, 0).astype(jnp.float32)
        lo = jnp.floor(pos).astype(jnp.int32)
        hi = jnp.minimum(lo + 1, jnp.maximum(n - 1, 0))
        v = x_sorted[lo] + (pos - lo) * (x_sorted[hi] - x_sorted[lo])
        out.append(jnp.where(n > 0, v, 1.0))
    return out
