"""Build what a run needs from its TrainConfig: model, tokenizer, prompts, reward, sampler config,
rollout source. Shared by the trainer and the evaluator so both read a config the same way; the
only place cfg.kv and the rollout's sampling settings become a SamplerConfig (sampler_config)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable

import jax
from jax.sharding import Mesh

from sparserl_jax import kvcache as kv
from sparserl_jax.checkpoint import restore_params
from sparserl_jax.config import TrainConfig
from sparserl_jax.data import datasets
from sparserl_jax.data.reward_pool import RewardChecker
from sparserl_jax.data.rewards import get_timed_reward
from sparserl_jax.data.tasks import get_task
from sparserl_jax.model import hf, sharding, transformer
from sparserl_jax.model.config import ModelConfig, check_sequence_length
from sparserl_jax.model.precision import auto_dtype
from sparserl_jax.rollout.sampler import SamplerConfig
from sparserl_jax.rollout.sampling import AGREEMENT_K, SamplingConfig
from sparserl_jax.rollout.source import BatchSource, SortedSource
from sparserl_jax.tokenizer import CharTokenizer, HFTokenizer


@dataclasses.dataclass
class Components:
    model_cfg: ModelConfig
    params: transformer.Params
    tokenizer: HFTokenizer
    task: object | None  # a synthetic task (for SFT demonstrations), or None for datasets
    reward: Callable[[str, str], float]  # the task's, or data.reward (math's limit data.reward_pool.timeout_s)


def resolve_dtype(cfg: TrainConfig, log: Callable[[str], None] | None = None) -> TrainConfig:
    """`cfg` with model.dtype="auto" replaced by this host's choice (model/precision.py
    auto_dtype), said in `log`: a run's config.yaml then names the dtype it computes in, and its
    resume reads that back rather than choosing again."""
    if cfg.model.dtype != "auto":
        return cfg
    dtype, why = auto_dtype()
    if log is not None:
        log(f"model.dtype=auto: {dtype} ({why})")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))


def build_model(cfg: TrainConfig, mesh: Mesh | None = None) -> Components:
    """An HF checkpoint (model.checkpoint) or a random model of model.arch with the task's
    tokenizer; the params are the master weights, in model.param_dtype. With the run's `mesh`
    (the trainer's and the evaluator's, sharding.make_mesh(cfg.mesh)) of several devices, a
    checkpoint is read straight into the params' shardings (checkpoint_shardings): each process
    reads only its devices' blocks and no device holds more than its own, where a whole load on
    one device needs the model's master bytes there (30 GB for 7B in float32) before anything is
    split. Without one (None: export, tools) every tensor is placed whole on the default device."""
    task = get_task(cfg.data.task, **dict(cfg.data.task_options)) if cfg.data.task else None
    reward = task.reward if task is not None else get_timed_reward(cfg.data.reward, cfg.data.reward_pool.timeout_s)
    settings = cfg.model.arch_settings
    if cfg.model.checkpoint:
        shardings = checkpoint_shardings(cfg, mesh) if mesh is not None and mesh.size > 1 else None
        model_cfg, params = hf.load_params(cfg.model.checkpoint, dtype=cfg.model.param_dtype, shardings=shardings)
        model_cfg = dataclasses.replace(model_cfg, **settings)
        tokenizer = HFTokenizer.from_dir(cfg.model.checkpoint)
    else:
        tokenizer = task.tokenizer() if task is not None else CharTokenizer()
        model_cfg = dataclasses.replace(cfg.model.arch, **settings)
        if model_cfg.vocab_size < tokenizer.vocab_size:
            raise ValueError(
                f"model.arch.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
                f"vocabulary ({tokenizer.vocab_size})"
            )
        params = transformer.init_params(model_cfg, jax.random.key(cfg.train.seed))
    if cfg.model.init_from:
        params, _ = restore_params(os.path.join(cfg.model.init_from, "reference"), params)
    return Components(model_cfg, params, tokenizer, task, reward)


def checkpoint_shardings(cfg: TrainConfig, mesh: Mesh):
    """The shardings the trainer lays model.checkpoint's params out with on `mesh` (the partition
    rules of model/sharding.py over the shapes its config.json implies; nothing is read or
    allocated): hf.load_params reads each device's block straight into them."""
    model_cfg = dataclasses.replace(
        hf.load_config(cfg.model.checkpoint, cfg.model.param_dtype), **cfg.model.arch_settings
    )
    return sharding.param_shardings(sharding.abstract_params(model_cfg), mesh)


