"""Owns the rollout settings: RolloutConfig (the `rollout` section) and SortedConfig (`sorted`),
with their accepted values. Touches nothing: frozen dataclasses that check their ranges when built.

TrainConfig (sparserl_jax/config.py) holds them as cfg.rollout and cfg.sorted; the rollout sources
take them as they are (rollout/source.py), so rollout/ needs nothing from the run's schema.
"""

from __future__ import annotations

import dataclasses

from sparserl_jax.kernels import IMPLS as ATTN_IMPLS
from sparserl_jax.rollout.layout import check_layout
from sparserl_jax.rollout.sampling import DRAWS, TOPK_METHODS
from sparserl_jax.validate import check_at_least, check_between, check_bool, check_in, check_number

SCHEDULERS = ("batch", "sorted")  # rollout.scheduler: the rollout sources (rollout/source.py SOURCES)


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Per iteration: `prompts` prompts x `samples` responses (a GRPO group per prompt).

    `rows_per_call` bounds the rows (responses) one sampler call decodes: 0 samples all
    prompts x samples rows in one call; otherwise the rows are sampled in consecutive chunks of
    `rows_per_call` (one compiled shape; row b is request b of the iteration's key in whichever
    call samples it) and concatenated, so the prefill's activations and the KV cache scale with
    `rows_per_call` instead of the whole batch. It must divide prompts x samples and, on a mesh,
    be a multiple of the row groups each call's rows are split over (rollout.mesh: mesh data x
    fsdp for "train", every device for "data", devices / N for "tensor:N"). Evaluation uses it
    as its batch size.

    `mesh` is the rollout layout (rollout/layout.py): "train" decodes on the training mesh and
    layout (weights gathered per use in every decode step); "data" replicates the weights on
    every device once per iteration and each device decodes its own rows with no collective in
    the decode loop but its stop test; "tensor:N" splits the weights over groups of N devices
    (for a model that does not fit one) and the rows over the groups.
    """

    prompts: int = 128
    samples: int = 8
    max_new_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    # how each token is drawn from its distribution: "gumbel" (jax.random.categorical) or
    # "inverse_cdf" (one uniform per row; the same distribution, another random stream: cheaper on
    # a CPU); rollout/sampling.py DRAWS
    draw: str = "gumbel"
    attn_impl: str = "auto"
    rows_per_call: int = 0
    # "batch": one static batch per iteration (decoded until its longest row ends); "sorted":
    # SortedRL on the continuous-batching slot engine (settings in the `sorted` section)
    scheduler: str = "batch"
    # every response runs to max_new_tokens (end-of-sequence tokens do not stop it): equal-length
    # workloads for benchmarks, as serving benchmarks fix the output length
    ignore_eos: bool = False
    # each training token's `agreement_k` most probable tokens and their sampler log-probs are
    # recorded for the sparse-dense agreement the learner logs (rl/diagnostics.py; 8 bytes a
    # candidate, and a top-k over the vocabulary every decode step); "auto": Sparrow's top 20
    # (rollout/sampling.py AGREEMENT_K) when the run reads them, none otherwise
    # (components.agreement_candidates); 0 turns it off.
    agreement_k: int | str = "auto"
    # how they are found: "exact", "approx" (TPU's approximate top-k) or "auto" (approx on TPU,
    # else exact): rollout/sampling.py top_candidates
    agreement_topk: str = "auto"
    # log question/* each iteration: how much of each response's prompt the sparse cache had
    # evicted by its end, whether the question's numbers were among it and the reward of those
    # responses (rollout/question.py); static sampler only
    question_kv: bool = False
    # the rollout layout: "train" | "data" | "tensor:N" (rollout/layout.py)
    mesh: str = "train"

    def __post_init__(self):
        check_in("rollout.scheduler", self.scheduler, SCHEDULERS)
        check_layout(self.mesh)
        check_in("rollout.attn_impl", self.attn_impl, ATTN_IMPLS)
        for name in ("prompts", "samples", "max_new_tokens"):
            check_at_least(f"rollout.{name}", getattr(self, name), 1)
        check_at_least("rollout.temperature", self.temperature, 0, integer=False)  # 0: greedy
        check_between("rollout.top_p", self.top_p, 0, 1, lo_open=True)
        check_at_least("rollout.top_k", self.top_k, 0)
        check_in("rollout.draw", self.draw, DRAWS)
        check_bool("rollout.ignore_eos", self.ignore_eos)
        k = self.agreement_k
        if k != "auto" and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f'rollout.agreement_k={k!r}: expected "auto" or an integer >= 0 (0: none)')
        check_in("rollout.agreement_topk", self.agreement_topk, TOPK_METHODS)
        check_bool("rollout.question_kv", self.question_kv)
        if self.question_kv and self.scheduler != "batch":
            raise ValueError(
                f"rollout.question_kv=true reads the static sampler's final cache; rollout.scheduler="
                f"{self.scheduler!r} does not record it (use rollout.scheduler=batch)"
            )
        check_number("rollout.rows_per_call", self.rows_per_call, integer=True)
        rows = self.prompts * self.samples
        if self.rows_per_call < 0 or (self.rows_per_call and rows % self.rows_per_call):
            raise ValueError(
                f"rollout.rows_per_call={self.rows_per_call} must be 0 (all rows in one call) or "
                f"a divisor of rollout.prompts x rollout.samples = {rows}"
            )

    @property
    def rows(self) -> int:
        return self.prompts * self.samples

    @property
    def filters(self) -> bool:
        """Sampling with top-p or top-k: training rollouts then record each token's kept set."""
        return self.top_p < 1.0 or self.top_k > 0

    @property
    def call_rows(self) -> int:
        """Rows per sampler call (rows_per_call, or every row when it is 0)."""
        return self.rows_per_call or self.rows


