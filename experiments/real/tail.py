"""One arm of the tail measurement (experiments/real/tail_study.py): sample chat rollouts with a KV
policy at a fixed budget or a budget schedule, teacher-force the dense model over them, and
return Sparrow's per-token agreement (rl/diagnostics.py agreement: sum_v min(p_sampler(v),
p_dense(v)) over the sampler's top 20) pooled and by bin of tokens seen, with the mean mismatch
and the KV saving. Runs inside one single-core worker process (experiments/lib/workers.py)."""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.real import measure
from sparserl_jax.model import transformer
from sparserl_jax.rl.diagnostics import agreement
from sparserl_jax.rollout.stats import kv_statistics

TOP_K = 20  # Sparrow's top 20
TAIL = 0.05  # Sparrow's 5th percentile
ROWS = 16  # rows per teacher-forced scoring call


def dense_top_logp(model_cfg, params, tokens, top_ids, temperature: float = measure.TEMPERATURE):
    """Teacher-forced dense log-probs [B, T] of the tokens and [B, T, A] of the top ids."""
    fn = jax.jit(functools.partial(transformer.token_logprobs, cfg=model_cfg, temperature=temperature))
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


@dataclasses.dataclass
class Sampled:
    """One sampled batch's per-token tail material (response tokens only, flattened): the
    agreement's lower and upper values, the tokens seen at each, and the dense and sampler
    log-probs with the response mask (for the mismatch) and the KV numbers."""

    lower: np.ndarray
    upper: np.ndarray
    seen: np.ndarray
    old_logp: np.ndarray
    sampler_logp: np.ndarray
    mask: np.ndarray
    kv: dict
    lengths: np.ndarray


def sample_tail(model_cfg, params, ids, lengths, cfg, pad_token_id, seed: int, rows: int, temperature: float):
    """Sample `ids` with sampler config `cfg` (its agreement_k set), teacher-force the dense model
    over the same tokens, and return the batch's per-token agreement (Sampled)."""
    out = measure.sample(params, model_cfg, ids, lengths, cfg, seed, rows)
    batch = jax.device_get(measure.assemble_rollout(ids, lengths, out, pad_token_id))
    old, old_top = dense_top_logp(model_cfg, params, batch["tokens"], batch["top_ids"], temperature)
    mask = np.asarray(batch["response_mask"], bool)
    lower, upper = agreement(batch["top_ids"], batch["top_logp"], old_top)
    seen = np.broadcast_to(np.arange(mask.shape[1]) + 1, mask.shape)[mask]  # position t samples token t + 1
    kv_stats = kv_statistics(out, np.asarray(lengths), cfg.kv, ids.shape[1], model_cfg, cfg.max_new_tokens)
    return Sampled(
        lower[mask],
        upper[mask],
        seen,
        old,
        batch["sampler_logp"],
        batch["response_mask"],
        kv_stats,
        np.asarray(out.lengths),
    )


def pooled_tail(batches: list[Sampled], every: int) -> dict:
    """The tail numbers (tail_numbers), the upper bound's 5th percentile, k3 and the KV saving of
    one or more sampled batches, their tokens pooled (Sparrow pools a bin over its batch)."""
    res = tail_numbers(np.concatenate([b.lower for b in batches]), np.concatenate([b.seen for b in batches]), every)
    res["agreement_upper_p5"] = float(np.quantile(np.concatenate([b.upper for b in batches]), TAIL))
    k3 = [measure.mismatch_numbers(b.old_logp, b.sampler_logp, b.mask) for b in batches]
    tokens = [m["tokens"] for m in k3]
    res["kl_k3"] = float(np.average([m["kl_k3"] for m in k3], weights=tokens))
    res["token_reject"] = float(np.average([m["token_reject"] for m in k3], weights=tokens))
    if len(batches) == 1:
        res["xi_p5"] = k3[0]["xi_p5"]
    else:  # the pooled tokens' 5th percentile of xi = pi_dense / pi_sampler
        log_xi = np.concatenate(
            [(np.asarray(b.old_logp) - np.asarray(b.sampler_logp))[np.asarray(b.mask, bool)] for b in batches]
        )
        clamp = measure.SARS.log_ratio_clamp  # as the one-batch xi/p5 clamps it
        res["xi_p5"] = float(np.quantile(np.exp(np.clip(log_xi, -clamp, clamp)), TAIL))
    res["kv_saving"] = float(
        np.average([b.kv["kv/saving"] for b in batches], weights=[b.lengths.size for b in batches])
    )
    res["mean_length"] = float(np.mean(np.concatenate([b.lengths for b in batches])))
    return res


def tail_arm(arm: measure.Arm, every: int) -> dict:
    """Sample the arm's rollouts (recording their top 20), score them densely, return the
    agreement's tail (pooled and by bins of `every` tokens seen), k3 and the KV saving."""
    t0 = time.perf_counter()
    model_cfg, params, tok, ids, lengths = measure.load(arm)
    cfg = dataclasses.replace(measure.sampler_config(arm, tok), agreement_k=TOP_K)
    got = sample_tail(
        model_cfg, params, ids, lengths, cfg, tok.pad_token_id, arm.seed, arm.rows_per_call, measure.TEMPERATURE
    )
    res = pooled_tail([got], every)
    res.update(arm=dataclasses.asdict(arm), total_s=time.perf_counter() - t0)
    return res
