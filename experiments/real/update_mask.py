"""QuRL's update masking (Li et al., Eq. 10-12), measured: after one optimizer step at a small
learning rate, how many quantized weight codes change? An update smaller than half a quantization
step leaves the code, so the quantized rollout policy does not move with the weights; invariant
scaling (q/k/v kernels / s, their RMSNorm * s) shrinks the q/k/v quantization grid by s while
Adam's step stays ~lr, so more q/k/v codes move.

The step: the project's update (rl/update.py, rl.mode=qurl: TIS weights min(rho, 2) + ACR, the
clipped GRPO surrogate, k3 KL to the initial weights, AdamW from rl/optim.py at lr 1e-6) on a
batch of int8 W8A8 rollouts of the arm's weights, one minibatch, advantage = the batch-standardised
negative response length (a brevity reward: a chat model has no verifiable answer here).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from experiments.real import measure
from sparserl_jax import quant
from sparserl_jax.quant.config import PROJECTIONS
from sparserl_jax.rl.advantages import grpo_advantages
from sparserl_jax.rl.config import OptimConfig, RLConfig, UpdateConfig
from sparserl_jax.rl.optim import make_optimizer
from sparserl_jax.rl.update import make_update_fn

GROUPS = {"qkv": ("q", "k", "v"), "o_mlp": ("o", "gate", "up", "down")}
FORMATS = ("int8", "fp8")


def code_change_fractions(before: dict, after: dict, fmt: str) -> dict:
    """Fraction of quantized codes (QWeight values, per-output-channel absmax) that differ
    between the two weight trees, per group of projections and over all of them."""
    cfg = quant.QuantConfig(format=fmt)
    qb, qa = quant.quantize_params(before, cfg), quant.quantize_params(after, cfg)
    out = {}
    for group, names in {**GROUPS, "all": tuple(PROJECTIONS)}.items():
        changed = total = 0
        for lb, la in zip(qb["layers"], qa["layers"]):
            for n in names:
                vb = np.asarray(lb[n].values).astype(np.float32)
                va = np.asarray(la[n].values).astype(np.float32)
                changed += int(np.sum(vb != va))
                total += vb.size
        out[group] = changed / max(total, 1)
    return out


def weight_change_fraction(before: dict, after: dict) -> float:
    """Fraction of full-precision projection weights the step changed at all (sanity: ~1)."""
    changed = total = 0
    for lb, la in zip(before["layers"], after["layers"]):
        for n in PROJECTIONS:
            changed += int(np.sum(np.asarray(lb[n]) != np.asarray(la[n])))
            total += lb[n].size
    return changed / max(total, 1)


def update_arm(arm: measure.Arm, lr: float = 1e-6, micro_batch: int = 4) -> dict:
    """One update step from the arm's (invariant-scaled or not) weights on its int8 W8A8
    rollouts; the fraction of int8 and fp8 codes that change."""
    model_cfg, params, tok, ids, lengths = measure.load(arm)
    arm = dataclasses.replace(arm, quant="int8", quant_mode="w8a8")
    cfg = measure.sampler_config(arm, tok)
    out = measure.sample(
        measure.behaviour_params(arm, params), model_cfg, ids, lengths, cfg, arm.seed, arm.rows_per_call
    )
    batch = measure.rollout_batch(model_cfg, params, ids, lengths, out, tok)
    B = len(ids)
    batch["ref_logp"] = batch["old_logp"]
    batch["advantages"] = grpo_advantages(-jnp.asarray(out.lengths, jnp.float32), group_size=B)
    rl = RLConfig(
        mode="qurl",
        optim=OptimConfig(lr=lr),
        update=UpdateConfig(
            minibatch_size=B, micro_batch_size=min(micro_batch, B), temperature=measure.TEMPERATURE, donate=False
        ),
    )
    optimizer = make_optimizer(rl.optim)
    update = make_update_fn(model_cfg, rl, optimizer)
    new_params, _, metrics = update(params, optimizer.init(params), batch)
    new_params = jax.device_get(new_params)
    return {
        "arm": dataclasses.asdict(arm),
        "lr": lr,
        "rows": B,
        "loss": "qurl (TIS + ACR), brevity reward",
        "skipped": float(metrics["skipped"]),
        "grad_norm": float(metrics["grad_norm"]),
        "weights_changed": weight_change_fraction(params, new_params),
        "codes_changed": {fmt: code_change_fractions(params, new_params, fmt) for fmt in FORMATS},
    }