def reward_checker(cfg: TrainConfig, reward: Callable[[str, str], float]) -> RewardChecker:
    """The training rollouts' reward checks (data.reward_pool): `reward` (build_model's) for the
    rows whose data_source names none, serially or in the run's pool of worker processes."""
    return RewardChecker(reward, cfg.data.reward_pool)


def curriculum_task(cfg: TrainConfig):
    """The easier task of the SFT curriculum phase (sft.curriculum), or None without one."""
    cur = cfg.sft.curriculum
    if not cur.steps:
        return None
    if not cfg.data.task:
        raise ValueError(
            "sft.curriculum needs a synthetic task (data.task): a dataset has no easier version to generate"
        )
    if cur.max_new_tokens > cfg.rollout.max_new_tokens:
        raise ValueError(
            f"sft.curriculum.max_new_tokens={cur.max_new_tokens} exceeds "
            f"rollout.max_new_tokens={cfg.rollout.max_new_tokens}"
        )
    return get_task(cfg.data.task, **{**dict(cfg.data.task_options), **dict(cur.task_options)})


def check_lengths(cfg: TrainConfig, model_cfg: ModelConfig) -> None:
    """Length settings that cannot work together, named."""
    check_sequence_length(
        model_cfg,
        cfg.data.max_prompt_len,
        cfg.rollout.max_new_tokens,
        prompt="data.max_prompt_len",
        new="rollout.max_new_tokens",
    )
    total = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens
    if not cfg.kv.is_dense and cfg.kv.budget + cfg.kv.buffer > total:
        raise ValueError(
            f"kv.budget={cfg.kv.budget} + kv.buffer={cfg.kv.buffer} exceeds the maximum sequence "
            f"length data.max_prompt_len + rollout.max_new_tokens = {total}: the sparse cache "
            "would be larger than a dense one"
        )


def dataset_config(cfg: TrainConfig, tokenizer=None) -> datasets.DatasetConfig:
    """How prompts are rendered. data.chat_template None templates jsonl datasets and leaves task
    prompts plain; true templates every prompt. With `tokenizer`, a template it lacks is an error
    naming the setting."""
    d = cfg.data
    template = d.prompt_template or ("{question}" if d.task else datasets.DEFAULT_PROMPT_TEMPLATE)
    chat = bool(d.dataset) if d.chat_template is None else d.chat_template
    if chat and tokenizer is not None and tokenizer.chat_template is None:
        shown = "null (the default for data.dataset)" if d.chat_template is None else "true"
        raise ValueError(
            f"data.chat_template={shown}: the tokenizer of {getattr(tokenizer, 'source', tokenizer)} "
            "has no chat template; set data.chat_template=false for plain-text prompts"
        )
    return datasets.DatasetConfig(
        prompt_template=template,
        chat_template=chat,
        max_prompt_len=d.max_prompt_len,
        on_long_prompt=d.on_long_prompt,
        columns=d.columns,
    )


def render_prompt(cfg: TrainConfig, tokenizer) -> Callable[[str], str]:
    """A task question -> the prompt text the sampler sees (for SFT demonstrations)."""
    dcfg = dataset_config(cfg, tokenizer)
    return lambda question: datasets.render_prompt(question, tokenizer, dcfg)


def prompt_source(cfg: TrainConfig, tokenizer, *, batch_size: int, eval_split: bool = False):
    """Training prompt batches (synthetic task, or a jsonl / parquet dataset), with
    state_dict/load_state_dict; with eval_split, task prompts come from a seed stream disjoint
    from training."""
    seed = cfg.train.seed + (7919 if eval_split else 0)
    if cfg.data.task:
        task = get_task(cfg.data.task, **dict(cfg.data.task_options))
        return datasets.TaskPromptIterator(
            task, batch_size, seed=seed, tokenizer=tokenizer, cfg=dataset_config(cfg, tokenizer)
        )
    examples = datasets.load_dataset(cfg.data.dataset, tokenizer, dataset_config(cfg, tokenizer))
    if not 1 <= batch_size <= len(examples):
        raise ValueError(
            f"rollout.prompts={batch_size} must be in [1, {len(examples)}] (the number of "
            f"prompts in data.dataset={cfg.data.dataset!r})"
        )
    return datasets.PromptIterator(examples, batch_size, seed=seed)


