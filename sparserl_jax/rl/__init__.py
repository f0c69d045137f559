"""RL update: GRPO advantages, behaviour-policy corrections (xi, r, SARS, IBR, TIS, ACR), the
clipped loss, the optimizer, the jitted update step and the per-iteration rollout diagnostics."""

from sparserl_jax.rl.advantages import grpo_advantages, token_advantages
from sparserl_jax.rl.batch import BATCH_KEYS, assemble, response_mask_from_lengths
from sparserl_jax.rl.config import (
    MODES,
    AcrConfig,
    IbrConfig,
    LossConfig,
    ModeSpec,
    OptimConfig,
    RLConfig,
    SarsConfig,
    TisConfig,
    UpdateConfig,
)
from sparserl_jax.rl.corrections import Corrections, compute_corrections, mismatch_metrics
from sparserl_jax.rl.diagnostics import DIAGNOSTIC_KEYS, rollout_diagnostics
from sparserl_jax.rl.loss import policy_loss
from sparserl_jax.rl.optim import make_optimizer, make_schedule
from sparserl_jax.rl.update import make_score_fn, make_update_fn, minibatch_gradients
