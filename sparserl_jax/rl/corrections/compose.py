"""The corrections a run applies, combined (docs/methods.md#how-they-compose): the generic
accept mask, weight and weight normalisation every registered correction feeds.

Four per-token log-probs of the sampled tokens, all [B, T] and aligned the same way (see
sparserl_jax/rl/batch.py): the learner pi_theta, the dense old policy pi_old, the reference
pi_ref and the sampler pi_sparse (KV-evicted, quantized, or stale weights). From them:

  xi   = pi_old / pi_sparse     sparsity consistency ratio (QuRL's rho); constant
  r    = pi_theta / pi_old      PPO ratio (staleness); carries the gradient
  q    = log pi_ref - log pi_theta (guarded at +-log_ratio_clamp), for the k3 KL of the loss

and from xi, for the corrections in force (`RLConfig.corrections`: the mode's, see RL_MODES):
accept = the response mask AND every correction's keep mask, veto = the responses removed whole;
counted = the tokens the loss's denominator counts: accept, plus the rejections of a correction
whose denominator is "before" (AReaL's rule; base.py DENOMINATORS);
w = the one weighting correction's weight (1 without one), normalised to mean 1 if it asks (over
the rollout batch or each micro-batch); r_acr = the product of the clip scales (1 without one).
Everything computed from xi depends on pi_old and pi_sampler only, so it is fixed for a rollout
batch (`behaviour`, computed once per batch or micro-batch); only r and q change during the
update. At default settings this reproduces the authors' slime code
(examples/train_infer_mismatch_helper/mis.py compute_mis_weights with mis.yaml);
tests/test_authors_reference.py checks it against a NumPy transcription of that code.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float

from sparserl_jax.rl.config import RLConfig
from sparserl_jax.rl.corrections.base import (
    Correction,
    Mismatch,
    effective_sample_size,
    masked_mean,
    masked_quantiles,
)
from sparserl_jax.rl.corrections.registry import CORRECTIONS
from sparserl_jax.rl.corrections.xi import mismatch

XI_QUANTILES = (0.05, 0.5, 0.95)


@struct.dataclass
class Corrections:
    """Per-token ratios, masks and weights for the loss, plus scalar metrics."""

    xi: Float[Array, "B T"]  # pi_old / pi_sparse (log clamped); 1 outside the response mask
    r: Float[Array, "B T"]  # pi_theta / pi_old (log clamped); differentiable
    kl_q: Float[Array, "B T"]  # log pi_ref - log pi_theta (guard +-log_ratio_clamp); differentiable
    accept: Bool[Array, "B T"]  # response tokens every correction keeps: they enter the loss
    veto: Bool[Array, " B"]  # responses removed whole (a sequence veto, SARS's)
    weight: Float[Array, "B T"]  # w_t (IBR or TIS), normalised, stop-gradient; 0 outside accept
    r_acr: Float[Array, "B T"]  # the product of the clip scales (ACR: min(1, C / rho)), else 1
    metrics: dict
    # the tokens the loss's denominator counts, a superset of accept; None: accept itself (no
    # correction in force keeps its rejections counted)
    counted: Bool[Array, "B T"] | None = None


@dataclasses.dataclass(frozen=True)
class Behaviour:
    """The theta-independent part of a batch's corrections (the mismatch and what the corrections
    in force make of it), computed once per rollout batch or micro-batch."""

    mismatch: Mismatch
    accept: Bool[Array, "B T"]  # the response mask AND every correction's keep mask
    veto: Bool[Array, " B"]  # responses removed whole
    weight: Float[Array, "B T"]  # the raw weight before normalisation, 0 outside the response mask
    # the response mask AND the keep masks of the corrections whose denominator is "after": the
    # tokens the loss's denominator counts (accept itself unless one is "before")
    counted: Bool[Array, "B T"]


def active(cfg: RLConfig) -> list[tuple[Correction, Any]]:
    """(correction, its settings section of cfg) for every correction in force, in order."""
    return [(CORRECTIONS[name], getattr(cfg, name)) for name in cfg.corrections]


def _denominator(c: Correction, settings: Any) -> str:
    return "after" if c.denominator is None else c.denominator(settings)


def counts_rejections(cfg: RLConfig) -> bool:
    """Whether a correction in force keeps its rejected tokens in the loss's denominator
    (denominator "before": AReaL's), so that the denominator counts more tokens than accept."""
    return any(c.accept is not None and _denominator(c, s) == "before" for c, s in active(cfg))


def _weighting(cfg: RLConfig) -> tuple[Correction, Any] | None:
    """The one weighting correction in force (RLConfig allows at most one), or None."""
    return next(((c, s) for c, s in active(cfg) if c.weight is not None), None)


def _normalisation(cfg: RLConfig) -> tuple[str, str]:
    w = _weighting(cfg)
    if w is None or w[0].normalise is None:
        return "none", "valid"
    return w[0].normalise(w[1])


def weight_normalisation(cfg: RLConfig) -> str:
    """How the weights are normalised to mean 1: "global" (over the rollout batch),
    "micro_batch" or "none" (also without a weighting correction), as the weighting correction
    in force asks (IBR: ibr.normalisation). Both update paths read it here."""
    return _normalisation(cfg)[0]


def behaviour(
    old_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    cfg: RLConfig,
) -> Behaviour:
    """xi of the batch, the accept mask and veto of every correction in force, the tokens the
    loss's denominator counts, and the raw weight (set on every response token, rejected ones
    included: the authors normalise over those too)."""
    mask = mask.astype(bool)
    m = mismatch(old_logp, sampler_logp, mask, cfg.log_ratio_clamp)
    on = active(cfg)
    accept, counted, veto_B = mask, mask, None
    for c, s in on:
        if c.accept is not None:
            keep, veto = c.accept(m, s)
            if keep is not None:
                accept = accept & keep
                if _denominator(c, s) == "after":
                    counted = counted & keep
            if veto is not None:
                veto_B = veto if veto_B is None else veto_B | veto
    if veto_B is None:
        veto_B = jnp.zeros(mask.shape[:1], bool)
    weighting = _weighting(cfg)
    w = jnp.ones_like(m.xi) if weighting is None else weighting[0].weight(m, weighting[1])
    return Behaviour(m, accept, veto_B, jnp.where(mask, w, 0.0), counted)


def behaviour_terms(
    old_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    cfg: RLConfig,
) -> tuple[Float[Array, "B T"], Bool[Array, "B T"], Bool[Array, " B"], Float[Array, "B T"]]:
    """`behaviour` as arrays: (xi, accept, veto, raw weight before normalisation)."""
    b = behaviour(old_logp, sampler_logp, mask, cfg)
    return b.mismatch.xi, b.accept, b.veto, b.weight


def _normaliser_tokens(mask: Bool[Array, "B T"], accept: Bool[Array, "B T"], over: str) -> Bool[Array, "B T"]:
    return accept if over == "accepted" else mask


def _mean_weight(over: Bool[Array, "B T"], w: Float[Array, "B T"]) -> Float[Array, ""]:
    """mis.py: weights_mean = sum(w) / clamp_min(count, 1); used only when > 1e-8."""
    mean = jnp.sum(jnp.where(over, w, 0.0)) / jnp.maximum(jnp.sum(over), 1)
    return jnp.where(mean > 1e-8, mean, 1.0)


def weight_normaliser(b: Behaviour, cfg: RLConfig) -> Float[Array, ""]:
    """Mean raw weight over the batch's valid (or accepted, as the weighting correction asks:
    ibr.normalise_over) tokens; 1 without a normalised weighting correction (none in force, or
    normalisation "none") or when the mean is <= 1e-8."""
    how, over = _normalisation(cfg)
    if how == "none":
        return jnp.float32(1.0)
    return _mean_weight(_normaliser_tokens(b.mismatch.mask, b.accept, over), b.weight)


def row_weight_normalisers(
    old_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    cfg: RLConfig,
) -> Float[Array, " B"]:
    """Each row's weight normaliser as the update applies it: the rollout batch's ("global"), or
    that of the row's micro-batch of update.micro_batch_size consecutive rows ("micro_batch");
    1 without normalisation. Rows may then be regrouped freely (length buckets)."""
    B, T = mask.shape
    how = weight_normalisation(cfg)
    if how == "none":
        return jnp.ones((B,), jnp.float32)
    if how == "global":
        norm = weight_normaliser(behaviour(old_logp, sampler_logp, mask, cfg), cfg)
        return jnp.broadcast_to(norm, (B,))
    m = cfg.update.micro_batch_size
    split = lambda x: x.reshape(B // m, m, T)  # noqa: E731
    per_micro = jax.vmap(lambda o, s, k: weight_normaliser(behaviour(o, s, k, cfg), cfg))(
        split(old_logp), split(sampler_logp), split(mask)
    )
    return jnp.repeat(per_micro, m)


def compute_corrections(
    learner_logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    cfg: RLConfig,
    *,
    weight_norm: Float[Array, ""] | None = None,
    with_metrics: bool = True,
) -> Corrections:
    """All corrections for one (micro-)batch. `weight_norm` is the weight normaliser, a scalar or
    one value per row; None computes it from this batch (the "micro_batch" normalisation when
    called per micro-batch).
    `with_metrics=False` leaves `metrics` empty (the update step computes them once per rollout
    batch with `mismatch_metrics`)."""
    mask = mask.astype(bool)
    clamp = cfg.log_ratio_clamp
    b = behaviour(old_logp, sampler_logp, mask, cfg)
    m, accept, veto_B, w_raw = b.mismatch, b.accept, b.veto, b.weight
    w = w_raw
    if weight_normalisation(cfg) != "none":
        if weight_norm is None:
            weight_norm = weight_normaliser(b, cfg)
        w = w / (weight_norm[:, None] if jnp.ndim(weight_norm) == 1 else weight_norm)
    w = jax.lax.stop_gradient(jnp.where(accept, w, 0.0))
    m = dataclasses.replace(m, xi=jax.lax.stop_gradient(m.xi))
    xi = m.xi
    r_acr = None
    for c, s in active(cfg):
        if c.clip_scale is not None:
            scale = c.clip_scale(m, s)
            r_acr = scale if r_acr is None else r_acr * scale
    r_acr = jnp.ones_like(xi) if r_acr is None else r_acr
    r_acr = jnp.where(mask, r_acr, 1.0)

    behaviour_logp = sampler_logp if cfg.ratio_against == "sampler" else old_logp
    log_r = jnp.where(mask, learner_logp.astype(jnp.float32) - behaviour_logp.astype(jnp.float32), 0.0)
    r = jnp.exp(jnp.clip(log_r, -clamp, clamp))
    q = jnp.where(mask, ref_logp.astype(jnp.float32) - learner_logp.astype(jnp.float32), 0.0)
    kl_q = jnp.clip(q, -clamp, clamp)  # overflow guard only; the loss clamps the k3 value

    metrics = behaviour_metrics(dataclasses.replace(b, mismatch=m), cfg) if with_metrics else {}
    return Corrections(
        xi=xi,
        r=r,
        kl_q=kl_q,
        accept=accept,
        veto=veto_B,
        weight=w,
        r_acr=r_acr,
        metrics=metrics,
        counted=b.counted if counts_rejections(cfg) else None,
    )


def mismatch_metrics(
    old_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    cfg: RLConfig,
) -> dict[str, Float[Array, ""]]:
    """Sampler-vs-dense-old diagnostics over the response tokens (theta-independent):
    KL(pi_sparse || pi_old) by the k1 and k3 estimators, |delta log-prob|, xi quantiles,
    rejection rates, weight truncation, and each correction's own metrics (ACR activity)."""
    return behaviour_metrics(behaviour(old_logp, sampler_logp, mask, cfg), cfg)


def off_policy_diagnostics(m: Mismatch) -> dict[str, Float[Array, ""]]:
    """verl's off-policy diagnostics of the sampler against pi_old over the response tokens
    (rollout_corr_helper.compute_offpolicy_metrics), with xi = pi_old / pi_sampler:

      mismatch/kl_k1          mean_t -log xi_t         KL(pi_sampler || pi_old), direct estimator
      mismatch/kl_k3          mean_t xi_t - 1 - log xi_t   (the same KL, low variance)
      mismatch/chi2_token     mean_t xi_t^2 - 1         chi-squared divergence, per token
      mismatch/chi2_seq       mean_i (prod_t xi_t)^2 - 1   per response (its log clamped at +-20)
      mismatch/log_ppl_diff   mean_i (mean_t log pi_sampler - mean_t log pi_old): the log of
                              pi_old's perplexity over the sampler's; log_ppl_abs_diff its |.|
      mismatch/ess_token      1 / mean_t (xi_t / mean xi)^2, the effective sample size of xi as
                              weights, in (0, 1]

    Means over responses are over every row, as verl's."""
    raw, xi, mask = m.log_xi, m.xi, m.mask
    log_xi = jnp.log(xi)
    seq_log = jnp.clip(jnp.sum(jnp.where(mask, raw, 0.0), axis=-1), -m.clamp, m.clamp)
    log_ppl_diff_B = -masked_mean(raw, mask, axis=-1)
    return {
        "mismatch/kl_k1": masked_mean(-raw, mask),
        "mismatch/kl_k3": masked_mean(xi - log_xi - 1.0, mask),
        "mismatch/chi2_token": masked_mean(xi * xi, mask) - 1.0,
        "mismatch/chi2_seq": jnp.mean(jnp.exp(2.0 * seq_log)) - 1.0,
        "mismatch/log_ppl_diff": jnp.mean(log_ppl_diff_B),
        "mismatch/log_ppl_abs_diff": jnp.mean(jnp.abs(log_ppl_diff_B)),
        "mismatch/ess_token": effective_sample_size(xi, mask),
    }


def behaviour_metrics(b: Behaviour, cfg: RLConfig) -> dict[str, Float[Array, ""]]:
    """`mismatch_metrics` of a batch whose `behaviour` is computed."""
    m, accept, veto_B, w = b.mismatch, b.accept, b.veto, b.weight
    raw, xi, mask = m.log_xi, m.xi, m.mask
    has_tokens_B = jnp.any(mask, axis=-1)
    n_seq = jnp.maximum(jnp.sum(has_tokens_B), 1)
    out = {
        **off_policy_diagnostics(m),
        "mismatch/abs_dlogp_mean": masked_mean(jnp.abs(raw), mask),
        "mismatch/abs_dlogp_max": jnp.max(jnp.where(mask, jnp.abs(raw), 0.0)),
        # the accept mask and veto of every correction together, under the keys the results read
        # (named after SARS, the first correction to reject)
        "sars/token_reject_rate": 1.0 - jnp.sum(accept) / jnp.maximum(jnp.sum(mask), 1),
        "sars/seq_reject_rate": jnp.sum(has_tokens_B & ~jnp.any(accept, axis=-1)) / n_seq,
        "sars/veto_rate": jnp.sum(veto_B & has_tokens_B) / n_seq,
    }
    for p, v in zip(XI_QUANTILES, masked_quantiles(xi, mask, XI_QUANTILES)):
        out[f"xi/p{round(100 * p)}"] = v
    if _weighting(cfg) is not None:
        # fraction of accepted tokens whose weight is not xi itself (truncated, clipped, masked)
        out["weights/trunc_frac"] = masked_mean((w != xi).astype(jnp.float32), accept)
        out["weights/raw_mean"] = masked_mean(w, accept)
        out["weights/ess"] = effective_sample_size(jnp.where(accept, w, 0.0), accept)
    for c, s in active(cfg):
        if c.metrics is not None:
            out.update(c.metrics(m, s))
    return out