def eval_examples(cfg: TrainConfig, tokenizer, *, n: int | None) -> list:
    """Held-out prompts: n fresh task prompts (64 by default), or the first n rows (default all)
    of data.eval_dataset (else data.dataset)."""
    if cfg.data.task:
        return prompt_source(cfg, tokenizer, batch_size=n or 64, eval_split=True).next_batch()
    path = cfg.data.eval_dataset or cfg.data.dataset
    examples = datasets.load_dataset(path, tokenizer, dataset_config(cfg, tokenizer))
    return examples[:n] if n else examples


def agreement_candidates(cfg: TrainConfig) -> int:
    """The top candidates per token the run's training rollouts record: rollout.agreement_k when
    it is a number, and for "auto" AGREEMENT_K (Sparrow's top 20) when the run reads them, else 0.
    What reads them is the learner's sparse-dense agreement (rl/diagnostics.py agreement; no
    correction does), the measure of a sampler that is not the learner's model: sparse rollouts
    (kv.policy other than none) or quantized ones (quant.format). A dense full-precision run,
    whose sampler differs from pi_old by rounding alone, records none and skips their top-k over
    the whole vocabulary in every decode step."""
    k = cfg.rollout.agreement_k
    if k != "auto":
        return k
    return AGREEMENT_K if not cfg.kv.is_dense or cfg.quant.enabled else 0


def sampler_config(
    cfg: TrainConfig,
    tokenizer,
    *,
    kv_cfg: kv.KVConfig | None = None,
    sampling: SamplingConfig | None = None,
    max_new_tokens: int | None = None,
    replay_filters: bool = False,
    agreement_k: int = 0,
    record_prompt_kept: bool = False,
) -> SamplerConfig:
    """The sampler of cfg's rollouts (`replay_filters`: training rollouts sampled with top-p /
    top-k record each token's kept set for the learner, rollout/sampling.py sample_kept;
    `agreement_k`: they record each token's top candidates, for the sparse-dense agreement
    (agreement_candidates; found as rollout.agreement_topk says); `record_prompt_kept`: how much
    of each prompt the cache holds at the response's end)."""
    r = cfg.rollout
    return SamplerConfig(
        max_new_tokens=r.max_new_tokens if max_new_tokens is None else max_new_tokens,
        sampling=sampling or SamplingConfig(r.temperature, r.top_p, r.top_k, r.draw),
        kv=cfg.kv if kv_cfg is None else kv_cfg,
        eos_token_ids=() if r.ignore_eos else tuple(tokenizer.eos_token_ids),
        pad_token_id=tokenizer.pad_token_id,
        attn_impl=r.attn_impl,
        replay_filters=replay_filters,
        agreement_k=agreement_k,
        agreement_topk=r.agreement_topk,
        record_prompt_kept=record_prompt_kept,
    )


def rollout_source(
    cfg: TrainConfig, prompts, model_cfg: ModelConfig, sampler_cfg: SamplerConfig, mesh, pad_token_id: int
) -> BatchSource:
    """The rollout source rollout.scheduler names, handed the sections it reads. `sampler_cfg`
    (sampler_config: cfg.kv, rollout.max_new_tokens and sampling) is all it samples with."""
    if not isinstance(cfg, TrainConfig):
        raise ValueError(f"cfg: expected a TrainConfig (sparserl_jax.config), got {type(cfg).__name__}")
    common = dict(max_prompt_len=cfg.data.max_prompt_len, pad_token_id=pad_token_id)
    if cfg.rollout.scheduler == "sorted":
        return SortedSource(
            cfg.rollout, sampler_cfg, cfg.quant, cfg.sorted, prompts, model_cfg, mesh, seed=cfg.train.seed, **common
        )
    return BatchSource(cfg.rollout, sampler_cfg, cfg.quant, prompts, model_cfg, mesh, **common)
