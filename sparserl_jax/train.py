"""The RL loop: rollout (dense or sparse KV) -> reward -> score (pi_old, pi_ref) -> update.
Owns the loop and its CLI; must not sample, score, update or write files itself (the rooms below).

  python -m sparserl_jax.train --config experiments/configs/walk_key_rkv.yaml [key=value ...]

One iteration: the rollout source (rollout/source.py: the static sampler or SortedRL's scheduler,
built by components.rollout_source) samples rollout.prompts x rollout.samples responses with
theta_old; the learner (rl/learner.py) rewards them, computes GRPO advantages, teacher-forces
pi_old and pi_ref and runs the update step (rl.mode picks the corrections); run_state.py keeps
checkpoints, resume, metrics and cadence. Randomness is a function of (train.seed, iteration), so
a resumed run continues exactly as the uninterrupted one. On several processes
(sparserl_jax/distributed.py) every process runs this loop over one global mesh; process 0 alone
writes config.yaml, metrics and TensorBoard, every process takes part in the (orbax) checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from tqdm import tqdm

from sparserl_jax import cli, components, distributed, host_memory, quant
from sparserl_jax.config import TrainConfig, load_config
from sparserl_jax.evaluate import evaluate_examples
from sparserl_jax.model import sharding
from sparserl_jax.rl.learner import Learner, check_minibatch
from sparserl_jax.rollout import question
from sparserl_jax.rollout.prompts import check_prompt_lengths
from sparserl_jax.rollout.sampling import SamplingConfig, kept_width
from sparserl_jax.run_state import RunState
from sparserl_jax.sft import run_warm_start


class Trainer:
    """Holds a run's state; `run()` trains from the last checkpoint (or the start) to the end."""

    def __init__(self, cfg: TrainConfig, *, log=print):
        # before JAX's backend starts; what it did is logged and kept (benchmarks record it)
        self.host_memory = host_memory.configure(cfg.train.host_memory)
        self.coordinator = distributed.is_coordinator()
        self.log = log if self.coordinator else (lambda *args, **kwargs: None)
        self.log(f"train.host_memory={cfg.train.host_memory}: {self.host_memory}")
        self.cfg = cfg = components.resolve_dtype(cfg, self.log)
        r = cfg.rollout
        self.batch_rows, self.call_rows = r.rows, r.call_rows
        check_minibatch(self.batch_rows, cfg.rl.update.minibatch_size)
        # One mesh for the run: params split by the partition rules (a checkpoint read straight
        # into them), batches over data x fsdp (a no-op layout on a single device); jit
        # propagates the shardings through every step.
        self.mesh = sharding.make_mesh(cfg.mesh)
        parts = self.parts = components.build_model(cfg, self.mesh)
        components.check_lengths(cfg, parts.model_cfg)
        self.curriculum_task = components.curriculum_task(cfg)
        self.model_cfg, self.tokenizer = parts.model_cfg, parts.tokenizer
        self.learner = Learner(
            cfg.rl,
            r.samples,
            self.model_cfg,
            self.mesh,
            self.tokenizer,
            components.reward_checker(cfg, parts.reward),
            max_len=cfg.data.max_prompt_len + r.max_new_tokens,
            response_len=r.max_new_tokens,
            kept_k=kept_width(r.top_k) if r.filters else 0,
            top_k=components.agreement_candidates(cfg),
            log=self.log,
        )
        self.params = self.learner.place(parts.params)
        parts.params = None  # self.params may be the same buffers, which the update donates
        self.ref_params = self.params  # until start(): a copy, or the saved reference restored
        self.opt_state = self.learner.init_opt_state(self.params)
        self.sampler_cfg = components.sampler_config(
            cfg,
            self.tokenizer,
            replay_filters=r.filters,
            agreement_k=components.agreement_candidates(cfg),
            record_prompt_kept=r.question_kv,
        )
        self._is_number = None  # the tokenizer's number tokens, for question/* (rollout.question_kv)
        self.prompts = components.prompt_source(cfg, self.tokenizer, batch_size=r.prompts)
        check_prompt_lengths(
            self.prompts,
            components.eval_examples(cfg, self.tokenizer, n=cfg.train.eval_prompts),
            cfg.data.max_prompt_len,
        )
        self.source = components.rollout_source(
            cfg, self.prompts, self.model_cfg, self.sampler_cfg, self.mesh, self.tokenizer.pad_token_id
        )
        self.iteration = 0
        self.started = False
        self.state = RunState(cfg, coordinator=self.coordinator, log=self.log)

    # ------------------------------------------------------------------ state

    def start(self) -> None:
        """Resume from the latest checkpoint, or warm-start (SFT) and save the reference model."""
        self.started = True
        found = self.state.restore(self.params, self.opt_state)
        if found is not None:
            self.params, self.opt_state, self.ref_params, meta = found
            self.ref_params = self.learner.compute_copy(self.ref_params)  # pi_ref is only scored
            self.source.load_state_dict(meta, self.log)
            self.iteration = self.state.resumed(meta)
            return
        params = run_warm_start(self.params, self.cfg, self.parts, self.curriculum_task, log=self.log)
        if params is not None:
            self._reset_policy(params)
        q = self.cfg.quant
        if q.invariant_scaling:  # once, before pi_ref and the optimizer state (checkpoints hold it)
            self._reset_policy(quant.invariant_scale(self.params, q.invariant_s))
        # pi_ref gets its own buffers: the update step donates (deletes) those of self.params
        self.ref_params = self.learner.place(jax.tree.map(jnp.copy, self.params))
        self.state.save_reference(self.ref_params)  # the master: checkpoints keep model.param_dtype
        self.ref_params = self.learner.compute_copy(self.ref_params)  # pi_ref is only scored

    def _reset_policy(self, params) -> None:
        self.params = self.learner.place(params)
        self.opt_state = self.learner.init_opt_state(self.params)

    def save(self) -> None:
        self.state.save(self.iteration, self.params, self.opt_state, self.source.state_dict())

    # ------------------------------------------------------------------ one iteration

    def rollout_batch(self, key, policy=None):
        """Sample (with `policy`, the compute copy of the params; default the params), reward,
        and assemble the update batch for one iteration."""
        rollout = self.source.next(self.params if policy is None else policy, key, self.iteration)
        texts, rewards, checked = self.learner.score(rollout)
        batch, metrics, texts = self.learner.batch(rollout, (texts, rewards, checked))
        if rollout.out.prompt_kept is not None:  # rollout.question_kv
            if self._is_number is None:
                self._is_number = question.number_token_ids(self.tokenizer, self.model_cfg.vocab_size)
            metrics.update(
                question.question_metrics(
                    rollout.out.prompt_kept, rollout.tokens, rollout.lengths, self._is_number, rewards
                )
            )
        return batch, {**metrics, **rollout.metrics}, texts

    def step(self) -> dict:
        if not self.started:  # start() gives pi_ref its own buffers before the first donation
            self.start()
        key = jax.random.fold_in(jax.random.key(self.cfg.train.seed), self.iteration)
        # theta_old in model.dtype, cast from the master after each update: the sampler's weights
        # (QuRL quantizes them) and the learner's (model/precision.py; the params themselves when
        # model.dtype is model.param_dtype)
        policy = self.learner.compute_copy(self.params)
        batch, metrics, _ = self.rollout_batch(key, policy)
        self.params, self.opt_state, learned = self.learner.step(
            self.params, self.ref_params, self.opt_state, batch, self.iteration, compute=policy
        )
        metrics.update(learned)
        return metrics

    def evaluate(self, *, kv_cfg=None, n: int | None = None) -> dict:
        """avg@1 on held-out prompts with the training sampler (or another KV config), at
        train.eval_temperature when it is set, on the rollout layout (rollout.mesh) from the
        compute copy the sampler reads."""
        t = self.cfg.train
        examples = components.eval_examples(self.cfg, self.tokenizer, n=n or t.eval_prompts)
        r = self.cfg.rollout
        sampling = None if t.eval_temperature is None else SamplingConfig(t.eval_temperature, r.top_p, r.top_k, r.draw)
        sampler_cfg = components.sampler_config(self.cfg, self.tokenizer, kv_cfg=kv_cfg, sampling=sampling)
        return evaluate_examples(
            self.learner.compute_copy(self.params),  # what the sampler reads (the master: no copy when one dtype)
            self.model_cfg,
            self.tokenizer,
            examples,
            self.parts.reward,
            sampler_cfg,
            seed=t.seed + 1,
            batch_size=t.eval_batch_size or max(self.call_rows, 1),
            max_prompt_len=self.cfg.data.max_prompt_len,
            mesh=self.mesh,
            layout=r.mesh,  # decoded on the rollouts' layout (rollout.mesh), placed once per evaluation
        )

    # ------------------------------------------------------------------ loop

    def run(self) -> list[dict]:
        if not self.started:
            self.start()
        t = self.cfg.train
        history = []
        skipped_run = 0  # iterations in a row whose optimizer steps were all skipped
        bar = tqdm(
            range(self.iteration, t.iterations),
            disable=not (t.progress and self.coordinator),
            desc="train",
            initial=self.iteration,
            total=t.iterations,
        )
        for _ in bar:
            metrics = self.step()
            self.iteration += 1
            if self.state.eval_due(self.iteration):
                dense = dataclasses.replace(self.cfg.kv, policy="none") if t.eval_kv == "dense" else None
                metrics["eval/accuracy"] = self.evaluate(kv_cfg=dense)["accuracy"]
            self.state.log_metrics(self.iteration, metrics)
            history.append(metrics)
            skipped_run = self.state.check_diverged(self.iteration, metrics, skipped_run)
            bar.set_postfix(reward=f"{metrics['reward/mean']:.3f}", kv=f"{metrics['kv/saving']:.0%}")
            if self.state.save_due(self.iteration, self.source.at_group_boundary):
                self.save()
        self.state.close()
        self.learner.close()
        return history


def main(argv: Sequence[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m sparserl_jax.train", description=__doc__.split("\n")[0])
    p.add_argument("--config", action="append", default=[], help="YAML file(s), merged in order")
    p.add_argument("overrides", nargs="*", help="key=value settings, e.g. kv.budget=256")
    distributed.add_distributed_arg(p)
    args = p.parse_args(argv)
    distributed.join(args.distributed)  # before any other JAX call; a no-op on a single process
    cfg = load_config(args.config, args.overrides)
    host_memory.configure(cfg.train.host_memory)  # before the backend starts (the Trainer logs it)
    cli.use_compile_cache(cfg.train.compile_cache)  # before the first compile: train.compile_cache
    return Trainer(cfg).run()


if __name__ == "__main__":
    cli.run(main)
