"""NumPy (float64) transcriptions of the published rejection / importance-sampling formulas, for
tests: verl's verl/trainer/ppo/rollout_corr_helper.py (compute_rollout_rejection_mask,
compute_rollout_correction_weights, compute_offpolicy_metrics; the presets of
verl/trainer/config/algorithm.py RolloutCorrectionConfig) and AReaL's ratio rule
(RejectionSamplingConfig: a ratio aggregated in log space, "sum" the product, "mean" the geometric
mean, "max" the largest token ratio) and its decoupled PPO loss (areal/utils/functional.py
ppo_actor_loss_fn with apply_rejection_sampling, token level, action "mask"). log_ratio = log pi_old - log pi_sampler (verl's
old_log_prob - rollout_log_prob); mask a 0/1 [B, T] array. Written from those sources, not from
sparserl_jax."""

import numpy as np

SAFETY_BOUND = 20.0


def masked_sum(v, mask, axis=None):
    return (v * mask).sum(axis=axis)


def masked_mean(v, mask, axis=None):
    return masked_sum(v, mask, axis) / (mask.sum(axis=axis) + 1e-8)


def rejection_keep(log_ratio, mask, option: str, lower: float | None, upper: float):
    """verl's rollout_rs option (token_k1..3, seq_sum_k1..3, seq_mean_k1..3, seq_max_k2/k3) with
    its thresholds (k1: lower_upper ratio bounds, lower 1 / upper when absent; k2/k3: upper):
    the keep mask over [B, T] (1 where kept, on and off the response)."""
    lr = np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)
    token = {"k1": -lr, "k2": 0.5 * lr**2, "k3": np.exp(lr) - 1.0 - lr}[option[-2:]]
    agg = option[: -len("_k1")]
    if agg == "token":
        stat = token
    elif agg == "seq_sum":
        stat = masked_sum(token, mask, -1)[:, None]
    elif agg == "seq_mean":
        stat = masked_mean(token, mask, -1)[:, None]
    elif agg == "seq_max":
        m = np.where(mask.astype(bool), token, -np.inf).max(-1)
        stat = np.where(m == -np.inf, 0.0, m)[:, None]
    else:
        raise ValueError(option)
    if option.endswith("k1"):
        lo = 1.0 / upper if lower is None else lower
        keep = (stat >= np.log(lo)) & (stat <= np.log(upper))
    else:
        keep = stat <= upper
    return np.broadcast_to(keep, log_ratio.shape), np.broadcast_to(stat, log_ratio.shape)


def areal_ratio_keep(log_ratio, mask, agg: str, lower: float | None, upper: float):
    """AReaL's metric='ratio' with action='mask': token ratio, or aggregated in log space."""
    if agg == "token":
        stat = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    elif agg in ("sum", "mean"):
        f = masked_sum if agg == "sum" else masked_mean
        stat = np.exp(np.clip(f(log_ratio, mask, -1), -SAFETY_BOUND, SAFETY_BOUND))[:, None]
    else:  # max of the per-token ratios
        r = np.where(mask.astype(bool), np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND)), -np.inf).max(-1)
        stat = np.where(r == -np.inf, 0.0, r)[:, None]
    keep = stat <= upper
    if lower is not None:
        keep = keep & (stat >= lower)
    return np.broadcast_to(keep, log_ratio.shape), np.broadcast_to(stat, log_ratio.shape)


def areal_ppo_actor_loss(logprobs, proximal_logprobs, old_logprobs, advantages, loss_mask, eps_clip, upper, lower=None):
    """AReaL's ppo_actor_loss_fn with RejectionSamplingConfig(metric="ratio", level="token",
    action="mask", upper, lower) (AReaL's proximal policy is our pi_old, its old / behave policy
    our sampler): the loss mask's count is taken BEFORE the rejection (its comment: dropping the
    rejected tokens from it "would inflate per-token gradients by N_original / N_kept"); the
    rejection narrows the loss mask; each kept token's surrogate is weighted by the raw
    behave_imp_weight = pi_prox / pi_behave. Returns (loss, loss mask after rejection)."""
    loss_mask = loss_mask.astype(bool)
    loss_mask_count = max(int(loss_mask.sum()), 1)  # count_nonzero() or 1, before rejection
    log_ratio = proximal_logprobs - old_logprobs
    log_ratio = np.where(np.isfinite(log_ratio), log_ratio, 0.0)
    metric = np.exp(log_ratio)
    in_bounds = metric <= upper if lower is None else (metric >= lower) & (metric <= upper)
    mask_after = loss_mask & in_bounds
    behave_imp_weight = np.where(mask_after, np.exp(log_ratio), 0.0)
    ratio = np.where(mask_after, np.exp(logprobs - proximal_logprobs), 0.0)
    clipped_ratio = np.clip(ratio, 1.0 - eps_clip, 1.0 + eps_clip)
    pg_loss = np.maximum(-advantages * ratio, -advantages * clipped_ratio) * behave_imp_weight
    return np.where(mask_after, pg_loss, 0.0).sum() / loss_mask_count, mask_after


