"""Importance-Based Reweighting (Sparse-RL, docs/methods.md#ibr): weight each token by its xi,
so the sparse samples count as the dense old policy would have drawn them.

  w_t = min(xi_t, cap)                  "truncate" (authors: cap 1.5)
  w_t = clip(xi_t, lo, hi)              "clip"
  w_t = xi_t, xi_t outside [lo, hi] rejected (or w_t = 0)   "mask"
  w_t <- w_t / mean(w)                  normalised to mean 1 (per micro-batch, as the authors,
                                        or over the whole rollout batch)

w is a constant (stop-gradient). Source: the authors' slime fork,
examples/train_infer_mismatch_helper/mis.py compute_mis_weights."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from sparserl_jax.rl.corrections.base import (
    NORMALISATIONS,
    NORMALISE_OVER,
    Correction,
    Mismatch,
)
from sparserl_jax.rl.corrections.registry import register
from sparserl_jax.validate import check_at_least, check_bool, check_in, check_number, check_positive

IBR_MODES = ("truncate", "clip", "mask")


@dataclasses.dataclass(frozen=True)
class IbrConfig:
    """Importance-Based Reweighting w_t from xi_t (docs/methods.md#ibr), a constant (stop-gradient).
    Source: the authors' slime fork, examples/train_infer_mismatch_helper/mis.py
    compute_mis_weights (tis_mode, tis_upper_bound / tis_lower_bound, tis_batch_normalize).

    mode: "truncate" w = min(xi, cap); "clip" w = clip(xi, lo, hi); "mask" w = xi and tokens
    outside [lo, hi] are rejected (see mask_rejects).
    normalisation: divide w by its mean over the whole rollout batch ("global"), over each
    micro-batch ("micro_batch", the authors' code: compute_mis_weights runs per micro-batch) or
    not at all ("none"). The authors skip it when the mean is <= 1e-8; so do we.
    normalise_over: the tokens that mean is taken over. "valid" (authors: the original loss
    masks, so every response token, SARS-rejected and vetoed ones included, with its w =
    min(xi, cap) before rejection); "accepted": only the tokens that enter the loss, which
    makes the accepted weights average exactly 1 (our earlier reading; with heavy rejection it
    differs most, since rejected tokens have xi outside the SARS band).
    mask_rejects (mode "mask" only): True (authors: mis.py mask() returns a modified loss mask)
    drops out-of-range tokens from the loss numerator and denominator, and w = xi elsewhere;
    False keeps them in the denominator with w = 0 (our earlier reading)."""

    mode: str = "truncate"
    cap: float = 1.5
    lo: float = 0.5
    hi: float = 1.5
    normalisation: str = "micro_batch"
    normalise_over: str = "valid"
    mask_rejects: bool = True

    def __post_init__(self):
        check_in("ibr.mode", self.mode, IBR_MODES)
        check_in("ibr.normalisation", self.normalisation, NORMALISATIONS)
        check_in("ibr.normalise_over", self.normalise_over, NORMALISE_OVER)
        check_bool("ibr.mask_rejects", self.mask_rejects)
        check_positive("ibr.cap", self.cap)
        check_at_least("ibr.lo", self.lo, 0, integer=False)
        check_number("ibr.hi", self.hi)
        if not self.hi > self.lo:
            raise ValueError(f"ibr.hi={self.hi} must be > ibr.lo={self.lo}")


def ibr_in_range(xi: Float[Array, "B T"], cfg: IbrConfig) -> Bool[Array, "B T"]:
    """Tokens whose xi lies in [lo, hi] (the "mask" mode's band)."""
    return (xi >= cfg.lo) & (xi <= cfg.hi)


def ibr_raw_weight(xi: Float[Array, "B T"], cfg: IbrConfig) -> Float[Array, "B T"]:
    """Importance-Based Reweighting before normalisation: truncate, clip or mask xi. In "mask"
    mode with mask_rejects the weight is xi itself (out-of-range tokens are rejected instead)."""
    if cfg.mode == "truncate":
        return jnp.minimum(xi, cfg.cap)
    if cfg.mode == "clip":
        return jnp.clip(xi, cfg.lo, cfg.hi)
    if cfg.mode == "mask":
        return xi if cfg.mask_rejects else jnp.where(ibr_in_range(xi, cfg), xi, 0.0)
    raise ValueError(f"ibr.mode={cfg.mode!r}: accepted values are {', '.join(IBR_MODES)}")


def ibr_accept(m: Mismatch, cfg: IbrConfig) -> tuple[Bool[Array, "B T"] | None, None]:
    """ "mask" mode with mask_rejects: tokens with xi outside [lo, hi] leave the loss."""
    if cfg.mode == "mask" and cfg.mask_rejects:
        return ibr_in_range(m.xi, cfg), None
    return None, None


def ibr_weight(m: Mismatch, cfg: IbrConfig) -> Float[Array, "B T"]:
    return ibr_raw_weight(m.xi, cfg)


def ibr_normalise(cfg: IbrConfig) -> tuple[str, str]:
    return cfg.normalisation, cfg.normalise_over


CORRECTION = register(
    Correction(
        name="ibr",
        settings=IbrConfig,
        accept=ibr_accept,
        weight=ibr_weight,
        normalise=ibr_normalise,
        source="Sparse-RL (Luo et al. 2026), the authors' slime mis.py",
        formula="w_t = min(xi_t, 1.5) / its mean over the micro-batch's response tokens",
        frameworks="Sparse-RL's slime fork",
    )
)
