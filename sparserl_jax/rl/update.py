"""The jitted update step (apart from the sampler) and the teacher-forced scorer.

One call of `update` consumes a rollout batch (layout in sparserl_jax/rl/batch.py): the batch is
split into minibatches of `update.minibatch_size` rows, one optimizer step each (`update.epochs`
passes); each minibatch's gradient is accumulated over micro-batches (lax.scan). The loss
denominator (counted tokens or rows) is the minibatch's, computed before the micro-batch split,
so accumulation reproduces the minibatch gradient. The weight normaliser (IBR's) is the rollout
batch's ("global", computed before splitting) or each micro-batch's ("micro_batch"), decided and
computed by the code the bucketed update uses (rl/corrections/compose.py). A step whose loss or
gradient is not finite leaves params and optimizer state unchanged and counts in "skipped".
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh
from jaxtyping import Array, Float, Int

from sparserl_jax.model import transformer
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rl.advantages import token_advantages
from sparserl_jax.rl.batch import BATCH_KEYS, check_batch
from sparserl_jax.rl.config import RLConfig, UpdateConfig
from sparserl_jax.rl.corrections.compose import (
    behaviour,
    behaviour_metrics,
    compute_corrections,
    weight_normalisation,
    weight_normaliser,
)
from sparserl_jax.rl.loss import loss_denominator, policy_loss
from sparserl_jax.rl.optim import make_optimizer

Params = transformer.Params
Batch = dict
# optax.tree.norm replaces optax.global_norm (deprecated) in newer optax
_tree_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def head_window(width: int, response_len: int | None) -> int | None:
    """The LM head's positions per row for rows `width` wide (rl.update.head_window="response"):
    `response_len` (rollout.max_new_tokens: a row's response positions never exceed it) where it
    is narrower than the rows, else None, the head over every position. Rows of one width always
    get the same window, so the head window adds no compiled program."""
    return response_len if response_len is not None and response_len < width else None


def micro_batch_loss(
    params: Params,
    mb: Batch,
    model_cfg: ModelConfig,
    cfg: RLConfig,
    *,
    denominator: Float[Array, ""] | None = None,
    weight_norm: Float[Array, ""] | Float[Array, " B"] | None = None,
    old_from_forward: bool = False,
    mesh: Mesh | None = None,
    window: int | None = None,
) -> tuple[Float[Array, ""], tuple[dict, Float[Array, "B T"], Float[Array, "B T A"] | None]]:
    """Learner log-probs (token_logprobs at the sampler's temperature), corrections, loss:
    (loss, (token metrics, the learner's log-probs under stop-gradient, and with mb["top_ids"]
    the learner's log-probs of the sampler's top candidates, for the agreement; else None)).

    `old_from_forward`: log pi_old is this forward's own log-probs under stop_gradient (exact
    when params are theta_old: the first forward of the only optimizer step); mb["old_logp"] is
    then not read. Without mb["ref_logp"] (loss.beta = 0) pi_ref is taken equal to pi_theta: the
    KL term and its metric are 0. `weight_norm` is a scalar or one value per row. `mesh` (the one
    the batch is split on): the forward's activations stay split on B over it (FSDP as data
    parallelism, model/activation_sharding.py). `window` (head_window): the head over that many
    positions from each row's first response position only."""
    u = cfg.update
    starts = None if window is None else transformer.head_window_starts(mb["response_mask"], window)
    logp, entropy, *top = transformer.token_logprobs(
        params,
        model_cfg,
        mb["tokens"],
        temperature=u.temperature,
        chunk_tokens=u.chunk_tokens,
        remat=u.remat,
        kept_ids=mb.get("kept_ids"),
        gather_ids=mb.get("top_ids"),
        mesh=mesh,
        window=window,
        window_start=starts,
    )
    fixed_logp = jax.lax.stop_gradient(logp)
    fixed_top = jax.lax.stop_gradient(top[0]) if top else None
    old = fixed_logp if old_from_forward else mb["old_logp"]
    ref = mb["ref_logp"] if "ref_logp" in mb else fixed_logp
    mask = mb["response_mask"].astype(bool)
    corr = compute_corrections(
        logp,
        old,
        ref,
        mb["sampler_logp"],
        mask,
        cfg,
        weight_norm=weight_norm,
        with_metrics=False,  # the update reports them once, over the whole rollout batch
    )
    adv = token_advantages(mb["advantages"], mask)
    loss, metrics = policy_loss(corr, adv, entropy, cfg.loss, denominator=denominator)
    return loss, (metrics, fixed_logp, fixed_top)


