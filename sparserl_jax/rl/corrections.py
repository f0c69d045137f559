"""The one correction module for every behaviour policy (methods.md 1.1-1.3, 2, 4).

Four per-token log-probs of the sampled tokens, all [B, T] and aligned the same way (see
sparserl_jax/rl/batch.py): the learner pi_theta, the dense old policy pi_old, the reference
pi_ref and the sampler pi_sparse (KV-evicted, quantized, or stale weights). From them:

  xi   = pi_old / pi_sparse     sparsity consistency ratio (QuRL's rho); constant
  r    = pi_theta / pi_old      PPO ratio (staleness); carries the gradient
  q    = log pi_ref - log pi_theta (guarded at +-log_ratio_clamp), for the k3 KL of the loss
  sars acceptance mask          token band on xi and sequence veto (Sparse-RL)
  ibr  weight w                 min(xi, cap) etc., normalised to mean 1 over the valid response
                                tokens (Sparse-RL; "mask" mode also rejects out-of-range tokens)
  tis  weight w                 min(rho, C) (QuRL's FlashRL baseline)
  acr  r_acr = min(1, C / rho)  the PPO upper clip becomes (1 + eps_high) / r_acr (QuRL)

Everything computed from xi depends on pi_old and pi_sampler only, so it is fixed for a rollout
batch; only r and q change during the update. At default settings this reproduces the authors'
slime code (examples/train_infer_mismatch_helper/mis.py compute_mis_weights with mis.yaml);
tests/test_authors_reference.py checks it against a NumPy transcription of that code.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jaxtyping import Array, Bool, Float

from sparserl_jax.rl.config import IbrConfig, RLConfig, SarsConfig

XI_QUANTILES = (0.05, 0.5, 0.95)


@struct.dataclass
class Corrections:
    """Per-token ratios, masks and weights for the loss, plus scalar metrics."""

    xi: Float[Array, "B T"]  # pi_old / pi_sparse (log clamped); 1 outside the response mask
    r: Float[Array, "B T"]  # pi_theta / pi_old (log clamped); differentiable
    kl_q: Float[Array, "B T"]  # log pi_ref - log pi_theta (guard +-log_ratio_clamp); differentiable
    accept: Bool[Array, "B T"]  # response tokens that SARS keeps: they enter the loss average
    sars_veto: Bool[Array, "B"]  # responses removed by the sequence veto
    weight: Float[Array, "B T"]  # w_t (IBR or TIS), normalised, stop-gradient; 0 outside accept
    r_acr: Float[Array, "B T"]  # min(1, C / rho) where ACR applies, else 1
    metrics: dict


def masked_mean(x: Array, mask: Array, axis=None) -> Array:
    """Mean of x over mask (0 where the mask is empty)."""
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.where(mask, x, 0.0), axis=axis) / jnp.maximum(jnp.sum(m, axis=axis), 1.0)


def masked_quantiles(x: Array, mask: Array, qs: tuple[float, ...]) -> list[Array]:
    """Quantiles of x over mask (linear interpolation, as numpy.quantile); 1 if the mask is empty."""
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


def log_xi_raw(
    old_logp: Float[Array, "B T"], sampler_logp: Float[Array, "B T"], mask: Bool[Array, "B T"]
) -> Float[Array, "B T"]:
    """log xi_t = log pi_old - log pi_sparse on response tokens, 0 elsewhere (unclamped)."""
    return jnp.where(mask, old_logp.astype(jnp.float32) - sampler_logp.astype(jnp.float32), 0.0)


def level_ratio(
    log_xi: Float[Array, "B T"], mask: Bool[Array, "B T"], level: str, clamp: float
) -> Float[Array, "B T"]:
    """xi at a SARS level, broadcast to [B, T]: per token, per sequence (product = exp of the
    sum of log ratios) or geometric mean (exp of their mean); the log is clamped before exp."""
    if level == "token":
        log_ratio = log_xi
    elif level == "sequence":
        log_ratio = jnp.sum(jnp.where(mask, log_xi, 0.0), axis=-1, keepdims=True)
    elif level == "geometric":
        log_ratio = masked_mean(log_xi, mask, axis=-1)[:, None]
    else:
        raise ValueError(f"sars level={level!r}: accepted values are token, sequence, geometric")
    return jnp.broadcast_to(jnp.exp(jnp.clip(log_ratio, -clamp, clamp)), log_xi.shape)


def sars(
    log_xi: Float[Array, "B T"], mask: Bool[Array, "B T"], cfg: SarsConfig, clamp: float
) -> tuple[Bool[Array, "B T"], Bool[Array, "B"]]:
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
    raise ValueError(f"ibr.mode={cfg.mode!r}: accepted values are truncate, clip, mask")


def behaviour_terms(
    old_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    cfg: RLConfig,
) -> tuple[Float[Array, "B T"], Bool[Array, "B T"], Bool[Array, "B"], Float[Array, "B T"]]:
    """The theta-independent part: (xi, accept, sars_veto, raw weight before normalisation).
    The raw weight is set on every response token, rejected ones included (the authors
    normalise over those too), and 0 outside the response mask."""
    mask = mask.astype(bool)
    clamp = cfg.log_ratio_clamp
    raw = log_xi_raw(old_logp, sampler_logp, mask)
    xi = jnp.exp(jnp.clip(raw, -clamp, clamp))
    spec = cfg.spec
    if spec.sars:
        accept, veto_B = sars(raw, mask, cfg.sars, clamp)
    else:
        accept, veto_B = mask, jnp.zeros(mask.shape[:1], bool)
    if spec.ibr:
        w = ibr_raw_weight(xi, cfg.ibr)
        if cfg.ibr.mode == "mask" and cfg.ibr.mask_rejects:
            accept = accept & ibr_in_range(xi, cfg.ibr)
    elif spec.tis:
        w = jnp.minimum(xi, cfg.tis.cap)
    else:
        w = jnp.ones_like(xi)
    return xi, accept, veto_B, jnp.where(mask, w, 0.0)


def _normaliser_tokens(
    mask: Bool[Array, "B T"], accept: Bool[Array, "B T"], cfg: IbrConfig
) -> Bool[Array, "B T"]:
    return accept if cfg.normalise_over == "accepted" else mask


def ibr_normaliser(
    old_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    cfg: RLConfig,
) -> Float[Array, ""]:
    """Mean raw IBR weight over this batch's valid (or accepted, see ibr.normalise_over) tokens;
    1 when IBR is off, normalisation is "none", or the mean is <= 1e-8."""
    if not cfg.spec.ibr or cfg.ibr.normalisation == "none":
        return jnp.float32(1.0)
    mask = mask.astype(bool)
    _, accept, _, w = behaviour_terms(old_logp, sampler_logp, mask, cfg)
    return _mean_weight(_normaliser_tokens(mask, accept, cfg.ibr), w)


def row_ibr_normalisers(
    old_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    cfg: RLConfig,
) -> Float[Array, "B"]:
    """Each row's IBR normaliser as the update applies it: the rollout batch's ("global"), or
    that of the row's micro-batch of update.micro_batch_size consecutive rows ("micro_batch");
    1 without IBR normalisation. Rows may then be regrouped freely (length buckets)."""
    B, T = mask.shape
    if not cfg.spec.ibr or cfg.ibr.normalisation == "none":
        return jnp.ones((B,), jnp.float32)
    if cfg.ibr.normalisation == "global":
        return jnp.broadcast_to(ibr_normaliser(old_logp, sampler_logp, mask, cfg), (B,))
    m = cfg.update.micro_batch_size
    split = lambda x: x.reshape(B // m, m, T)  # noqa: E731
    per_micro = jax.vmap(lambda o, s, k: ibr_normaliser(o, s, k, cfg))(
        split(old_logp), split(sampler_logp), split(mask))
    return jnp.repeat(per_micro, m)


def _mean_weight(over: Bool[Array, "B T"], w: Float[Array, "B T"]) -> Float[Array, ""]:
    """mis.py: weights_mean = sum(w) / clamp_min(count, 1); used only when > 1e-8."""
    mean = jnp.sum(jnp.where(over, w, 0.0)) / jnp.maximum(jnp.sum(over), 1)
    return jnp.where(mean > 1e-8, mean, 1.0)


def acr_ratio(xi: Float[Array, "B T"], c: float) -> Float[Array, "B T"]:
    """QuRL's r = min(1, C / rho): below 1 only where rho > C."""
    return jnp.minimum(1.0, c / xi)


