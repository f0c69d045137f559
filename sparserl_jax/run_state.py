"""Owns a run directory's bookkeeping: checkpoints, pi_ref, resume, metrics, save/eval cadence.
Must not touch rollouts, rewards or the update: it imports no rollout/, rl/ or train.

train.out_dir holds config.yaml, orbax checkpoints/ (params, optimizer state and the metadata:
iteration, the rollout source's state_dict, the invariant scale already in the weights), the
reference/ policy, metrics.jsonl and tensorboard/. A resume restores the newest intact checkpoint
and cuts the metrics back to its iteration, so no iteration is logged twice; the checkpoints
record quant.invariant_scaling so that a resumed run never scales its weights twice.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np

from sparserl_jax import cli
from sparserl_jax.checkpoint import Checkpointer
from sparserl_jax.config import TrainConfig, dump_config
from sparserl_jax.metrics_log import MetricsLogger


class TrainingDiverged(cli.RunFailed):
    """Training stopped: too many consecutive iterations with skipped optimizer steps."""


def _skipped(metrics: dict) -> bool:
    """Were all of this iteration's optimizer steps skipped (non-finite loss or gradient)?"""
    return not np.isfinite(metrics.get("update/loss", 0.0)) or metrics.get("update/skipped", 0) >= max(
        metrics.get("update/steps", 1), 1
    )


class RunState:
    """The files of one run (train.out_dir): written by process 0, checkpoints by every process."""

    def __init__(self, cfg: TrainConfig, *, coordinator: bool, log: Callable = print):
        self.cfg, self.coordinator, self.log = cfg, coordinator, log
        self.saved_at = 0  # the iteration of the last checkpoint written or restored
        out = cfg.train.out_dir
        os.makedirs(out, exist_ok=True)
        self.ckpt = Checkpointer(os.path.join(out, "checkpoints"), cfg.train.keep_checkpoints)
        self.ref_ckpt = Checkpointer(os.path.join(out, "reference"), 1)
        self.logger = MetricsLogger(out) if coordinator else None

    def scaling_meta(self) -> dict:
        q = self.cfg.quant
        return {"invariant_scale": q.invariant_s if q.invariant_scaling else 1.0}

    # ------------------------------------------------------------------ start and resume

    def restore(self, params, opt_state):
        """Write config.yaml, then (params, opt_state, ref_params, meta) of the newest intact
        checkpoint, or None on a fresh start (whose metrics.jsonl is emptied: an earlier attempt
        killed before its first save)."""
        if self.coordinator:
            dump_config(self.cfg, os.path.join(self.cfg.train.out_dir, "config.yaml"))
        found = self.ckpt.restore_latest({"params": params, "opt_state": opt_state}, log=self.log)
        if found is None:
            if self.logger:
                self.logger.truncate_after(0)
            return None
        _, items, meta = found
        ref_params = self.ref_ckpt.restore(0, {"params": items["params"]})[0]["params"]
        return items["params"], items["opt_state"], ref_params, meta

    def resumed(self, meta: dict) -> int:
        """The iteration a restored checkpoint resumes at; refuses a config whose invariant scale
        differs from the one already in the weights, and cuts the metrics back to it."""
        iteration = self.saved_at = int(meta["iteration"])
        saved = meta.get("invariant_scale", 1.0)  # already in the saved weights: never again
        if saved != self.scaling_meta()["invariant_scale"]:
            raise ValueError(
                f"quant.invariant_scaling / quant.invariant_s: the checkpoint's weights were "
                f"scaled by {saved}, this config asks for {self.scaling_meta()['invariant_scale']}"
            )
        if self.logger:
            self.logger.truncate_after(iteration)
        self.log(f"resumed from {self.ckpt.directory} at iteration {iteration}")
        return iteration

    def save_reference(self, ref_params) -> None:
        self.ref_ckpt.save(0, {"params": ref_params}, {"what": "reference policy pi_ref", **self.scaling_meta()})

    def save(self, iteration: int, params, opt_state, source_state: dict) -> None:
        """A checkpoint of `iteration` (source_state: the rollout source's state_dict())."""
        meta = {"iteration": iteration, **source_state, **self.scaling_meta()}
        self.saved_at = iteration
        self.ckpt.save(iteration, {"params": params, "opt_state": opt_state}, meta)

    # ------------------------------------------------------------------ cadence

    def save_due(self, iteration: int, at_group_boundary: bool | None) -> bool:
        """Every train.save_every iterations and at the end; with group boundaries (SortedRL,
        at_group_boundary not None) at the first boundary at or after each save point (an exact
        resume point)."""
        t = self.cfg.train
        if iteration == t.iterations:
            return True
        if at_group_boundary is None:
            return iteration % t.save_every == 0
        return at_group_boundary and iteration // t.save_every > self.saved_at // t.save_every

    def eval_due(self, iteration: int) -> bool:
        every = self.cfg.train.eval_every
        return bool(every) and iteration % every == 0

    def log_metrics(self, iteration: int, metrics: dict) -> None:
        if self.logger:
            self.logger.log(iteration, metrics)

    def check_diverged(self, iteration: int, metrics: dict, skipped_run: int) -> int:
        """The count of iterations in a row whose optimizer steps were all skipped, this one
        included; at train.max_skipped_iterations, delete the checkpoints saved since the
        skipping began and raise TrainingDiverged."""
        skipped_run = skipped_run + 1 if _skipped(metrics) else 0
        limit = self.cfg.train.max_skipped_iterations
        if limit and skipped_run >= limit:
            good = iteration - skipped_run
            self.ckpt.delete_after(good)
            self.close()
            raise TrainingDiverged(
                f"training stopped at iteration {iteration}: the optimizer step was skipped "
                f"(non-finite loss or gradient) in {skipped_run} iterations in a row "
                f"(train.max_skipped_iterations={limit}); checkpoints after "
                f"iteration {good} deleted, the last one kept is {self.ckpt.latest_step()} "
                "(lower rl.optim.lr?)"
            )
        return skipped_run

    def close(self) -> None:
        if self.logger:
            self.logger.close()