COUNTS = ("tokens", "counted_tokens")  # token metrics that are counts: summed over micro-batches


def _combine(metrics: dict, tokens: Array) -> dict:
    """Merge stacked per-micro-batch metrics: the sum for COUNTS, max for "*_max", token-weighted
    mean otherwise."""
    w = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
    out = {}
    for k, v in metrics.items():
        if k in COUNTS:
            out[k] = jnp.sum(v)
        elif k.endswith("_max"):
            out[k] = jnp.max(v)
        else:
            out[k] = jnp.sum(v * w)
    return out


def minibatch_gradients(
    params: Params,
    micro_batches: Batch,
    model_cfg: ModelConfig,
    cfg: RLConfig,
    *,
    denominator: Float[Array, ""],
    weight_norm: Float[Array, ""] | None = None,
    mesh: Mesh | None = None,
) -> tuple[Params, Float[Array, ""], dict]:
    """Gradient of the minibatch loss, accumulated in float32 over micro-batches stacked on a
    leading axis ([n_micro, micro, ...]); returns (grads in float32, loss, metrics)."""

    def one(acc, mb):
        grads_acc, loss_acc = acc
        (loss, (metrics, *_)), grads = jax.value_and_grad(micro_batch_loss, has_aux=True)(
            params, mb, model_cfg, cfg, denominator=denominator, weight_norm=weight_norm, mesh=mesh
        )
        grads_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grads_acc, grads)
        return (grads_acc, loss_acc + loss), metrics

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (grads, loss), metrics = jax.lax.scan(one, (zeros, jnp.float32(0.0)), micro_batches)
    return grads, loss, _combine(metrics, metrics["tokens"])


def apply_gradients(
    optimizer: optax.GradientTransformation,
    params: Params,
    opt_state: optax.OptState,
    grads_f32: Params,
    loss: Float[Array, ""],
) -> tuple[Params, optax.OptState, dict]:
    """One optimizer step from float32 gradients (cast to the params' dtypes); a step whose loss
    or gradient is not finite leaves params and optimizer state unchanged (metric "skipped")."""
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads_f32, params)
    grad_norm = _tree_norm(grads)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    updates, new_opt_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    return (
        keep(new_params, params),
        keep(new_opt_state, opt_state),
        {"grad_norm": grad_norm, "skipped": (~finite).astype(jnp.float32)},
    )


def reduce_steps(steps: dict) -> dict:
    """Per-optimizer-step metrics (stacked on a leading axis) to one value each: the sum of
    "skipped", the max of "*_max", the mean otherwise."""
    out = {}
    for k, v in steps.items():
        if k == "skipped":
            out[k] = jnp.sum(v)
        elif k.endswith("_max"):
            out[k] = jnp.max(v)
        else:
            out[k] = jnp.mean(v)
    return out