def compute_corrections(
    learner_logp: Float[Array, "B T"],
    old_logp: Float[Array, "B T"],
    ref_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    cfg: RLConfig,
    *,
    ibr_norm: Float[Array, ""] | None = None,
    with_metrics: bool = True,
) -> Corrections:
    """All corrections for one (micro-)batch. `ibr_norm` is the IBR normaliser, a scalar or one
    value per row; None computes it from this batch (the "micro_batch" normalisation when called
    per micro-batch).
    `with_metrics=False` leaves `metrics` empty (the update step computes them once per rollout
    batch with `mismatch_metrics`)."""
    mask = mask.astype(bool)
    clamp = cfg.log_ratio_clamp
    spec = cfg.spec
    xi, accept, veto_B, w_raw = behaviour_terms(old_logp, sampler_logp, mask, cfg)
    w = w_raw
    if spec.ibr and cfg.ibr.normalisation != "none":
        if ibr_norm is None:
            ibr_norm = _mean_weight(_normaliser_tokens(mask, accept, cfg.ibr), w_raw)
        w = w / (ibr_norm[:, None] if jnp.ndim(ibr_norm) == 1 else ibr_norm)
    w = jax.lax.stop_gradient(jnp.where(accept, w, 0.0))
    xi = jax.lax.stop_gradient(xi)
    r_acr = acr_ratio(xi, cfg.acr.c) if spec.acr else jnp.ones_like(xi)
    r_acr = jnp.where(mask, r_acr, 1.0)

    behaviour_logp = sampler_logp if cfg.ratio_against == "sampler" else old_logp
    log_r = jnp.where(
        mask, learner_logp.astype(jnp.float32) - behaviour_logp.astype(jnp.float32), 0.0
    )
    r = jnp.exp(jnp.clip(log_r, -clamp, clamp))
    q = jnp.where(mask, ref_logp.astype(jnp.float32) - learner_logp.astype(jnp.float32), 0.0)
    kl_q = jnp.clip(q, -clamp, clamp)  # overflow guard only; the loss clamps the k3 value

    metrics = {}
    if with_metrics:
        raw = log_xi_raw(old_logp, sampler_logp, mask)
        metrics = _metrics(raw, xi, accept, veto_B, w_raw, mask, cfg)
    return Corrections(
        xi=xi, r=r, kl_q=kl_q, accept=accept, sars_veto=veto_B, weight=w, r_acr=r_acr,
        metrics=metrics,
    )


