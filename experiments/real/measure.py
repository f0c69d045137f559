"""One arm of the real-model measurements: sample chat rollouts with a behaviour policy (sparse
KV and/or quantized weights), teacher-force the dense full-precision model over the same tokens,
and measure the mismatch the corrections see (docs/methods.md#three-policies-xi-and-r, #sars,
#qurl). Every function here runs inside one single-core worker process (experiments/lib/workers.py)
and returns plain floats and lists.

Per-token estimators on the sampler's tokens o_t ~ pi_s (xi_t = pi_dense(o_t) / pi_s(o_t)):
  k1 = mean(-log xi)            } unbiased for KL(pi_s || pi_dense), the quantity the update logs
  k3 = mean(xi - 1 - log xi)    } as mismatch/kl_k1 and mismatch/kl_k3 (rl/corrections.py);
  kl_dense_sparse = mean(xi log xi)  importance-weighted, unbiased for KL(pi_dense || pi_s).
SARS (token band [0.5, 1.5], veto min xi < 1e-4) is rl.corrections' own, at its defaults.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from experiments.real import prompts as prompt_list
from sparserl_jax import kvcache as kv
from sparserl_jax import quant
from sparserl_jax.model import hf
from sparserl_jax.rl.batch import assemble
from sparserl_jax.rl.config import RLConfig, UpdateConfig
from sparserl_jax.rl.corrections import log_xi_raw
from sparserl_jax.rl.corrections.compose import mismatch_metrics
from sparserl_jax.rl.update import make_score_fn
from sparserl_jax.rollout.sampler import SamplerConfig, generate_jit
from sparserl_jax.rollout.sampling import SamplingConfig
from sparserl_jax.rollout.source import concat_rollouts
from sparserl_jax.rollout.stats import kv_statistics
from sparserl_jax.tokenizer import HFTokenizer

SARS = RLConfig(mode="sparse_rl")  # token band [0.5, 1.5], veto 1e-4, log-ratio clamp 20
TEMPERATURE = 1.0


@dataclasses.dataclass(frozen=True)
class Arm:
    """A behaviour policy and the workload it samples."""

    name: str
    checkpoint: str
    prompts: int
    max_new: int
    seed: int = 0
    policy: str = "none"  # kv.policy
    budget: int = 128
    buffer: int = 32
    quant: str = "none"  # quant.format
    quant_mode: str = "w8a8"
    invariant_s: float = 0.0  # QuRL invariant scaling of the dense weights first (0: off)
    rows_per_call: int = 64
    schedule: tuple[int, ...] = ()  # kv.budget_schedule (entries <= budget)
    every: int = 2048  # kv.schedule_every

    @property
    def kv_config(self) -> kv.KVConfig:
        if self.policy == "none":
            return kv.KVConfig(buffer=self.buffer)
        return kv.KVConfig(
            policy=self.policy,
            budget=self.budget,
            buffer=self.buffer,
            budget_schedule=self.schedule,
            schedule_every=self.every,
        )


def arm_from_args(args, name: str, **kw) -> Arm:
    """The arm a measurement's command line asks for (its checkpoint, prompts, lengths, seed,
    buffer and rows per call), with `kw` (policy, budget, ...) on top."""
    return Arm(
        name=name,
        checkpoint=args.checkpoint,
        prompts=args.prompts,
        max_new=args.max_new,
        seed=args.seed,
        buffer=args.buffer,
        rows_per_call=args.rows_per_call,
        **kw,
    )


def load(arm: Arm):
    """(model config, dense params with invariant scaling if asked, tokenizer, prompts, lengths)."""
    model_cfg, params = hf.load_params(arm.checkpoint)
    if arm.invariant_s:
        params = quant.invariant_scale(params, arm.invariant_s)
    tok = HFTokenizer.from_dir(arm.checkpoint)
    ids, lengths, _ = prompt_list.chat_prompts(tok, arm.prompts)
    return model_cfg, params, tok, ids, lengths


def sampler_config(arm: Arm, tok, max_new: int | None = None) -> SamplerConfig:
    return SamplerConfig(
        max_new_tokens=max_new or arm.max_new,
        sampling=SamplingConfig(TEMPERATURE),
        kv=arm.kv_config,
        eos_token_ids=tuple(tok.eos_token_ids),
        pad_token_id=tok.pad_token_id,
    )


def behaviour_params(arm: Arm, params):
    """The sampler's weights: the dense ones, or their quantized copy (native int8 / fp8 dot)."""
    if arm.quant == "none":
        return params
    return quant.quantize_params(params, quant.QuantConfig(format=arm.quant, mode=arm.quant_mode))


