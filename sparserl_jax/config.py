"""Every setting of a run as frozen dataclasses, loaded from YAML files plus `key=value` overrides.

  python -m sparserl_jax.train --config experiments/configs/tiny.yaml rl.mode=naive_sparse kv.budget=64

Configs are data: YAML is parsed with yaml.safe_load and mapped field by field onto the
dataclasses; an unknown key is an error that names it and lists the accepted ones.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from typing import Any, Mapping, Sequence

import yaml

from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.model.config import ModelConfig, RopeScaling
from sparserl_jax.model.sharding import MeshConfig
from sparserl_jax.quant.config import QuantConfig
from sparserl_jax.rl.config import RLConfig, check_training_sampling
from sparserl_jax.rollout.scheduler import SortedConfig


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where the policy comes from: an HF checkpoint directory, or a randomly initialised
    architecture (`arch`) for tiny CPU runs (warm-started by the SFT stage). `init_from` then
    replaces those weights with the reference policy of an earlier run (e.g. a shared warm start)."""

    checkpoint: str | None = None
    dtype: str = "float32"
    arch: ModelConfig = ModelConfig()
    init_from: str | None = None  # a run directory whose reference (warm-started) params to start from


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """A synthetic task (`task` + `task_options`) or a jsonl dataset (`dataset`)."""

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
    reward: str = "math"  # for jsonl datasets; tasks bring their own reward

    def __post_init__(self):
        if (self.task is None) == (self.dataset is None):
            raise ValueError("data: set exactly one of data.task and data.dataset")


SCHEDULERS = ("batch", "sorted")


@dataclasses.dataclass(frozen=True)
class RolloutConfig:
    """Per iteration: `prompts` prompts x `samples` responses (a GRPO group per prompt).

    `rows_per_call` bounds the rows (responses) one sampler call decodes: 0 samples all
    prompts x samples rows in one call; otherwise the rows are sampled in consecutive chunks of
    `rows_per_call` (one compiled shape, chunk i with key fold_in(key, i)) and concatenated, so
    the prefill's activations and the KV cache scale with `rows_per_call` instead of the whole
    batch. It must divide prompts x samples and, on a mesh, be a multiple of mesh data x fsdp
    (each call's rows are split over those devices). Evaluation uses it as its batch size.
    """

    prompts: int = 128
    samples: int = 8
    max_new_tokens: int = 4096
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    attn_impl: str = "auto"
    rows_per_call: int = 0
    # "batch": one static batch per iteration (decoded until its longest row ends); "sorted":
    # SortedRL on the continuous-batching slot engine (settings in the `sorted` section)
    scheduler: str = "batch"

    def __post_init__(self):
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"rollout.scheduler={self.scheduler!r}: expected one of {SCHEDULERS}")
        for name in ("prompts", "samples", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name}={getattr(self, name)} must be >= 1")
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
    def call_rows(self) -> int:
        """Rows per sampler call (rows_per_call, or every row when it is 0)."""
        return self.rows_per_call or self.rows


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
            if getattr(self, name) < 0:
                raise ValueError(f"sft.curriculum.{name}={getattr(self, name)} must be >= 0")


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm-start on task demonstrations (for models that start from scratch)."""

    steps: int = 0
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    curriculum: SFTCurriculumConfig = SFTCurriculumConfig()


@dataclasses.dataclass(frozen=True)
class RunConfig:
    iterations: int = 100
    seed: int = 0
    out_dir: str = "runs/default"
    save_every: int = 10
    keep_checkpoints: int = 3
    eval_every: int = 0  # 0: evaluate only at the end
    eval_prompts: int = 64
    progress: bool = True
    # stop the run (keeping the checkpoints from before) after this many iterations in a row whose
    # optimizer steps were skipped for a non-finite loss or gradient; 0: never stop
    max_skipped_iterations: int = 5

    def __post_init__(self):
        for name, low in (("iterations", 0), ("save_every", 1), ("keep_checkpoints", 1),
                          ("eval_every", 0), ("eval_prompts", 1), ("max_skipped_iterations", 0)):
            if getattr(self, name) < low:
                raise ValueError(f"train.{name}={getattr(self, name)} must be >= {low}")


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
            raise ValueError("rollout.rows_per_call is for rollout.scheduler='batch'; the sorted "
                             "scheduler's memory is set by sorted.slots")


# ----------------------------------------------------------------------------- loading


def _unwrap_optional(tp):
    """X | None -> (X, True); any other type -> (tp, False)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return tp, False


_TRUE = ("true", "yes", "on", "1")
_FALSE = ("false", "no", "off", "0")


class Raw(str):
    """A `key=value` override's value as typed: coerced from its text by the field's type (so a
    string field keeps `1e-6` or `007` verbatim and a number field reads `1e-6` as a float)."""