def make_update_fn(
    model_cfg: ModelConfig,
    cfg: RLConfig,
    optimizer: optax.GradientTransformation | None = None,
    *,
    donate: bool = False,
    mesh: Mesh | None = None,
) -> Callable[[Params, optax.OptState, Batch], tuple[Params, optax.OptState, dict]]:
    """Jitted `update(params, opt_state, batch) -> (params, opt_state, metrics)`. The optimizer
    defaults to make_optimizer(cfg.optim); `donate` donates params and optimizer state; `mesh` (the
    one params and batch are sharded on) keeps the activations split on B over it."""
    optimizer = optimizer or make_optimizer(cfg.optim)
    u = cfg.update

    def update(params, opt_state, batch):
        B, T = check_batch(batch)
        if B % u.minibatch_size:
            raise ValueError(
                f"rollout batch of {B} responses must be a multiple of update.minibatch_size={u.minibatch_size}"
            )
        n_mini, n_micro = B // u.minibatch_size, u.minibatch_size // u.micro_batch_size
        batch = {k: batch[k] for k in (*BATCH_KEYS, "kept_ids") if k in batch}
        mask = batch["response_mask"].astype(bool)
        old, sampler = batch["old_logp"], batch["sampler_logp"]

        # theta-independent, over the whole rollout batch, before splitting: computed once
        b = behaviour(old, sampler, mask, cfg)
        metrics = behaviour_metrics(b, cfg)
        weight_norm = None
        if weight_normalisation(cfg) == "global":
            weight_norm = weight_normaliser(b, cfg)
            metrics["ibr/normaliser"] = weight_norm
        denoms = jax.vmap(lambda a: loss_denominator(a, cfg.loss))(b.counted.reshape(n_mini, u.minibatch_size, T))
        minibatches = jax.tree.map(lambda x: x.reshape(n_mini, n_micro, u.micro_batch_size, *x.shape[1:]), batch)

        def opt_step(carry, xs):
            params, opt_state = carry
            mbs, denom = xs
            grads, loss, step_metrics = minibatch_gradients(
                params, mbs, model_cfg, cfg, denominator=denom, weight_norm=weight_norm, mesh=mesh
            )
            params, opt_state, applied = apply_gradients(optimizer, params, opt_state, grads, loss)
            step_metrics.update(loss=loss, **applied)
            return (params, opt_state), step_metrics

        def epoch(carry, _):
            return jax.lax.scan(opt_step, carry, (minibatches, denoms))

        (params, opt_state), steps = jax.lax.scan(epoch, (params, opt_state), None, length=u.epochs)
        metrics.update(reduce_steps(steps))
        metrics["steps"] = jnp.float32(u.epochs * n_mini)
        return params, opt_state, metrics

    return jax.jit(update, donate_argnums=(0, 1) if donate else ())


def make_score_fn(
    model_cfg: ModelConfig, cfg: UpdateConfig, *, mesh: Mesh | None = None
) -> Callable[[Params, Int[Array, "B T"]], Float[Array, "B T"]]:
    """Jitted `score(params, tokens, kept_ids=None) -> logp [B, T]`: teacher-forced log-probs
    (position t scores tokens[t + 1]) at cfg.temperature, `cfg.score_batch_size` rows at a time,
    renormalised over the sampler's kept sets when given ([B, T, K]). Run it with theta_old for
    `old_logp` and with the reference weights for `ref_logp`. `mesh`: each chunk's activations
    stay split on its rows over it."""

    def score(params, tokens, kept_ids=None):
        B, T = tokens.shape
        rows = min(cfg.score_batch_size, B)
        n = -(-B // rows)
        xs = [jnp.pad(tokens, ((0, n * rows - B), (0, 0))).reshape(n, rows, T)]
        if kept_ids is not None:
            K = kept_ids.shape[-1]
            kept_p = jnp.pad(kept_ids, ((0, n * rows - B), (0, 0), (0, 0)), constant_values=-1)
            xs.append(kept_p.reshape(n, rows, T, K))

        def one(xs):
            t, *k = xs
            logp, _ = transformer.token_logprobs(
                params,
                model_cfg,
                t,
                temperature=cfg.temperature,
                chunk_tokens=cfg.chunk_tokens,
                kept_ids=k[0] if k else None,
                mesh=mesh,
            )
            return logp

        logp = jax.lax.map(one, tuple(xs))
        return logp.reshape(n * rows, T)[:B]

    return jax.jit(score)