def is_weights(log_ratio, mask, level: str, upper: float, lower: float | None = None, icepop: bool = False):
    """verl's compute_rollout_correction_weights (level token / sequence; TIS clamps at upper,
    IcePop zeroes outside [lower, upper]); level "geometric" is AReaL's sequence-level ratio
    weight exp(mean log r), clamped to [lower or 0, upper]."""
    if level == "token":
        raw = np.exp(np.clip(log_ratio, -SAFETY_BOUND, SAFETY_BOUND))
    elif level == "sequence":
        raw = np.exp(np.clip(masked_sum(log_ratio, mask, -1), -SAFETY_BOUND, SAFETY_BOUND))[:, None]
    else:
        raw = np.exp(np.clip(masked_mean(log_ratio, mask, -1), -SAFETY_BOUND, SAFETY_BOUND))[:, None]
    raw = np.broadcast_to(raw, log_ratio.shape) * mask
    if icepop:
        return np.where((raw >= lower) & (raw <= upper), raw, 0.0)
    if level == "geometric":  # AReaL: clamp to [lower (default 0), upper]
        return np.clip(raw, 0.0 if lower is None else lower, upper) * mask
    return np.minimum(raw, upper)  # verl's TIS: clamp(max=upper)


def offpolicy_metrics(old_logp, sampler_logp, mask):
    """verl's compute_offpolicy_metrics (the rollout terms)."""
    lr = old_logp - sampler_logp
    out = {
        "kl": masked_mean(sampler_logp - old_logp, mask),
        "k3_kl": masked_mean(np.exp(lr) - lr - 1, mask),
    }
    log_ppl_diff = masked_mean(sampler_logp, mask, -1) - masked_mean(old_logp, mask, -1)
    out["log_ppl_diff"] = log_ppl_diff.mean()
    out["log_ppl_abs_diff"] = np.abs(log_ppl_diff).mean()
    rho = np.exp(np.clip(lr, -SAFETY_BOUND, SAFETY_BOUND))
    out["chi2_token"] = masked_mean(rho**2, mask) - 1.0
    seq = np.clip(masked_sum(lr, mask, -1), -SAFETY_BOUND, SAFETY_BOUND)
    out["chi2_seq"] = np.exp(2.0 * seq).mean() - 1.0
    return out


def ess(weights, mask, threshold: float):
    """verl's rollout_is_eff_sample_size of IS weights (clamped to [0, threshold])."""
    w = np.clip(weights, 0.0, threshold)
    wn = w / (masked_mean(w, mask) + 1e-8)
    return 1.0 / masked_mean(wn**2, mask)


# verl's presets (RolloutCorrectionConfig class methods at their defaults), restated:
# name -> (rollout_is level or None, rollout_is_threshold, rollout_rs option or None, rs threshold)
VERL_PRESETS = {
    "token_tis": ("token", 2.0, None, None),  # decoupled_token_is
    "seq_tis": ("sequence", 2.0, None, None),  # decoupled_seq_is
    "icepop": ("token", "0.5_5.0", None, None),  # decoupled_token_icepop
    "geo_rs": (None, None, "seq_mean_k1", "0.999_1.001"),  # decoupled_geo_rs
    "seq_mask_tis": ("sequence", 2.0, "seq_sum_k1", "0.5_2.0"),  # decoupled_seq_is_rs
    "geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001"),
    "geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001"),
    "k3_rs": (None, None, "seq_mean_k3", 0.01),  # decoupled_k3_rs
    "k3_rs_token_tis": ("token", 2.0, "seq_mean_k3", 0.01),
    "k3_rs_seq_tis": ("sequence", 2.0, "seq_mean_k3", 0.01),
}


def _bounds(spec):
    if isinstance(spec, str) and "_" in spec:
        lo, hi = spec.split("_")
        return float(lo), float(hi)
    return None, float(spec)


def verl_preset(name, log_ratio, mask):
    """(keep [B, T] bool, weight [B, T]) of a verl preset: keep is the modified response mask,
    weight the IS weights (ones on the response without IS)."""
    level, is_thr, rs, rs_thr = VERL_PRESETS[name]
    keep = mask.astype(bool)
    if rs is not None:
        lo, hi = _bounds(rs_thr)
        keep = keep & rejection_keep(log_ratio, mask, rs, lo, hi)[0]
    w = mask.astype(np.float64)
    if level is not None:
        lo, hi = _bounds(is_thr)
        w = is_weights(log_ratio, mask, level, hi, lo, icepop=lo is not None)
    return keep, w
