"""The schema of a run: every setting as frozen dataclasses (TrainConfig and its sections), and
load_config / dump_config between it and YAML files plus `key=value` overrides.

  python -m sparserl_jax.train --config experiments/configs/walk_key_rkv.yaml rl.mode=naive_sparse kv.budget=64

Configs are data: YAML is parsed with yaml.safe_load and mapped field by field onto the
dataclasses by sparserl_jax.config_io; an unknown key is an error that names it and lists the
accepted ones, and each section checks its ranges when built (sparserl_jax.validate).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from sparserl_jax.cli import DEFAULT_COMPILE_CACHE
from sparserl_jax.config_io import from_dict, read_tree, to_dict
from sparserl_jax.data.datasets import DatasetColumns
from sparserl_jax.data.reward_pool import RewardPoolConfig
from sparserl_jax.host_memory import HOST_MEMORY
from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.model.config import (
    ATTENTION_BACKWARDS,
    COMPUTE_DTYPES,
    DOT_ACCUMULATIONS,
    DTYPES,
    HEAD_BACKWARDS,
    ModelConfig,
    check_attention,
)
from sparserl_jax.model.precision import auto_dtype
from sparserl_jax.model.sharding import MeshConfig
from sparserl_jax.quant.config import QuantConfig
from sparserl_jax.rl.config import RLConfig, check_training_sampling
from sparserl_jax.rollout.config import RolloutConfig, SortedConfig
from sparserl_jax.validate import check_at_least, check_bool, check_in, check_number, check_positive


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the policy comes from: an HF checkpoint directory, or a randomly initialised
    architecture (`arch`) for tiny CPU runs (warm-started by the SFT stage). `init_from` then
    replaces those weights with the reference policy of an earlier run (e.g. a shared warm start).
    `dtype` is the compute dtype (forward, backward, rollouts, KV cache), `param_dtype` the master
    weights' and optimizer state's, which checkpoints keep (sparserl_jax/model/precision.py);
    `attention` how the full-sequence passes attend (model/config.py ATTENTION; auto: cuDNN on a
    GPU for bfloat16, splash on a TPU, blockwise on a CPU); `scan_layers` the learner's passes (update,
    scoring) run the layers under lax.scan (model/config.py ModelConfig.scan_layers: one compiled block);
    `dot_accumulation` how the projections accumulate under a bfloat16 `dtype` (model/config.py;
    auto: a float32 result rounded after on a CPU, which then uses its bfloat16 dot instructions);
    `head_backward` the learner's LM-head backward under a bfloat16 `dtype` (model/config.py),
    `attention_backward` the materialised attention's backward (model/config.py ATTENTION_BACKWARDS).
    `dtype` "auto" is bfloat16 where the host computes it fastest and float32 elsewhere
    (model/precision.py auto_dtype); a run writes the dtype it chose into its config.yaml."""

    checkpoint: str | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention: str = "auto"
    scan_layers: bool = False
    dot_accumulation: str = "auto"
    head_backward: str = "float32"
    attention_backward: str = "autodiff"
    arch: ModelConfig = ModelConfig()
    init_from: str | None = None  # a run directory whose reference (warm-started) params to start from

    def __post_init__(self):
        check_in("model.dtype", self.dtype, COMPUTE_DTYPES)
        check_in("model.param_dtype", self.param_dtype, DTYPES)
        check_attention(self.attention, self.dtype)
        check_bool("model.scan_layers", self.scan_layers)
        check_in("model.dot_accumulation", self.dot_accumulation, DOT_ACCUMULATIONS)
        check_in("model.head_backward", self.head_backward, HEAD_BACKWARDS)
        check_in("model.attention_backward", self.attention_backward, ATTENTION_BACKWARDS)

    @property
    def arch_settings(self) -> dict[str, str | bool]:
        """The settings of this section that the architecture carries (ModelConfig's fields of
        the same names), whichever source the architecture comes from."""
        return dict(
            dtype=auto_dtype()[0] if self.dtype == "auto" else self.dtype,
            param_dtype=self.param_dtype,
            attention=self.attention,
            scan_layers=self.scan_layers,
            dot_accumulation=self.dot_accumulation,
            head_backward=self.head_backward,
            attention_backward=self.attention_backward,
        )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """A synthetic task (`task` + `task_options`) or a dataset (`dataset`: jsonl, or parquet when
    the path ends in .parquet; `columns` names where a row keeps its question, label and
    data_source); `reward_pool` how the rewards are checked (data/reward_pool.py)."""

    task: str | None = "kv_recall"
    task_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    dataset: str | None = None
    eval_dataset: str | None = None
    prompt_template: str | None = None  # None: the math template for datasets, "{question}" for tasks
    # the tokenizer's chat template around each prompt (a user message + the generation prompt):
    # None (default) for jsonl datasets only, task prompts stay plain text; true for every prompt,
    # task prompts included (e.g. a chat checkpoint on a synthetic task); false for none
    chat_template: bool | None = None
    max_prompt_len: int = 1024
    on_long_prompt: str = "error"
    reward: str = "math"  # for datasets (rows whose data_source names no other); tasks bring their own reward
    columns: DatasetColumns = DatasetColumns()
    reward_pool: RewardPoolConfig = RewardPoolConfig()

    def __post_init__(self):
        if (self.task is None) == (self.dataset is None):
            raise ValueError("data: set exactly one of data.task and data.dataset")
        check_at_least("data.max_prompt_len", self.max_prompt_len, 1)


