"""Owns the learner step: rewards -> GRPO advantages -> batch -> pi_old / pi_ref -> update.
Must not touch sampling or the run directory: it imports no rollout/, run_state or train.

`Learner.batch` scores a host rollout (decoded responses through each row's reward,
data/reward_pool.py; each process checks its own share of the rows and the rewards are gathered),
computes GRPO advantages and assembles the update batch (layout in rl/batch.py) on the host;
`Learner.step` runs the length-bucketed update (rl/bucketed.py: pi_old and pi_ref teacher-forced
where they are needed, the update at the width of each micro-batch's longest row), then the
host-side rollout diagnostics. rl.mode picks the corrections. The learner holds functions and
settings only; params, optimizer state and pi_ref stay with the caller, which passes them in and
takes the updated ones back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from sparserl_jax import distributed
from sparserl_jax.data.reward_pool import RewardChecker
from sparserl_jax.model import precision, sharding
from sparserl_jax.rl import buckets
from sparserl_jax.rl.advantages import grpo_advantages
from sparserl_jax.rl.batch import assemble
from sparserl_jax.rl.bucketed import BucketedUpdate
from sparserl_jax.rl.config import RLConfig
from sparserl_jax.rl.diagnostics import agreement_metrics, rollout_diagnostics
from sparserl_jax.rl.optim import make_optimizer


def check_minibatch(rows: int, minibatch_size: int) -> None:
    if rows % minibatch_size:
        raise ValueError(
            f"rollout.prompts x rollout.samples = {rows} must be a multiple of "
            f"rl.update.minibatch_size={minibatch_size}"
        )


class Learner:
    """The update side of one run: its optimizer, update step and scorer on one mesh."""

    def __init__(
        self,
        rl: RLConfig,
        samples: int,
        model_cfg,
        mesh,
        tokenizer,
        reward: Callable[[str, str], float] | RewardChecker,
        *,
        max_len: int | None = None,
        response_len: int | None = None,
        kept_k: int = 0,
        top_k: int = 0,
        log: Callable = print,
    ):
        """`max_len`: data.max_prompt_len + rollout.max_new_tokens, the widest batch of the run;
        `response_len`: rollout.max_new_tokens (the head's window, update.head_window="response").
        `kept_k`: the kept-set record's width, rollout.top_k + TIE_SLOTS
        (rollout/sampling.py kept_width), when the run samples with top-p / top-k (its rollouts
        carry each token's kept set, which every log-prob is renormalised over), else 0. `top_k`:
        rollout.agreement_k when the run's rollouts record their top candidates, else 0: the
        sparse-dense agreement (rl/diagnostics.py agreement) is logged then. `reward`: a reward
        function (checked serially, rows' data_source picking theirs) or the run's RewardChecker."""
        self.rl, self.samples, self.mesh, self.model_cfg = rl, samples, mesh, model_cfg
        self.checker = reward if isinstance(reward, RewardChecker) else RewardChecker(reward)
        self.tokenizer, self.log = tokenizer, log
        self.optimizer = make_optimizer(rl.optim)
        self.update = BucketedUpdate(
            model_cfg,
            rl,
            self.optimizer,
            max_len=max_len,
            response_len=response_len,
            mesh=mesh,
            donate=rl.update.donate,
            kept_k=kept_k,
            top_k=top_k,
        )

    def place(self, params):
        """Params split over the mesh by the partition rules (committed to the one device
        otherwise, as the update returns them)."""
        if self.mesh.size > 1:
            return sharding.shard_params(params, self.mesh)
        return self.update._committed(params)

    def compute_copy(self, params):
        """The weights the forwards read (model.dtype), cast from the master `params` (model.
        param_dtype); `params` themselves when the two dtypes are one (model/precision.py)."""
        return precision.compute_copy(params, self.model_cfg)

    def init_opt_state(self, params):
        """optimizer.init, its scalars (step counts) placed as the update step returns them
        (committed to the device; replicated on a mesh): a jit's cache key holds each input's
        placement, so otherwise the second update would compile again."""
        state = self.optimizer.init(params)
        if self.mesh.size == 1:
            device = jax.devices()[0]
            return jax.tree.map(lambda x: x if x.ndim else jax.device_put(x, device), state)
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: x if x.ndim else sharding.place(x, replicated), state)

    def score(self, rollout) -> tuple[list[str], np.ndarray, dict]:
        """The responses of one rollout (a rollout.source.RolloutBatch: rows are each of its
        examples `samples` times, responses on the host) as text, their rewards [B] and the
        check's metrics. This process checks only its rows (distributed.process_rows); the
        rewards of all are gathered (a collective on several processes)."""
        t0 = time.perf_counter()
        n, examples, out = self.samples, rollout.examples, rollout.out
        rows = len(examples) * n
        texts = [self.tokenizer.decode(out.tokens[i, : out.lengths[i]].tolist()) for i in range(rows)]
        labels = [e.label for e in examples for _ in range(n)]
        sources = [getattr(e, "data_source", None) for e in examples for _ in range(n)]
        mine = distributed.process_rows(rows, jax.process_index(), jax.process_count())
        rewards, timed_out = self.checker.check(texts[mine], labels[mine], sources[mine])
        both_Bx2 = distributed.allgather_rows(np.stack([rewards, timed_out.astype(np.float32)], axis=1), rows)
        metrics = {"reward/timeouts": float(both_Bx2[:, 1].sum()), "time/reward_s": time.perf_counter() - t0}
        return texts, both_Bx2[:, 0].astype(np.float32), metrics

    def batch(self, rollout, scored: tuple[list[str], np.ndarray, dict] | None = None) -> tuple[dict, dict, list[str]]:
        """The update batch of one rollout as host arrays, its reward metrics and the responses;
        `scored`: what `score` returned for it, when the caller has it."""
        n, out = self.samples, rollout.out
        texts, rewards, checked = self.score(rollout) if scored is None else scored
        batch = assemble(
            jnp.asarray(rollout.tokens),
            jnp.asarray(rollout.lengths),
            out.tokens,
            out.logprobs,
            out.mask,
            pad_token_id=self.tokenizer.pad_token_id,
            response_kept_ids=out.kept_ids,
            response_top=None if out.top_ids is None else (out.top_ids, out.top_logp),
        )
        batch["advantages"] = grpo_advantages(jnp.asarray(rewards), n)
        batch = {k: np.asarray(v) for k, v in batch.items()}
        metrics = {"reward/mean": float(rewards.mean()), "reward/accuracy": float((rewards >= 1.0).mean())}
        return batch, {**metrics, **checked}, texts

    def close(self) -> None:
        """Stops the reward checker's worker processes (a no-op for serial checks)."""
        self.checker.close()

    def step(self, params, ref_params, opt_state, batch: dict, iteration: int, *, compute=None):
        """Update on one batch, then diagnose it: (params, opt_state, metrics). `compute`: the
        compute copy of `params` the rollout was sampled with (compute_copy; made here if None),
        donated with them."""
        t0 = time.perf_counter()
        params, opt_state, out = self.update(params, ref_params, opt_state, batch, compute=compute)
        t1 = time.perf_counter()
        batch["old_logp"] = out.old_logp
        # host-side diagnostics of this rollout batch (SARS as the update applies it, loops, mismatch)
        metrics = rollout_diagnostics(
            batch["tokens"], batch["response_mask"], batch["sampler_logp"], out.old_logp, batch["advantages"], self.rl
        )
        if out.old_top_logp is not None:
            metrics.update(
                agreement_metrics(batch["top_ids"], batch["top_logp"], out.old_top_logp, batch["response_mask"])
            )
        t2 = time.perf_counter()
        n_tokens = float(np.sum(batch["response_mask"]))
        metrics.update({k if "/" in k else f"update/{k}": float(v) for k, v in out.metrics.items()})
        metrics.update(
            {
                "time/score_s": out.score_s,
                "time/update_s": t1 - t0 - out.score_s,
                "time/diagnostics_s": t2 - t1,
                "throughput/update_tokens_per_s": n_tokens / max(t1 - t0 - out.score_s, 1e-9),
                "throughput/learner_tokens_per_s": n_tokens / max(t1 - t0, 1e-9),
                # positions the update ran beyond the rows' own, over the padded [B, T] batch's
                "update/padding_fraction": 1.0
                - float(np.sum(buckets.row_lengths(batch["response_mask"])))
                * self.rl.update.epochs
                / max(out.positions, 1),
            }
        )
        if not np.isfinite(metrics.get("update/loss", 0.0)) or metrics.get("update/skipped", 0) > 0:
            self.log(
                f"iteration {iteration}: {int(metrics.get('update/skipped', 0))} "
                "optimizer step(s) skipped (non-finite loss or gradient)"
            )
        return params, opt_state, metrics
