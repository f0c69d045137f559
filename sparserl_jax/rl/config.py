"""Settings of the RL update: the mode (which behaviour-policy corrections apply), the GRPO loss,
the optimizer and the update loop. Each correction's section (SarsConfig, IbrConfig, TisConfig,
AcrConfig, the rejection and importance families) sits beside its code in rl/corrections/ and is
a field of RLConfig under the correction's name. Defaults are the Sparse-RL authors' code settings
(docs/methods.md#sparse-rl); QuRL's C is not published (2.0 is the common choice).

`rl.mode` names a preset: a combination of registered corrections, a row of RL_MODES, each with
its published defaults (MODE_NOTES says what it is and where it comes from). Sparse-RL's and
QuRL's: dense, naive_sparse (no correction), sparse_rl (SARS + IBR), sars_only, ibr_only, tis,
qurl (TIS + ACR); the frameworks' family: token_tis, seq_tis, icepop, geo_rs, seq_mask_tis,
k3_rs and the rejection + token/sequence TIS pairs. docs/implementation.md#the-correction-family
has the table of every correction and preset, generated from the registry and RL_MODES
(python -m sparserl_jax.rl.correction_table; tests/test_correction_family.py keeps them equal).

Every correction whose section has an `enabled` field joins any mode with
`rl.<name>.enabled=true` (ACR on sparse rollouts; a k3 rejection beside SARS). The decoupled
(three-policy) modes are the default; `rl.ratio_against=sampler` is the bypass form (the PPO
ratio against the sampler, verl's bypass_mode with its PPO-clip loss).
"""

from __future__ import annotations

import dataclasses

from sparserl_jax.model import remat
from sparserl_jax.rl.corrections import CORRECTIONS, check_combination
from sparserl_jax.rl.corrections.acr import AcrConfig
from sparserl_jax.rl.corrections.ibr import IbrConfig
from sparserl_jax.rl.corrections.importance import IcepopConfig, ImportanceConfig, SeqTisConfig
from sparserl_jax.rl.corrections.rejection import GeoRsConfig, K3RsConfig, RejectionConfig, SeqMaskConfig
from sparserl_jax.rl.corrections.sars import SarsConfig
from sparserl_jax.rl.corrections.tis import TisConfig
from sparserl_jax.validate import (
    check_at_least,
    check_between,
    check_bool,
    check_in,
    check_number,
    check_positive,
)

RATIO_AGAINST = ("old", "sampler")
AGGREGATIONS = ("seq_mean", "token_mean")
SCHEDULES = ("constant", "warmup", "cosine")
HEAD_WINDOWS = ("full", "response")  # update.head_window: where the LM head runs (rl/update.py head_window)

# mode -> the registered corrections (rl/corrections/) it applies, in the order they apply
RL_MODES: dict[str, tuple[str, ...]] = {
    "dense": (),
    "naive_sparse": (),
    "sparse_rl": ("sars", "ibr"),
    "sars_only": ("sars",),
    "ibr_only": ("ibr",),
    "tis": ("tis",),
    "qurl": ("tis", "acr"),
    "token_tis": ("tis",),
    "seq_tis": ("seq_tis",),
    "icepop": ("icepop",),
    "geo_rs": ("geo_rs",),
    "seq_mask_tis": ("seq_mask", "seq_tis"),
    "geo_rs_token_tis": ("geo_rs", "tis"),
    "geo_rs_seq_tis": ("geo_rs", "seq_tis"),
    "k3_rs": ("k3_rs",),
    "k3_rs_token_tis": ("k3_rs", "tis"),
    "k3_rs_seq_tis": ("k3_rs", "seq_tis"),
}