def mismatch_metrics(
    old_logp: Float[Array, "B T"],
    sampler_logp: Float[Array, "B T"],
    mask: Bool[Array, "B T"],
    cfg: RLConfig,
) -> dict[str, Float[Array, ""]]:
    """Sampler-vs-dense-old diagnostics over the response tokens (theta-independent):
    KL(pi_sparse || pi_old) by the k1 and k3 estimators, |delta log-prob|, xi quantiles,
    SARS rejection rates, weight truncation and ACR activity."""
    mask = mask.astype(bool)
    xi, accept, veto_B, w = behaviour_terms(old_logp, sampler_logp, mask, cfg)
    return _metrics(log_xi_raw(old_logp, sampler_logp, mask), xi, accept, veto_B, w, mask, cfg)


def _metrics(raw, xi, accept, veto_B, w, mask, cfg: RLConfig) -> dict[str, Float[Array, ""]]:
    spec = cfg.spec
    log_xi = jnp.log(xi)
    has_tokens_B = jnp.any(mask, axis=-1)
    n_seq = jnp.maximum(jnp.sum(has_tokens_B), 1)
    out = {
        "mismatch/kl_k1": masked_mean(-raw, mask),
        "mismatch/kl_k3": masked_mean(xi - log_xi - 1.0, mask),
        "mismatch/abs_dlogp_mean": masked_mean(jnp.abs(raw), mask),
        "mismatch/abs_dlogp_max": jnp.max(jnp.where(mask, jnp.abs(raw), 0.0)),
        "sars/token_reject_rate": 1.0 - jnp.sum(accept) / jnp.maximum(jnp.sum(mask), 1),
        "sars/seq_reject_rate": jnp.sum(has_tokens_B & ~jnp.any(accept, axis=-1)) / n_seq,
        "sars/veto_rate": jnp.sum(veto_B & has_tokens_B) / n_seq,
    }
    for p, v in zip(XI_QUANTILES, masked_quantiles(xi, mask, XI_QUANTILES)):
        out[f"xi/p{round(100 * p)}"] = v
    if spec.ibr or spec.tis:
        # fraction of accepted tokens whose weight is not xi itself (truncated, clipped, masked)
        out["weights/trunc_frac"] = masked_mean((w != xi).astype(jnp.float32), accept)
        out["weights/raw_mean"] = masked_mean(w, accept)
    if spec.acr:
        out["acr/active_frac"] = masked_mean((xi > cfg.acr.c).astype(jnp.float32), mask)
    return out
