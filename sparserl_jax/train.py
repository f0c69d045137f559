"""The RL loop: rollout (dense or sparse KV) -> reward -> score (pi_old, pi_ref) -> update.

  python -m sparserl_jax.train --config experiments/configs/tiny.yaml [key=value ...]

Each iteration samples `rollout.prompts` x `rollout.samples` responses with theta_old (the
current weights) through the sampler, scores them with the task reward, computes GRPO
advantages, teacher-forces pi_old and pi_ref, and runs the jitted update step, whose `rl.mode`
decides the corrections (dense, naive_sparse, sparse_rl, sars_only, ibr_only, tis, qurl).
With `rollout.rows_per_call` set, the rows are sampled that many per sampler call (chunk i with
fold_in(key, i)) and joined, which bounds the rollout's device memory (python -m sparserl_jax.dryrun).
Randomness is a function of (train.seed, iteration), so a run resumed from its last checkpoint
continues exactly as the uninterrupted run would have.

On several processes (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID; see
sparserl_jax/distributed.py) every process runs this same loop over one global mesh: each draws the
same prompts from the same seeded source, keeps only its own shards of the batch, and fetches the
full rollout and metrics (distributed.to_host); process 0 alone writes config.yaml, metrics.jsonl
and TensorBoard, while every process takes part in the (orbax) checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from tqdm import tqdm

from sparserl_jax import cli, components, distributed, quant
from sparserl_jax.checkpoint import Checkpointer
from sparserl_jax.config import TrainConfig, dump_config, load_config
from sparserl_jax.evaluate import evaluate_examples
from sparserl_jax.metrics_log import MetricsLogger
from sparserl_jax.rl.advantages import grpo_advantages
from sparserl_jax.rl.batch import assemble
from sparserl_jax.rl.diagnostics import rollout_diagnostics
from sparserl_jax.rl.optim import make_optimizer
from sparserl_jax.rl.update import make_score_fn, make_update_fn
from sparserl_jax.rollout.engine import SlotEngine
from sparserl_jax.rollout.sampler import Rollout, cache_capacity
from sparserl_jax.rollout.scheduler import SortedScheduler
from sparserl_jax.model import sharding
from sparserl_jax.sft import sft_warm_start


def kv_statistics(out, prompt_lengths: np.ndarray, kv_cfg, P: int, model_cfg, max_new: int) -> dict:
    """KV entries the sparse sampler kept vs a dense cache, per generated token, and cache bytes."""
    mask = np.asarray(out.mask)
    seen = prompt_lengths[:, None] + np.arange(mask.shape[1])[None]
    kept = float(np.sum(np.asarray(out.kept) * mask))
    dense = float(np.sum(seen * mask))
    bytes_per_slot = 2 * model_cfg.n_layers * model_cfg.n_kv_heads * model_cfg.head_dim * (
        jnp.dtype(model_cfg.dtype).itemsize
    )
    B = mask.shape[0]
    dense_slots = cache_capacity(dataclasses.replace(kv_cfg, policy="none"), P, max_new)
    return {
        "kv/kept_mean": kept / max(mask.sum(), 1),
        "kv/dense_mean": dense / max(mask.sum(), 1),
        "kv/saving": 1.0 - kept / max(dense, 1.0),
        "kv/cache_bytes": float(B * cache_capacity(kv_cfg, P, max_new) * bytes_per_slot),
        "kv/dense_cache_bytes": float(B * dense_slots * bytes_per_slot),
        "kv/compressions": float(np.mean(np.asarray(out.n_compressions))),
        "kv/evicted_fraction": float(np.mean(np.asarray(out.evicted_fraction))),
    }


def concat_rollouts(outs: Sequence[Rollout]) -> Rollout:
    """Host-side Rollouts of consecutive row chunks joined along the batch axis (axis 0; the
    per-chunk kept_positions [R, L, B, K, C], when recorded, along its axis 2)."""
    def cat(name):
        leaves = [getattr(o, name) for o in outs]
        if leaves[0] is None:
            return None
        return np.concatenate([np.asarray(x) for x in leaves], axis=2 if name == "kept_positions" else 0)

    return Rollout(**{f.name: cat(f.name) for f in dataclasses.fields(Rollout)})


def rollout_bubble(lengths: np.ndarray, max_new_tokens: int, buffer: int) -> dict:
    """The static sampler's bubble ratio: its B rows run until the longest ends (whole chunks of
    `buffer` steps), so 1 - generated tokens / (B x steps); with every step taking the same time
    this is also SortedRL's wall-time form (the prefill, not timed apart, is left out)."""
    lengths = np.asarray(lengths)
    steps = min(-(-int(lengths.max()) // buffer) * buffer, -(-max_new_tokens // buffer) * buffer)
    bubble = 1.0 - float(lengths.sum()) / max(lengths.size * steps, 1)
    return {"rollout/bubble_slots": bubble, "rollout/bubble_wall": bubble}


class TrainingDiverged(cli.RunFailed):
    """Training stopped: too many consecutive iterations with skipped optimizer steps."""


def _skipped(metrics: dict) -> bool:
    """Were all of this iteration's optimizer steps skipped (non-finite loss or gradient)?"""
    return (not np.isfinite(metrics.get("update/loss", 0.0))
            or metrics.get("update/skipped", 0) >= max(metrics.get("update/steps", 1), 1))


class Trainer:
    """Holds a run's state; `run()` trains from the last checkpoint (or the start) to the end."""

    def __init__(self, cfg: TrainConfig, *, log=print):
        self.cfg = cfg
        self.coordinator = distributed.is_coordinator()
        self.log = log if self.coordinator else (lambda *args, **kwargs: None)
        r = cfg.rollout
        self.batch_rows = r.rows
        mb = cfg.rl.update.minibatch_size
        if self.batch_rows % mb:
            raise ValueError(
                f"rollout.prompts x rollout.samples = {self.batch_rows} must be a multiple of "
                f"rl.update.minibatch_size={mb}"
            )
        parts = components.build_model(cfg)
        components.check_lengths(cfg, parts.model_cfg)
        self.curriculum_task = components.curriculum_task(cfg)
        self.parts = parts
        self.model_cfg = parts.model_cfg
        self.tokenizer = parts.tokenizer
        # One mesh for the run: params split by the partition rules, batches over data x fsdp
        # (a no-op layout on a single device); jit propagates the shardings through every step.
        self.mesh = sharding.make_mesh(cfg.mesh)
        self.call_rows = r.call_rows
        dp = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
        if r.rows_per_call and r.rows_per_call % dp:
            raise ValueError(
                f"rollout.rows_per_call={r.rows_per_call} must be a multiple of mesh data x fsdp "
                f"= {dp}: each sampler call's rows are split over those devices"
            )
        self.params = self._place(parts.params)
        parts.params = None  # self.params may be the same buffers, which the update donates
        self.ref_params = self.params  # until start(): a copy, or the saved reference restored
        self.optimizer = make_optimizer(cfg.rl.optim)
        self.opt_state = self._init_opt_state()
        self.update = make_update_fn(self.model_cfg, cfg.rl, self.optimizer,
                                     donate=cfg.rl.update.donate)
        self.score = make_score_fn(self.model_cfg, cfg.rl.update)
        self.sampler_cfg = components.sampler_config(cfg, self.tokenizer)
        self.prompts = components.prompt_source(cfg, self.tokenizer, batch_size=r.prompts)
        self._check_prompts()
        self.sorted = None  # rollout.scheduler='sorted': the SortedRL scheduler (built on first use)
        self._saved_at = 0
        self.iteration = 0
        self.started = False
        os.makedirs(cfg.train.out_dir, exist_ok=True)
        self.ckpt = Checkpointer(os.path.join(cfg.train.out_dir, "checkpoints"), cfg.train.keep_checkpoints)
        self.ref_ckpt = Checkpointer(os.path.join(cfg.train.out_dir, "reference"), 1)
        self.logger = MetricsLogger(cfg.train.out_dir) if self.coordinator else None

    def _check_prompts(self) -> None:
        """Draw the first training batch and the held-out prompts now (then rewind), so that a
        prompt longer than data.max_prompt_len stops the run before the warm start, not after."""
        state = self.prompts.state_dict()
        batches = [self.prompts.next_batch(),
                   components.eval_examples(self.cfg, self.tokenizer, n=self.cfg.train.eval_prompts)]
        self.prompts.load_state_dict(state)
        for batch in batches:
            if batch:
                components.pad_prompt_batch([e.prompt_ids for e in batch], 0, self.cfg.data.max_prompt_len)

    def _place(self, params):
        return sharding.shard_params(params, self.mesh) if self.mesh.size > 1 else params

    def _init_opt_state(self):
        """optimizer.init, its scalars (step counts) replicated on the mesh as the update step
        returns them, so that the second update does not compile again for other input shardings."""
        state = self.optimizer.init(self.params)
        if self.mesh.size == 1:
            return state
        replicated = NamedSharding(self.mesh, PartitionSpec())
        return jax.tree.map(lambda x: x if x.ndim else sharding.place(x, replicated), state)

    def _batch(self, x):
        return sharding.shard_batch(jnp.asarray(x), self.mesh) if self.mesh.size > 1 else jnp.asarray(x)

    # ------------------------------------------------------------------ state

    def start(self) -> None:
        """Resume from the latest checkpoint, or warm-start (SFT) and save the reference model."""
        self.started = True
        if self.coordinator:
            dump_config(self.cfg, os.path.join(self.cfg.train.out_dir, "config.yaml"))
        found = self.ckpt.restore_latest({"params": self.params, "opt_state": self.opt_state},
                                         log=self.log)
        if found is not None:
            step, items, meta = found
            self.params, self.opt_state = items["params"], items["opt_state"]
            self.ref_params = self.ref_ckpt.restore(0, {"params": self.params})[0]["params"]
            self.prompts.load_state_dict(meta["data"])
            self.iteration = self._saved_at = int(meta["iteration"])
            if self.cfg.rollout.scheduler == "sorted":
                self._sorted_scheduler().group = int(meta.get("sorted_group", -1))
                if not meta.get("sorted_group_boundary", True):
                    self.log("this checkpoint was saved inside a SortedRL group: its remaining "
                             "prompts are skipped (resume is exact only from group boundaries)")
            saved = meta.get("invariant_scale", 1.0)  # already in the saved weights: never again
            if saved != self._scaling_meta()["invariant_scale"]:
                raise ValueError(
                    f"quant.invariant_scaling / quant.invariant_s: the checkpoint's weights were "
                    f"scaled by {saved}, this config asks for {self._scaling_meta()['invariant_scale']}"
                )
            if self.logger:
                self.logger.truncate_after(self.iteration)
            self.log(f"resumed from {self.ckpt.directory} at iteration {self.iteration}")
            return
        if self.logger:  # a fresh start: metrics of an earlier attempt killed before its first save
            self.logger.truncate_after(0)
        sft = self.cfg.sft
        if (sft.steps or sft.curriculum.steps) and self.parts.task is not None:
            prompt_len = self.cfg.data.max_prompt_len
            self.params, loss = sft_warm_start(
                self.params, self.model_cfg, self.parts.task, self.tokenizer, sft,
                seed=self.cfg.train.seed, width=prompt_len + self.cfg.rollout.max_new_tokens,
                curriculum_task=self.curriculum_task,
                curriculum_width=prompt_len + (sft.curriculum.max_new_tokens or self.cfg.rollout.max_new_tokens),
                render=components.render_prompt(self.cfg, self.tokenizer), log=self.log,
            )
            self.params = self._place(self.params)
            self.opt_state = self._init_opt_state()
        q = self.cfg.quant
        if q.invariant_scaling:  # once, before pi_ref and the optimizer state (checkpoints hold it)
            self.params = self._place(quant.invariant_scale(self.params, q.invariant_s))
            self.opt_state = self._init_opt_state()
        # pi_ref gets its own buffers: the update step donates (deletes) those of self.params
        self.ref_params = jax.tree.map(jnp.copy, self.params)
        self.ref_ckpt.save(0, {"params": self.ref_params},
                           {"what": "reference policy pi_ref", **self._scaling_meta()})

    def _scaling_meta(self) -> dict:
        q = self.cfg.quant
        return {"invariant_scale": q.invariant_s if q.invariant_scaling else 1.0}

    def save(self) -> None:
        meta = {"iteration": self.iteration, "data": self.prompts.state_dict(), **self._scaling_meta()}
        if self.sorted is not None:
            meta.update(sorted_group=self.sorted.group, sorted_group_boundary=self.sorted.at_group_boundary)
        self._saved_at = self.iteration
        self.ckpt.save(self.iteration, {"params": self.params, "opt_state": self.opt_state}, meta)

    # ------------------------------------------------------------------ one iteration

    def rollout_batch(self, key):
        """Sample, reward, and assemble the update batch for one iteration."""
        cfg = self.cfg
        n = cfg.rollout.samples
        extra = {}
        if cfg.rollout.scheduler == "sorted":
            t0 = time.perf_counter()
            examples, tokens, lengths, out, extra = self._sorted_rollout()
            t_rollout = time.perf_counter() - t0
            ids = [list(e.prompt_ids) for e in examples for _ in range(n)]
        else:
            examples = self.prompts.next_batch()
            if not examples:
                raise ValueError("the prompt source returned an empty batch (empty dataset?)")
            ids = [list(e.prompt_ids) for e in examples for _ in range(n)]
            tokens, lengths = components.pad_prompt_batch(ids, self.tokenizer.pad_token_id, cfg.data.max_prompt_len)
            t0 = time.perf_counter()
            out = self._generate(tokens, lengths, key)
            t_rollout = time.perf_counter() - t0
            extra = rollout_bubble(out.lengths, self.sampler_cfg.max_new_tokens, cfg.kv.buffer)
        texts = [self.tokenizer.decode(out.tokens[i, : out.lengths[i]].tolist()) for i in range(len(ids))]
        labels = [e.label for e in examples for _ in range(n)]
        rewards = np.array([self.parts.reward(t, l) for t, l in zip(texts, labels)], np.float32)
        batch = assemble(jnp.asarray(tokens), jnp.asarray(lengths), out.tokens, out.logprobs, out.mask,
                         pad_token_id=self.tokenizer.pad_token_id)
        batch["advantages"] = grpo_advantages(jnp.asarray(rewards), n)
        batch = {k: self._batch(v) for k, v in batch.items()}
        truncated = np.mean(out.lengths >= self.sampler_cfg.max_new_tokens)
        metrics = {
            "reward/mean": float(rewards.mean()),
            "reward/accuracy": float((rewards >= 1.0).mean()),
            "response/length_mean": float(out.lengths.mean()),
            "response/truncated_fraction": float(truncated),
            "time/rollout_s": t_rollout,
            "throughput/rollout_tokens_per_s": float(out.lengths.sum()) / max(t_rollout, 1e-9),
            **kv_statistics(out, lengths, self.cfg.kv, tokens.shape[1], self.model_cfg,
                            self.sampler_cfg.max_new_tokens),
            **extra,
        }
        return batch, metrics, texts

    def _sorted_scheduler(self) -> SortedScheduler:
        if self.sorted is None:
            r, s = self.cfg.rollout, self.cfg.sorted
            # one engine for the run: every group's prompts are padded to data.max_prompt_len,
            # so each of its programs compiles once
            engine = SlotEngine(self.model_cfg, self.sampler_cfg, s.slots or self.batch_rows,
                                self.cfg.data.max_prompt_len, segment_chunks=s.segment_chunks,
                                mesh=self.mesh)
            self.sorted = SortedScheduler(engine, s, prompts_per_batch=r.prompts, samples=r.samples)
        return self.sorted

    def _sorted_rollout(self):
        """SortedRL: the next update batch of the slot engine (loading a group of
        sorted.group_batches x rollout.prompts prompts at a group boundary)."""
        sched, cfg = self._sorted_scheduler(), self.cfg
        if sched.at_group_boundary:
            examples = [e for _ in range(cfg.sorted.group_batches) for e in self.prompts.next_batch()]
            if not examples:
                raise ValueError("the prompt source returned an empty batch (empty dataset?)")
            tokens, lengths = components.pad_prompt_batch(  # the engine's one prompt width
                [e.prompt_ids for e in examples], self.tokenizer.pad_token_id, sched.engine.P, fixed=True)
            key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.train.seed), 0x5011ED),
                                     sched.group + 1)
            sched.load_group(examples, tokens, lengths, key)
        params = quant.quantize_params(self.params, cfg.quant)  # QuRL: the behaviour weights
        examples, tokens, lengths, fin, metrics = sched.next_batch(params, self.iteration)
        return examples, tokens, lengths, fin.to_rollout(), metrics

    def _generate(self, tokens: np.ndarray, lengths: np.ndarray, key) -> Rollout:
        """Sample every row, `self.call_rows` rows per generate_jit call (one compiled shape);
        row b is request b of the iteration's key in whichever call samples it, so the rollout
        does not depend on rollout.rows_per_call. Each chunk's outputs are fetched to the host
        before the next call, so only one call's cache, activations and outputs are on the
        devices at a time."""
        B = tokens.shape[0]
        R = self.cfg.rollout.rows_per_call or B  # 0: one call, whatever the batch holds
        if B % R:
            raise ValueError(
                f"rollout.rows_per_call={R} does not divide this batch of {B} rows (the prompt "
                "source returned fewer prompts than rollout.prompts?)"
            )
        n_calls = B // R
        # QuRL: the behaviour policy is theta_old quantized afresh from full precision
        params = quant.quantize_params(self.params, self.cfg.quant)
        outs = [
            distributed.generate_on_mesh(
                params, self.model_cfg, tokens[i * R:(i + 1) * R], lengths[i * R:(i + 1) * R],
                key, self.sampler_cfg, self.mesh, request_ids=np.arange(i * R, (i + 1) * R),
            )
            for i in range(n_calls)
        ]
        return outs[0] if n_calls == 1 else concat_rollouts(outs)

    def _save_due(self) -> bool:
        """Every train.save_every iterations and at the end; with the sorted scheduler at the
        first group boundary at or after each save point (an exact resume point)."""
        t = self.cfg.train
        if self.iteration == t.iterations:
            return True
        if self.sorted is None:
            return self.iteration % t.save_every == 0
        return self.sorted.at_group_boundary and (
            self.iteration // t.save_every > self._saved_at // t.save_every)

    def step(self) -> dict:
        if not self.started:  # start() gives pi_ref its own buffers before the first donation
            self.start()
        key = jax.random.fold_in(jax.random.key(self.cfg.train.seed), self.iteration)
        batch, metrics, _ = self.rollout_batch(key)
        t0 = time.perf_counter()
        batch["old_logp"] = self.score(self.params, batch["tokens"])
        batch["ref_logp"] = self.score(self.ref_params, batch["tokens"])
        jax.block_until_ready(batch["ref_logp"])
        t1 = time.perf_counter()
        # host-side diagnostics of this rollout batch (SARS as the update applies it, loops, mismatch)
        host = distributed.to_host({k: batch[k] for k in
                                    ("tokens", "response_mask", "sampler_logp", "old_logp", "advantages")})
        metrics.update(rollout_diagnostics(host["tokens"], host["response_mask"], host["sampler_logp"],
                                           host["old_logp"], host["advantages"], self.cfg.rl))
        t2 = time.perf_counter()
        self.params, self.opt_state, upd = self.update(self.params, self.opt_state, batch)
        upd = distributed.to_host(upd)
        t3 = time.perf_counter()
        n_tokens = float(np.sum(host["response_mask"]))
        metrics.update({k if "/" in k else f"update/{k}": float(v) for k, v in upd.items()})
        metrics.update({
            "time/score_s": t1 - t0,
            "time/diagnostics_s": t2 - t1,
            "time/update_s": t3 - t2,
            "throughput/update_tokens_per_s": n_tokens / max(t3 - t2, 1e-9),
        })
        if not np.isfinite(metrics.get("update/loss", 0.0)) or metrics.get("update/skipped", 0) > 0:
            self.log(f"iteration {self.iteration}: {int(metrics.get('update/skipped', 0))} "
                     "optimizer step(s) skipped (non-finite loss or gradient)")
        return metrics

    def evaluate(self, *, kv_cfg=None, n: int | None = None) -> dict:
        """avg@1 on held-out prompts with the training sampler (or another KV config)."""
        examples = components.eval_examples(self.cfg, self.tokenizer, n=n or self.cfg.train.eval_prompts)
        sampler_cfg = components.sampler_config(self.cfg, self.tokenizer, kv_cfg=kv_cfg)
        return evaluate_examples(
            self.params, self.model_cfg, self.tokenizer, examples, self.parts.reward, sampler_cfg,
            seed=self.cfg.train.seed + 1, batch_size=max(self.call_rows, 1),
            max_prompt_len=self.cfg.data.max_prompt_len, mesh=self.mesh,
        )

    # ------------------------------------------------------------------ loop

    def run(self) -> list[dict]:
        if not self.started:
            self.start()
        t = self.cfg.train
        history = []
        skipped_run = 0  # iterations in a row whose optimizer steps were all skipped
        bar = tqdm(range(self.iteration, t.iterations), disable=not (t.progress and self.coordinator),
                   desc="train", initial=self.iteration, total=t.iterations)
        for _ in bar:
            metrics = self.step()
            self.iteration += 1
            if t.eval_every and self.iteration % t.eval_every == 0:
                metrics["eval/accuracy"] = self.evaluate()["accuracy"]
            if self.logger:
                self.logger.log(self.iteration, metrics)
            history.append(metrics)
            skipped_run = skipped_run + 1 if _skipped(metrics) else 0
            if t.max_skipped_iterations and skipped_run >= t.max_skipped_iterations:
                good = self.iteration - skipped_run
                self.ckpt.delete_after(good)
                if self.logger:
                    self.logger.close()
                raise TrainingDiverged(
                    f"training stopped at iteration {self.iteration}: the optimizer step was skipped "
                    f"(non-finite loss or gradient) in {skipped_run} iterations in a row "
                    f"(train.max_skipped_iterations={t.max_skipped_iterations}); checkpoints after "
                    f"iteration {good} deleted, the last one kept is {self.ckpt.latest_step()} "
                    "(lower rl.optim.lr?)"
                )
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kv=f"{metrics['kv/saving']:.0%}")
            if self._save_due():
                self.save()
        if self.logger:
            self.logger.close()
        return history


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m sparserl_jax.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", action="append", default=[], help="YAML file(s), merged in order")
    p.add_argument("overrides", nargs="*", help="key=value settings, e.g. kv.budget=256")
    args = p.parse_args(argv)
    distributed.initialize()  # before any other JAX call; a no-op on a single process
    cfg = load_config(args.config, args.overrides)
    return Trainer(cfg).run()


if __name__ == "__main__":
    cli.run(main)
