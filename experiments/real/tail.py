"""One arm of the tail measurement (experiments/real_tail.py): sample chat rollouts with a KV
policy at a fixed budget or a budget schedule, teacher-force the dense model over them, and
return Sparrow's per-token agreement (rl/diagnostics.py agreement: sum_v min(p_sampler(v),
p_dense(v)) over the sampler's top 20) pooled and by bin of tokens seen, with the mean mismatch
and the KV saving. Runs inside one single-core worker process (experiments/workers.py)."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparserl_jax.experiments.real import measure
from sparserl_jax.model import transformer
from sparserl_jax.rl.diagnostics import agreement
from sparserl_jax.rollout.stats import kv_statistics

TOP_K = 20  # Sparrow's top 20
TAIL = 0.05  # Sparrow's 5th percentile
ROWS = 16  # rows per teacher-forced scoring call


def dense_top_logp(model_cfg, params, tokens, top_ids) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced dense log-probs [B, T] of the tokens and [B, T, A] of the top ids."""
    fn = jax.jit(
        functools.partial(transformer.token_logprobs, cfg=model_cfg, temperature=measure.TEMPERATURE),
    )
    lp, tops = [], []
    for i in range(0, tokens.shape[0], ROWS):
        t, g = jnp.asarray(tokens[i : i + ROWS]), jnp.asarray(top_ids[i : i + ROWS])
        a, _, c = fn(params, tokens=t, gather_ids=g)
        lp.append(np.asarray(a))
        tops.append(np.asarray(c))
    return np.concatenate(lp), np.concatenate(tops)


def tail_numbers(lower: np.ndarray, seen: np.ndarray, every: int) -> dict:
    """The agreement's mean and 5th percentile over all tokens and per bin of `every` tokens
    seen (Sparrow pools each bin's tokens over the batch)."""
    bins = seen // every
    per_bin = {}
    for b in np.unique(bins):
        a = lower[bins == b]
        per_bin[int(b)] = {"p5": float(np.quantile(a, TAIL)), "mean": float(a.mean()), "tokens": int(a.size)}
    return {"agreement_mean": float(lower.mean()), "agreement_p5": float(np.quantile(lower, TAIL)), "bins": per_bin}


def tail_arm(arm: measure.Arm, every: int) -> dict:
    """Sample the arm's rollouts (recording their top 20), score them densely, return the
    agreement's tail (pooled and by bins of `every` tokens seen), k3 and the KV saving."""
    t0 = time.perf_counter()
    model_cfg, params, tok, ids, lengths = measure.load(arm)
    cfg = dataclasses.replace(measure.sampler_config(arm, tok), agreement_k=TOP_K)
    out = measure.sample(params, model_cfg, ids, lengths, cfg, arm.seed, arm.rows_per_call)
    batch = jax.device_get(measure.assemble_rollout(ids, lengths, out, tok))
    old, old_top = dense_top_logp(model_cfg, params, batch["tokens"], batch["top_ids"])
    mask = np.asarray(batch["response_mask"], bool)
    lower, upper = agreement(batch["top_ids"], batch["top_logp"], old_top)
    seen = np.broadcast_to(np.arange(mask.shape[1]) + 1, mask.shape)[mask]  # position t samples token t + 1
    res = tail_numbers(lower[mask], seen, every)
    res["agreement_upper_p5"] = float(np.quantile(upper[mask], TAIL))
    mm = measure.mismatch_numbers(old, batch["sampler_logp"], batch["response_mask"])
    kv_stats = kv_statistics(out, np.asarray(lengths), arm.kv_config, ids.shape[1], model_cfg, arm.max_new)
    res.update(
        arm=dataclasses.asdict(arm),
        kl_k3=mm["kl_k3"],
        token_reject=mm["token_reject"],
        xi_p5=mm["xi_p5"],
        kv_saving=kv_stats["kv/saving"],
        mean_length=float(np.mean(np.asarray(out.lengths))),
        total_s=time.perf_counter() - t0,
    )
    return res
