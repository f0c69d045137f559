"""The clipped GRPO objective with the behaviour-policy corrections
(docs/methods.md#the-objective, #acr).

Per accepted token:
  l_t = w_t * max(-r_t A, -clip(r_t, 1 - eps_low, (1 + eps_high) / r_acr_t) A)
        + beta * KL_t - entropy_coef * H_t,   KL_t = clamp(exp(q_t) - q_t - 1, +-kl_clamp)
with r, q, w, r_acr and the accept mask (SARS's, with any other correction's) from
`corrections/compose.py compute_corrections`. Tokens a correction rejects leave both the
numerator and the denominator. This is the authors' slime
policy_loss_function (megatron_utils/loss.py: compute_policy_loss, the mis.py weights, the
low_var_kl term, sum_of_sample_mean over the modified loss masks). A rejection whose
`denominator` is "before" (AReaL's, rl/corrections/rejection.py) takes its rejected tokens out of
the numerator only: the denominator counts `corr.counted`, the tokens before that rejection,

  token_mean: sum_t accept_t l_t / sum_t counted_t     (AReaL ppo_actor_loss_fn)
  seq_mean:   (1 / B) sum_i sum_t accept_it l_it / sum_t counted_it

`policy_loss` returns loss = numerator / denominator. The default denominator is this batch's
(counted tokens, the accepted ones unless a rejection counts its own, for "token_mean"; rows for
"seq_mean"); the update step passes the minibatch's, so that micro-batch losses add up to the
minibatch loss exactly.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from sparserl_jax.rl.config import LossConfig
from sparserl_jax.rl.corrections import masked_mean
from sparserl_jax.rl.corrections.compose import Corrections


def k3_kl(q: Float[Array, "B T"], clamp: float) -> Float[Array, "B T"]:
    """Low-variance KL estimator exp(q) - q - 1 with q = log pi_ref - log pi_theta, its value
    clamped to [-clamp, clamp] (slime ppo_utils.py compute_approx_kl "low_var_kl"): zero gradient
    beyond the clamp."""
    return jnp.clip(jnp.exp(q) - q - 1.0, -clamp, clamp)


def clipped_surrogate(
    r: Float[Array, "B T"], adv: Float[Array, "B T"], lower: float, upper: Float[Array, "B T"]
) -> tuple[Float[Array, "B T"], Bool[Array, "B T"]]:
    """PPO's pessimistic surrogate max(-r A, -clip(r, lower, upper) A) and where clipping binds."""
    unclipped = -r * adv
    clipped = -jnp.clip(r, lower, upper) * adv
    return jnp.maximum(unclipped, clipped), clipped > unclipped


def loss_denominator(counted: Bool[Array, "B T"], cfg: LossConfig) -> Float[Array, ""]:
    """Default normaliser: the counted tokens ("token_mean"; the accepted ones unless a rejection
    keeps its own counted, compose.py Behaviour.counted) or responses ("seq_mean")."""
    if cfg.aggregation == "token_mean":
        return jnp.sum(counted).astype(jnp.float32)
    return jnp.float32(counted.shape[0])


def policy_loss(
    corr: Corrections,
    adv: Float[Array, "B T"],
    entropy: Float[Array, "B T"] | None,
    cfg: LossConfig,
    *,
    denominator: Float[Array, ""] | None = None,
) -> tuple[Float[Array, ""], dict[str, Float[Array, ""]]]:
    """Aggregated loss and token metrics (means over accepted tokens; "tokens" is their count,
    and "counted_tokens" the denominator's when a rejection keeps its own counted)."""
    m = corr.accept
    counted = m if corr.counted is None else corr.counted
    upper = (1.0 + cfg.eps_high) / corr.r_acr
    pg, clipped = clipped_surrogate(corr.r, adv, 1.0 - cfg.eps_low, upper)
    kl = k3_kl(corr.kl_q, cfg.kl_clamp)
    l_tok = corr.weight * pg + cfg.beta * kl
    if entropy is not None and cfg.entropy_coef:
        l_tok = l_tok - cfg.entropy_coef * entropy
    l_tok = jnp.where(m, l_tok, 0.0)

    if cfg.aggregation == "token_mean":
        numerator = jnp.sum(l_tok)
    else:  # seq_mean: per-response mean over accepted (counted) tokens; fully rejected rows add 0
        numerator = jnp.sum(jnp.sum(l_tok, axis=-1) / jnp.maximum(jnp.sum(counted, axis=-1), 1))
    if denominator is None:
        denominator = loss_denominator(counted, cfg)
    loss = numerator / jnp.maximum(denominator, 1e-8)

    log_r = jnp.log(corr.r)
    metrics = {
        "loss/pg": masked_mean(corr.weight * pg, m),
        "loss/kl_ref": masked_mean(kl, m),
        "loss/clip_frac": masked_mean(clipped.astype(jnp.float32), m),
        "loss/clip_frac_upper": masked_mean((clipped & (corr.r > upper)).astype(jnp.float32), m),
        "loss/approx_kl_old": masked_mean(jnp.exp(-log_r) - 1.0 + log_r, m),
        "loss/ratio_mean": masked_mean(corr.r, m),
        "loss/ratio_max": jnp.max(jnp.where(m, corr.r, 0.0)),
        "loss/weight_mean": masked_mean(corr.weight, m),
        "tokens": jnp.sum(m).astype(jnp.float32),
    }
    if entropy is not None:
        metrics["loss/entropy"] = masked_mean(entropy, m)
    if corr.counted is not None:
        metrics["counted_tokens"] = jnp.sum(counted).astype(jnp.float32)
    return loss, metrics