def sample(params, model_cfg, ids, lengths, cfg: SamplerConfig, seed: int, rows: int):
    """The sampler over all prompts, `rows` per call; request r = prompt row r (its own keys)."""
    key = jax.random.key(seed)
    outs = []
    for i in range(0, len(ids), rows):
        j = min(i + rows, len(ids))
        out = generate_jit(
            params,
            model_cfg,
            jnp.asarray(ids[i:j]),
            jnp.asarray(lengths[i:j]),
            key,
            cfg,
            jnp.arange(i, j, dtype=jnp.int32),
        )
        outs.append(jax.device_get(out))
    return concat_rollouts(outs)


def assemble_rollout(ids, lengths, out, pad_token_id: int) -> dict:
    """The sampler's rollout as an update batch (rl/batch.py; its top candidates when recorded)."""
    top = None if out.top_ids is None else (jnp.asarray(out.top_ids), jnp.asarray(out.top_logp))
    return assemble(
        jnp.asarray(ids),
        jnp.asarray(lengths),
        jnp.asarray(out.tokens),
        jnp.asarray(out.logprobs),
        jnp.asarray(out.mask),
        pad_token_id=pad_token_id,
        response_top=top,
    )


def rollout_batch(model_cfg, dense_params, ids, lengths, out, tok) -> dict:
    """Prompt + response tokens, response mask, sampler log-probs and the dense teacher-forced
    log-probs of the same tokens (host arrays, [B, P + M])."""
    batch = assemble_rollout(ids, lengths, out, tok.pad_token_id)
    score = make_score_fn(model_cfg, UpdateConfig(temperature=TEMPERATURE, score_batch_size=16))
    batch["old_logp"] = score(dense_params, batch["tokens"])
    return jax.device_get(batch)


def mismatch_numbers(old_logp, sampler_logp, mask) -> dict:
    """k1, k3, importance-weighted KL(dense || sampler), |dlogp|, SARS rates (rl.corrections)."""
    m = {k: float(v) for k, v in mismatch_metrics(old_logp, sampler_logp, mask, SARS).items()}
    raw = np.asarray(log_xi_raw(old_logp, sampler_logp, mask))
    mask = np.asarray(mask, bool)
    log_xi = raw[mask]
    xi = np.exp(np.clip(log_xi, -SARS.log_ratio_clamp, SARS.log_ratio_clamp))
    min_log_xi = np.where(mask, raw, np.inf).min(axis=1)
    return {
        "kl_k1": m["mismatch/kl_k1"],
        "kl_k3": m["mismatch/kl_k3"],
        "kl_dense_sparse": float(np.mean(xi * log_xi)) if log_xi.size else 0.0,
        "abs_dlogp_mean": m["mismatch/abs_dlogp_mean"],
        "abs_dlogp_max": m["mismatch/abs_dlogp_max"],
        "token_reject": m["sars/token_reject_rate"],
        "veto": m["sars/veto_rate"],
        "seq_reject": m["sars/seq_reject_rate"],
        "xi_p5": m["xi/p5"],
        "xi_p95": m["xi/p95"],
        "tokens": int(mask.sum()),
        "min_log_xi": [float(x) for x in min_log_xi],
    }


def mismatch_arm(arm: Arm) -> dict:
    """Sample the arm's rollouts, score them densely, return its mismatch and KV numbers."""
    t0 = time.perf_counter()
    model_cfg, params, tok, ids, lengths = load(arm)
    cfg = sampler_config(arm, tok)
    out = sample(behaviour_params(arm, params), model_cfg, ids, lengths, cfg, arm.seed, arm.rows_per_call)
    t_sample = time.perf_counter() - t0
    batch = rollout_batch(model_cfg, params, ids, lengths, out, tok)
    kv_stats = kv_statistics(out, np.asarray(lengths), arm.kv_config, ids.shape[1], model_cfg, arm.max_new)
    res = mismatch_numbers(batch["old_logp"], batch["sampler_logp"], batch["response_mask"])
    res.update(
        arm=dataclasses.asdict(arm),
        kv_saving=kv_stats["kv/saving"],
        kv_kept_mean=kv_stats["kv/kept_mean"],
        kv_dense_mean=kv_stats["kv/dense_mean"],
        lengths=[int(x) for x in out.lengths],
        truncated=float(np.mean(np.asarray(out.lengths) >= arm.max_new)),
        sample_s=t_sample,
        total_s=time.perf_counter() - t0,
    )
    return res