@dataclasses.dataclass(frozen=True)
class SFTCurriculumConfig:
    """An SFT phase on an easier version of the task before the `sft.steps` on the task itself.

    A long-range dependency (copying a token written 200 positions back) is found by a tiny model
    only after a phase change that, on long sequences, may not come in thousands of steps (one
    position's gradient among hundreds, and an attention of ~1/length on the target to start
    from); on short demonstrations it comes in a few hundred, and the mechanism then carries over
    to long ones. `task_options` are merged over data.task_options for this phase; its
    demonstrations are padded to data.max_prompt_len + `max_new_tokens` (0: rollout.max_new_tokens),
    and it has its own warmup-cosine schedule over `steps` (the main phase starts a fresh one).
    """

    steps: int = 0
    task_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    max_new_tokens: int = 0

    def __post_init__(self):
        for name in ("steps", "max_new_tokens"):
            check_at_least(f"sft.curriculum.{name}", getattr(self, name), 0)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-start on task demonstrations (for models that start from scratch)."""

    steps: int = 0
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    curriculum: SFTCurriculumConfig = SFTCurriculumConfig()

    def __post_init__(self):
        check_at_least("sft.steps", self.steps, 0)
        check_at_least("sft.batch_size", self.batch_size, 1)
        check_positive("sft.lr", self.lr)
        check_at_least("sft.warmup_steps", self.warmup_steps, 0)


EVAL_KV = ("rollout", "dense")


@dataclasses.dataclass(frozen=True)
class RunConfig:
    iterations: int = 100
    seed: int = 0
    out_dir: str = "runs/default"
    save_every: int = 10
    keep_checkpoints: int = 3
    eval_every: int = 0  # 0: evaluate only at the end
    eval_prompts: int = 64
    # the periodic evaluation's KV cache: "rollout" (the training rollouts' kv settings) or
    # "dense" (no eviction: the policy itself, what a collapse study tracks)
    eval_kv: str = "rollout"
    eval_batch_size: int = 0  # rows per evaluation sampler call; 0: the rollout's rows per call
    # the held-out evaluations' sampling temperature (0: greedy); None: the rollout's sampling
    eval_temperature: float | None = None
    progress: bool = True
    # stop the run (keeping the checkpoints from before) after this many iterations in a row whose
    # optimizer steps were skipped for a non-finite loss or gradient; 0: never stop
    max_skipped_iterations: int = 5
    # the folder `python -m sparserl_jax.train` keeps compiled programs in across runs (JAX's
    # persistent compilation cache: a rerun, a resumed run or another run of the same shapes loads
    # them instead of compiling); "" or null: off. $SPARSERL_COMPILE_CACHE or JAX's own
    # JAX_COMPILATION_CACHE_DIR, when set, win (sparserl_jax/cli.py use_compile_cache)
    compile_cache: str | None = DEFAULT_COMPILE_CACHE
    # how malloc serves XLA:CPU's buffers (sparserl_jax/host_memory.py HOST_MEMORY): "reuse" keeps
    # freed ones mapped for the next program call (no page faults per call), "system" glibc's
    # defaults, "auto" reuse where the CPU is JAX's platform; no number changes either way
    host_memory: str = "auto"

    def __post_init__(self):
        for name, low in (
            ("iterations", 0),
            ("save_every", 1),
            ("keep_checkpoints", 1),
            ("eval_every", 0),
            ("eval_prompts", 1),
            ("eval_batch_size", 0),
            ("max_skipped_iterations", 0),
        ):
            check_at_least(f"train.{name}", getattr(self, name), low)
        check_in("train.eval_kv", self.eval_kv, EVAL_KV)
        check_in("train.host_memory", self.host_memory, HOST_MEMORY)
        if self.eval_temperature is not None:
            check_at_least("train.eval_temperature", self.eval_temperature, 0, integer=False)
        check_number("train.seed", self.seed, integer=True)
        check_bool("train.progress", self.progress)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    model: ModelSource = ModelSource()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    kv: KVConfig = KVConfig()
    rl: RLConfig = RLConfig()
    sft: SFTConfig = SFTConfig()
    train: RunConfig = RunConfig()
    mesh: MeshConfig = MeshConfig()
    quant: QuantConfig = QuantConfig()
    sorted: SortedConfig = SortedConfig()

    def __post_init__(self):
        r = self.rollout
        check_training_sampling(self.rl.update, r.temperature, r.top_p, r.top_k)
        if r.scheduler == "sorted" and r.rows_per_call:
            raise ValueError(
                "rollout.rows_per_call is for rollout.scheduler='batch'; the sorted "
                "scheduler's memory is set by sorted.slots"
            )


# ----------------------------------------------------------------------------- files


def load_config(paths: Sequence[str] = (), overrides: Sequence[str] = ()) -> TrainConfig:
    """YAML files merged in order, then `key=value` overrides (config_io.read_tree); every value is
    coerced to its field's type, so `rl.optim.lr=1e-6` is the float 1e-6."""
    return from_dict(TrainConfig, read_tree(paths, overrides), "")


def dump_config(cfg: TrainConfig, path: str) -> None:
    """The config as YAML that load_config reads back to an equal TrainConfig."""
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