def coerce(value: Any, tp: Any, name: str) -> Any:
    """`value` (a YAML value, or a Raw override string) as field type `tp`: int, float, bool, str,
    Literal, tuple[X, ...], X | None, a mapping or a nested dataclass. A value that does not fit
    raises ValueError naming the setting `name`, its value and the expected type."""
    tp, optional = _unwrap_optional(tp)
    if isinstance(value, Raw):
        if tp is Any:
            return yaml.safe_load(value)
        if optional and value.strip() in ("null", "None", "~", ""):
            return None
        if tp is str:
            return str(value)
        if typing.get_origin(tp) is typing.Literal:
            value = str(value)
        elif typing.get_origin(tp) is tuple:  # YAML's [1, 2], else "1,2", "7" or "" as typed
            loaded = yaml.safe_load(value)
            value = loaded if isinstance(loaded, list) else str(value)
        else:
            value = yaml.safe_load(value)
    if value is None:
        if optional or tp is Any:
            return None
        raise ValueError(f"{name}: null is not accepted (expected {_type_name(tp)})")
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, name)
    origin = typing.get_origin(tp)

    def bad():
        return ValueError(f"{name}={value!r}: expected {_type_name(tp)}")

    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
            return value.strip().lower() in _TRUE
        raise bad()
    if tp is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, int):
            return value
        try:
            f = float(value) if isinstance(value, (str, float)) else None
        except ValueError:
            raise bad() from None
        if f is None or not f.is_integer():
            raise bad()
        return int(f)
    if tp is float:
        if isinstance(value, bool):
            raise bad()
        try:
            return float(value)
        except (TypeError, ValueError):
            raise bad() from None
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad()
    if origin is typing.Literal:
        if value in typing.get_args(tp):
            return value
        raise ValueError(f"{name}={value!r}: expected one of {typing.get_args(tp)}")
    if origin is tuple:
        if isinstance(value, str):  # "1,2,3" as well as YAML's [1, 2, 3]
            value = [v.strip() for v in value.replace("[", "").replace("]", "").split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad()
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(coerce(v, args[0], f"{name}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise bad()
        return tuple(coerce(v, a, f"{name}[{i}]") for i, (v, a) in enumerate(zip(value, args)))
    if origin in (Mapping, dict, collections.abc.Mapping):
        if isinstance(value, Mapping):
            return {k: coerce(v, Any, f"{name}.{k}") for k, v in value.items()}
        raise bad()
    return value


def _type_name(tp) -> str:
    if typing.get_origin(tp) is tuple:
        return "a list of " + _type_name(typing.get_args(tp)[0]) + " values"
    if typing.get_origin(tp) in (Mapping, dict, collections.abc.Mapping):
        return "a mapping"
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    return names.get(tp, getattr(tp, "__name__", str(tp)))


def from_dict(cls, d: Mapping[str, Any], prefix: str):
    """Build dataclass `cls` from a nested mapping, every value coerced to its field's type;
    unknown keys and values of the wrong type raise naming the setting."""
    if not isinstance(d, Mapping):
        raise ValueError(f"{prefix}: expected a mapping of settings, got {d!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in d.items():
        name = f"{prefix}.{key}" if prefix else key
        if key not in fields:
            raise ValueError(f"{name}: unknown setting; accepted: {sorted(fields)}")
        kwargs[key] = coerce(value, hints[key], name)
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{prefix or 'config'}: {e}") from None


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted}: {k} is not a section")
    node[keys[-1]] = value


def load_config(paths: Sequence[str] = (), overrides: Sequence[str] = ()) -> TrainConfig:
    """Merge YAML files in order, then `key=value` overrides; every value is coerced to its
    field's type (`coerce`), so `rl.optim.lr=1e-6` is the float 1e-6."""
    tree: dict = {}
    for path in paths:
        try:
            with open(path) as f:
                loaded = yaml.safe_load(f) or {}
        except FileNotFoundError:
            raise FileNotFoundError(f"--config {path}: no such file") from None
        _deep_merge(tree, loaded, path)
    for item in overrides:
        if "=" not in item:
            raise ValueError(f"override {item!r}: expected key=value, e.g. kv.budget=256")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), Raw(raw))
    return from_dict(TrainConfig, tree, "")


def _deep_merge(into: dict, new: Mapping, where: str) -> None:
    if not isinstance(new, Mapping):
        raise ValueError(f"{where}: the top level must be a mapping of sections")
    for k, v in new.items():
        if isinstance(v, Mapping) and isinstance(into.get(k), dict):
            _deep_merge(into[k], v, where)
        else:
            into[k] = dict(v) if isinstance(v, Mapping) else v


def dump_config(cfg: TrainConfig, path: str) -> None:
    with open(path, "w") as f:
        yaml.safe_dump(to_dict(cfg), f, sort_keys=False)


__all__ = [
    "DataConfig",
    "ModelSource",
    "QuantConfig",
    "RolloutConfig",
    "RopeScaling",
    "RunConfig",
    "SFTConfig",
    "SortedConfig",
    "TrainConfig",
    "dump_config",
    "from_dict",
    "load_config",
]