SORTED_MODES = ("on_policy", "partial")  # sorted.mode
RESUMES = ("cache", "prefill")
REQUEUES = ("immediate", "hold")  # sorted.requeue: on-policy, where a dropped prompt goes


@dataclasses.dataclass(frozen=True)
class SortedConfig:
    """SortedRL settings (used with rollout.scheduler='sorted').

    mode: "on_policy" (drop unfinished responses at each harvest) or "partial" (resume them).
    slots: Q, the engine's slot capacity (0: rollout.prompts x rollout.samples, the static
      sampler's batch, so both hold the same KV memory).
    group_batches: n, update batches per loaded group (the paper's n = 4).
    segment_chunks: decode chunks (of kv.buffer steps) per jitted segment between host visits.
    resume: partial mode, how an unfinished response continues after a harvest: "cache" (in
      its slot, keeping the KV cache of the weights that wrote it) or "prefill" (prompt +
      partial response re-prefilled under the new weights in a free slot).
    requeue: on-policy mode, where a prompt dropped at a harvest goes: "immediate" (the paper's
      rule: straight back into the queue, all its samples afresh, behind the requests waiting;
      the engine stays full and a prompt may be dropped again) or "hold" (held back while the
      group's never-dropped prompts can fill the next harvest: dropped at most once per group,
      at the cost of idle slots).
    """

    mode: str = "on_policy"
    slots: int = 0
    group_batches: int = 4
    segment_chunks: int = 2
    resume: str = "cache"
    requeue: str = "immediate"

    def __post_init__(self):
        check_in("sorted.mode", self.mode, SORTED_MODES)
        check_in("sorted.resume", self.resume, RESUMES)
        check_in("sorted.requeue", self.requeue, REQUEUES)
        check_at_least("sorted.slots", self.slots, 0)  # 0: rollout.prompts x rollout.samples
        check_at_least("sorted.group_batches", self.group_batches, 1)  # a group: >= 1 harvest
        check_at_least("sorted.segment_chunks", self.segment_chunks, 1)
