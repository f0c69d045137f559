"""Owns the RL update: GRPO advantages, corrections (xi, r, SARS, IBR, TIS, ACR), loss, optimizer.
Must not touch sampling or the run directory: imports no rollout/ module, run_state or train.

Also the jitted update step, the per-iteration rollout diagnostics and (rl/learner.py, not
re-exported here) the learner step that ties them together for the trainer."""

from sparserl_jax.rl.advantages import grpo_advantages, token_advantages
from sparserl_jax.rl.batch import BATCH_KEYS, assemble, response_mask_from_lengths
from sparserl_jax.rl.config import (
    RL_MODES,
    AcrConfig,
    IbrConfig,
    LossConfig,
    OptimConfig,
    RLConfig,
    SarsConfig,
    TisConfig,
    UpdateConfig,
)
from sparserl_jax.rl.corrections import CORRECTIONS, Correction
from sparserl_jax.rl.corrections.compose import Corrections, compute_corrections, mismatch_metrics
from sparserl_jax.rl.diagnostics import DIAGNOSTIC_KEYS, rollout_diagnostics
from sparserl_jax.rl.loss import policy_loss
from sparserl_jax.rl.optim import make_optimizer, make_schedule
from sparserl_jax.rl.update import make_score_fn, make_update_fn, minibatch_gradients