# mode -> (what it is, where it comes from): the preset table of docs/implementation.md
MODE_NOTES: dict[str, tuple[str, str]] = {
    "dense": ("dense rollouts: the sampler is pi_old", "every paper's baseline"),
    "naive_sparse": ("sparse rollouts trained as on-policy (no correction)", "Sparse-RL's baseline"),
    "sparse_rl": ("rejection sampling + importance reweighting", "Sparse-RL"),
    "sars_only": ("SARS alone", "Sparse-RL's ablation"),
    "ibr_only": ("IBR alone", "Sparse-RL's ablation"),
    "tis": ("token TIS at C = 2", "QuRL's FlashRL baseline"),
    "qurl": ("token TIS + adaptive clipping range", "QuRL"),
    "token_tis": ("token TIS at C = 2 (the same as tis)", "verl decoupled_token_is"),
    "seq_tis": ("sequence TIS at C = 2", "verl decoupled_seq_is"),
    "icepop": ("token weights zeroed outside [0.5, 5]", "verl decoupled_token_icepop"),
    "geo_rs": ("geometric-mean rejection in [0.999, 1.001]", "verl decoupled_geo_rs"),
    "seq_mask_tis": ("sequence mask [0.5, 2] + sequence TIS at 2", "verl decoupled_seq_is_rs"),
    "geo_rs_token_tis": ("geometric-mean rejection + token TIS", "verl decoupled_geo_rs_token_tis"),
    "geo_rs_seq_tis": ("geometric-mean rejection + sequence TIS", "verl decoupled_geo_rs_seq_tis"),
    "k3_rs": ("mean-k3 rejection at 0.01", "verl decoupled_k3_rs"),
    "k3_rs_token_tis": ("mean-k3 rejection + token TIS", "verl decoupled_k3_rs_token_tis"),
    "k3_rs_seq_tis": ("mean-k3 rejection + sequence TIS", "verl decoupled_k3_rs_seq_tis"),
}


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """Clipped GRPO surrogate with a k3 KL to pi_ref and an entropy bonus
    (docs/methods.md#the-objective).

    kl_clamp: the KL term is clamp(exp(q) - q - 1, -kl_clamp, kl_clamp), q = log pi_ref -
    log pi_theta: the authors clamp the k3 value, so its gradient is zero beyond the clamp
    (slime utils/ppo_utils.py compute_approx_kl, kl_loss_type "low_var_kl"). q itself is only
    guarded at +-rl.log_ratio_clamp against overflow, which changes nothing once the value clamp
    binds (|q| > ~11 always exceeds it).
    aggregation "seq_mean" (authors): mean over each response's accepted tokens, summed over
    responses and divided by the number of responses (a fully rejected response counts as zero);
    "token_mean": mean over all accepted tokens of the minibatch."""

    eps_low: float = 0.2
    eps_high: float = 0.2
    beta: float = 1e-4
    kl_clamp: float = 10.0
    entropy_coef: float = 0.0
    aggregation: str = "seq_mean"

    def __post_init__(self):
        check_in("loss.aggregation", self.aggregation, AGGREGATIONS)
        check_between("loss.eps_low", self.eps_low, 0, 1, hi_open=True)
        check_at_least("loss.eps_high", self.eps_high, 0, integer=False)
        check_at_least("loss.beta", self.beta, 0, integer=False)
        check_number("loss.entropy_coef", self.entropy_coef)
        check_positive("loss.kl_clamp", self.kl_clamp)


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm gradient clipping. schedule: "constant"; "warmup" (linear from 0 over
    warmup_steps, then constant); "cosine" (linear warmup, then cosine decay to min_lr_ratio * lr
    at total_steps)."""

    lr: float = 1e-6
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.98
    eps: float = 1e-8
    grad_clip: float = 1.0
    schedule: str = "constant"
    warmup_steps: int = 0
    total_steps: int = 0
    min_lr_ratio: float = 0.0

    def __post_init__(self):
        check_in("optim.schedule", self.schedule, SCHEDULES)
        check_positive("optim.lr", self.lr)
        check_at_least("optim.weight_decay", self.weight_decay, 0, integer=False)
        check_positive("optim.grad_clip", self.grad_clip)
        for name in ("b1", "b2"):  # AdamW's moment decays
            check_between(f"optim.{name}", getattr(self, name), 0, 1, hi_open=True)
        check_positive("optim.eps", self.eps)
        check_at_least("optim.warmup_steps", self.warmup_steps, 0)
        check_at_least("optim.total_steps", self.total_steps, 0)
        if self.schedule == "warmup" and self.warmup_steps < 1:
            raise ValueError("optim.warmup_steps must be >= 1 with optim.schedule='warmup'")
        if self.schedule == "cosine" and self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"optim.total_steps={self.total_steps} must be > optim.warmup_steps="
                f"{self.warmup_steps} with optim.schedule='cosine'"
            )
        check_between("optim.min_lr_ratio", self.min_lr_ratio, 0, 1)


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    """How one rollout batch is consumed: `minibatch_size` responses per optimizer step, each
    minibatch accumulated over micro-batches of `micro_batch_size`, `epochs` passes. The learner
    recomputes log-probs at the sampler's `temperature`. `score_batch_size` rows per chunk when
    scoring pi_old / pi_ref. `donate`: the trainer donates params and optimizer state to the
    update step, so the new ones reuse their buffers instead of coexisting with them (one copy of
    the weights and AdamW state less at the update's peak; python -m sparserl_jax.dryrun).
    `remat`: what each transformer block keeps for the backward pass (model/remat.py): none, full
    (only the block's input; true), selective (also its q/k/v and attention output).

    The cost of scoring and of the update follows the real tokens (rl/buckets.py):
    `length_bucket`: each micro-batch (and scoring chunk) is as wide as its longest row (prompt +
      response) rounded up to a multiple of this many positions, capped at the rollout width
      data.max_prompt_len + rollout.max_new_tokens (a few compiled widths); 0 pads every row to the
      full width.
    `max_buckets`: at most this many widths (each compiles a scoring and a gradient program):
      where the rollout width holds more multiples of length_bucket, the step is widened to the
      smallest multiple of length_bucket that fits (rl/buckets.py bucket_step; 5120-position rows
      at 64 and 16: 320). 0: no bound. The default changes nothing up to 2048-position rows at the
      default bucket; a coarser step costs padding (rl/buckets.py says how much).
    `compile_ahead`: every width and path is compiled before the first update, so no iteration
      after the first compiles (what a long run wants: its first iteration pays once); off, each
      program compiles when a batch first needs it (the experiments' --smoke: a two-iteration run
      compiles only what it runs, about 40% less time). The same programs either way: no number
      changes.
    `group_by_length`: a minibatch's rows are sorted by length before they are cut into
      micro-batches (and all rows before scoring chunks), so short rows share narrow micro-batches.
      Kept off automatically where the micro-batch composition is part of the math (IBR
      normalised per micro-batch while pi_old comes from the update's own forward).
    `reuse_old_forward`: with one minibatch and one epoch, pi_old is the learner's first forward
      (theta_old = theta before the only optimizer step), so it is taken from that forward under
      stop_gradient instead of a separate scoring pass (not with ibr.normalisation='global', whose
      normaliser needs every row's pi_old before the first gradient).
    `head_window`: where the LM head (logits, log-softmax, entropy) runs in scoring and the update:
      "full" over every position of a row, "response" over each row's rollout.max_new_tokens
      positions from its first response position only, in chunks fitted to those tokens
      (rl/update.py head_window; TRL's logits_to_keep): the prompt's positions score no response
      token, and their log-probs are
      masked out of every loss and metric, so the values read are the same up to the head's
      float summation order (its products over fewer rows, its weight gradient summed over fewer
      tokens). The blocks run over every position either way. Default "full": the committed runs
      and fingerprints were computed so (experiments/results/default/fingerprint_smoke.json).
    pi_ref is not computed at all when loss.beta = 0 (it enters only the KL term)."""

    minibatch_size: int = 256
    micro_batch_size: int = 16
    epochs: int = 1
    temperature: float = 1.0
    remat: bool | str = False
    chunk_tokens: int = 1024
    score_batch_size: int = 16
    donate: bool = True
    length_bucket: int = 64
    max_buckets: int = 32
    group_by_length: bool = True
    reuse_old_forward: bool = True
    compile_ahead: bool = True
    head_window: str = "full"

    def __post_init__(self):
        for name in ("minibatch_size", "micro_batch_size", "epochs", "chunk_tokens", "score_batch_size"):
            check_at_least(f"update.{name}", getattr(self, name), 1)
        check_at_least("update.length_bucket", self.length_bucket, 0)  # 0: no length buckets
        check_at_least("update.max_buckets", self.max_buckets, 0)  # 0: no bound on the widths
        for name in ("donate", "group_by_length", "reuse_old_forward", "compile_ahead"):
            check_bool(f"update.{name}", getattr(self, name))
        remat.policy_name(self.remat)  # none, full, selective (true: full, false: none)
        check_in("update.head_window", self.head_window, HEAD_WINDOWS)
        if self.minibatch_size % self.micro_batch_size:
            raise ValueError(
                f"update.minibatch_size={self.minibatch_size} must be a multiple of "
                f"update.micro_batch_size={self.micro_batch_size}"
            )
        check_positive("update.temperature", self.temperature)


def check_training_sampling(update: UpdateConfig, temperature: float, top_p: float, top_k: int) -> None:
    """Refuse rollout sampling settings that would bias xi = pi_old / pi_sampler.

    The sampler records log-probs of its processed distribution (temperature, then top-k/top-p);
    pi_old, pi_ref and the learner are scored at `update.temperature`. So the temperatures must be
    equal (the authors use one, --rollout-temperature, for both: slime megatron_utils/loss.py
    get_responses). With top-k / top-p the sampler records each token's kept set and every
    log-prob is renormalised over it (sampling-mask replay, rollout/sampling.py sample_kept); the
    set is rollout.top_k tokens at most, and those tied with the k-th (recorded up to TIE_SLOTS
    more), so top-p needs a top_k bounding it (a nucleus of the whole vocabulary cannot be
    replayed at 4 bytes a token per kept id)."""
    if temperature != update.temperature:
        raise ValueError(
            f"rollout.temperature={temperature} differs from rl.update.temperature="
            f"{update.temperature}: the sampler, the scorer (pi_old, pi_ref) and the learner must "
            "use one temperature, or xi = pi_old / pi_sampler is biased; set both to the same value"
        )
    if temperature == 0:
        raise ValueError("rollout.temperature=0 (greedy) cannot train: set a temperature > 0")
    if top_p != 1.0 and top_k == 0:
        raise ValueError(
            f"rollout.top_p={top_p} with rollout.top_k=0: training replays each token's kept set "
            "(the learner renormalises over it), which needs a bound on its size; set rollout.top_k "
            "(e.g. 64: the nucleus is taken within the 64 most probable tokens, ties at the 64th "
            "included, 288 bytes a token)"
        )


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Everything the update step needs. `log_ratio_clamp` bounds every log-ratio (log xi,
    log r, and the sequence sums and means of log xi) before exp (the authors' SAFETY_BOUND 20
    in mis.py).

    ratio_against: the denominator of the PPO ratio r. "old" (pi_theta / pi_old, the dense
    recompute: slime's default, and what the authors' naive-sparse run without --use-tis does);
    "sampler" (pi_theta / pi_sparse, slime's --use-rollout-logprobs: the sparse samples are
    trained as if the sampler were the old policy). The paper does not say which of the two its
    naive-sparse baseline is, so both are offered; xi-based corrections still use pi_old."""

    mode: str = "sparse_rl"
    log_ratio_clamp: float = 20.0
    ratio_against: str = "old"
    # one section per registered correction (rl/corrections/), under its name
    sars: SarsConfig = SarsConfig()
    ibr: IbrConfig = IbrConfig()
    tis: TisConfig = TisConfig()
    acr: AcrConfig = AcrConfig()
    rejection: RejectionConfig = RejectionConfig()
    geo_rs: GeoRsConfig = GeoRsConfig()
    seq_mask: SeqMaskConfig = SeqMaskConfig()
    k3_rs: K3RsConfig = K3RsConfig()
    importance: ImportanceConfig = ImportanceConfig()
    seq_tis: SeqTisConfig = SeqTisConfig()
    icepop: IcepopConfig = IcepopConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    update: UpdateConfig = UpdateConfig()

    def __post_init__(self):
        check_in("rl.mode", self.mode, RL_MODES)
        check_in("rl.ratio_against", self.ratio_against, RATIO_AGAINST)
        check_positive("rl.log_ratio_clamp", self.log_ratio_clamp)
        added = self.corrections[len(RL_MODES[self.mode]) :]
        check_combination(f"rl.mode={self.mode!r}" + "".join(f" + rl.{n}.enabled" for n in added), self.corrections)

    @property
    def corrections(self) -> tuple[str, ...]:
        """The corrections in force: the mode's row of RL_MODES, then every registered one whose
        section has `enabled=True` (rl.acr.enabled adds ACR to any mode)."""
        named = RL_MODES[self.mode]
        enabled = tuple(
            name for name in CORRECTIONS if name not in named and getattr(getattr(self, name, None), "enabled", False)
        )
        return named + enabled
