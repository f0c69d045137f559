"""Owns where an iteration's rollouts come from: rollout.scheduler batch | sorted, one interface.
Must not touch rewards, advantages, the update or the run directory (rl/, run_state, train).

A source draws prompts from its prompt iterator, samples them with the behaviour policy (theta_old,
quantized afresh when quant.format is set) and returns a RolloutBatch on the host; its
state_dict() (data position, and SortedRL's group) goes into every checkpoint's metadata. It is
handed the sections it reads (rollout, quant, sorted) and the SamplerConfig, which alone says what
is sampled (KV cache, max_new_tokens, sampling); components.rollout_source builds the one
rollout.scheduler names from a run's TrainConfig. Both decode on the rollout layout rollout.mesh
names (rollout/layout.py), the weights placed on it once per batch.
  BatchSource   the static sampler: rollout.prompts x rollout.samples rows per iteration, sampled
                rollout.rows_per_call rows per call (chunk i draws request ids i*R .. (i+1)*R).
  SortedSource  SortedRL: the SortedScheduler over one SlotEngine, loading a
                group of sorted.group_batches x rollout.prompts prompts at each group boundary.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from sparserl_jax import quant
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.quant.config import QuantConfig
from sparserl_jax.rollout.config import RolloutConfig, SortedConfig
from sparserl_jax.rollout.engine import SlotEngine
from sparserl_jax.rollout.layout import rollout_mesh
from sparserl_jax.rollout.prompts import pad_prompt_batch
from sparserl_jax.rollout.sampler import Rollout, SamplerConfig
from sparserl_jax.rollout.scheduler import SortedScheduler
from sparserl_jax.rollout.stats import rollout_bubble, rollout_metrics
from sparserl_jax.validate import check_at_least, check_number

SORTED_KEY_SALT = 0x5011ED  # SortedRL's group keys: fold_in(fold_in(key(seed), salt), group + 1)


@dataclasses.dataclass
class RolloutBatch:
    """One update batch's rollouts, on the host: B = len(examples) x rollout.samples rows."""

    examples: list  # the prompts; row b is a sample of examples[b // samples]
    tokens: np.ndarray  # [B, P] prompt tokens, right-padded
    lengths: np.ndarray  # [B] prompt lengths
    out: Rollout  # the responses (host arrays)
    metrics: dict  # response/*, time/rollout_s, throughput/*, kv/*, rollout/* (and sorted/*)


def concat_rollouts(outs: Sequence[Rollout]) -> Rollout:
    """Host-side Rollouts of consecutive row chunks joined along the batch axis (axis 0; the
    per-chunk kept_positions [R, L, B, K, C], when recorded, along its axis 2)."""

    def cat(name):
        leaves = [getattr(o, name) for o in outs]
        if leaves[0] is None:
            return None
        return np.concatenate([np.asarray(x) for x in leaves], axis=2 if name == "kept_positions" else 0)

    return Rollout(**{f.name: cat(f.name) for f in dataclasses.fields(Rollout)})


def check_rows_per_call(rows_per_call: int, mesh, layout: str = "train") -> None:
    """rollout.rows_per_call splits evenly over the row groups of the rollout layout on the mesh
    (rollout/layout.py: data x fsdp on the training layout)."""
    dp = rollout_mesh(layout, mesh).row_groups
    if rows_per_call and rows_per_call % dp:
        raise ValueError(
            f"rollout.rows_per_call={rows_per_call} must be a multiple of the {dp} row groups of "
            f"rollout.mesh={layout!r} (mesh data x fsdp for 'train', every device for 'data'): "
            "each sampler call's rows are split over them"
        )


def _next_prompts(prompts, batches: int = 1) -> list:
    examples = [e for _ in range(batches) for e in prompts.next_batch()]
    if not examples:
        raise ValueError("the prompt source returned an empty batch (empty dataset?)")
    return examples


def check_source_args(
    rollout_cfg, sampler_cfg, quant_cfg, prompts, model_cfg, mesh, max_prompt_len, pad_token_id
) -> None:
    """A source's arguments, checked when it is built (not at its first batch): each wrong one
    raises a one-line ValueError naming it. What is sampled (the KV cache, max_new_tokens, the
    sampling distribution) is sampler_cfg's alone; rollout_cfg gives the batch's shape."""
    if not isinstance(rollout_cfg, RolloutConfig):
        raise ValueError(
            f"rollout_cfg: expected a RolloutConfig (sparserl_jax.rollout.config), got {type(rollout_cfg).__name__}"
        )
    if not isinstance(sampler_cfg, SamplerConfig):
        raise ValueError(f"sampler_cfg: expected a SamplerConfig, got {type(sampler_cfg).__name__}")
    if not isinstance(quant_cfg, QuantConfig):
        raise ValueError(f"quant_cfg: expected a QuantConfig, got {type(quant_cfg).__name__}")
    missing = [m for m in ("next_batch", "state_dict", "load_state_dict") if not callable(getattr(prompts, m, None))]
    if missing:
        raise ValueError(
            f"prompts: a {type(prompts).__name__} has no {', '.join(missing)}; expected a "
            "prompt source (components.prompt_source)"
        )
    if not isinstance(model_cfg, ModelConfig):
        raise ValueError(f"model_cfg: expected a ModelConfig, got {type(model_cfg).__name__}")
    if not isinstance(mesh, Mesh) or not {"data", "fsdp"} <= set(mesh.axis_names):
        raise ValueError(
            f"mesh: expected a jax Mesh with axes 'data' and 'fsdp' (model.sharding.make_mesh), "
            f"got {getattr(mesh, 'axis_names', type(mesh).__name__)}"
        )
    check_rows_per_call(rollout_cfg.rows_per_call, mesh, rollout_cfg.mesh)
    check_at_least("data.max_prompt_len (max_prompt_len)", max_prompt_len, 1)
    check_at_least("pad_token_id", pad_token_id, 0)
    if pad_token_id >= model_cfg.vocab_size:
        raise ValueError(
            f"pad_token_id={pad_token_id} is not a token of the model (model.vocab_size={model_cfg.vocab_size})"
        )


class BatchSource:
    """rollout.scheduler='batch': every iteration one batch through the static sampler."""

    scheduler = None  # no SortedRL scheduler, no group boundaries
    at_group_boundary = None

    def __init__(
        self,
        rollout_cfg: RolloutConfig,
        sampler_cfg: SamplerConfig,
        quant_cfg: QuantConfig,
        prompts,
        model_cfg: ModelConfig,
        mesh: Mesh,
        *,
        max_prompt_len: int,
        pad_token_id: int,
    ):
        check_source_args(rollout_cfg, sampler_cfg, quant_cfg, prompts, model_cfg, mesh, max_prompt_len, pad_token_id)
        self.rollout_cfg, self.sampler_cfg, self.quant_cfg = rollout_cfg, sampler_cfg, quant_cfg
        self.prompts, self.model_cfg, self.mesh = prompts, model_cfg, mesh
        self.rollout = rollout_mesh(rollout_cfg.mesh, mesh)  # the layout it decodes on
        self.max_prompt_len, self.pad_token_id = max_prompt_len, pad_token_id

    def next(self, params, key, iteration: int) -> RolloutBatch:
        examples = _next_prompts(self.prompts)
        ids = [list(e.prompt_ids) for e in examples for _ in range(self.rollout_cfg.samples)]
        tokens, lengths = pad_prompt_batch(ids, self.pad_token_id, self.max_prompt_len)
        t0 = time.perf_counter()
        out = self.generate(params, tokens, lengths, key)
        seconds = time.perf_counter() - t0
        extra = rollout_bubble(out.lengths, self.sampler_cfg.max_new_tokens, self.sampler_cfg.kv.buffer)
        return RolloutBatch(
            examples,
            tokens,
            lengths,
            out,
            {**rollout_metrics(out, tokens, lengths, seconds, self.sampler_cfg, self.model_cfg), **extra},
        )

    def generate(self, params, tokens: np.ndarray, lengths: np.ndarray, key) -> Rollout:
        """Sample every row, rollout.rows_per_call rows per generate_jit call (one compiled shape);
        row b is request b of the iteration's key in whichever call samples it, so the rollout
        does not depend on rollout.rows_per_call. Each chunk's outputs are fetched to the host
        before the next call, so only one call's cache, activations and outputs are on the
        devices at a time."""
        B = tokens.shape[0]
        R = self.rollout_cfg.rows_per_call or B  # 0: one call, whatever the batch holds
        if B % R:
            raise ValueError(
                f"rollout.rows_per_call={R} does not divide this batch of {B} rows (the prompt "
                "source returned fewer prompts than rollout.prompts?)"
            )
        n_calls = B // R
        params = self.rollout.place(params)  # once per iteration: the rollout layout's weights
        # QuRL: the behaviour policy is theta_old quantized afresh from full precision
        params = quant.quantize_params(params, self.quant_cfg)
        outs = [
            self.rollout.generate(
                params,
                self.model_cfg,
                tokens[i * R : (i + 1) * R],
                lengths[i * R : (i + 1) * R],
                key,
                self.sampler_cfg,
                request_ids=np.arange(i * R, (i + 1) * R),
            )
            for i in range(n_calls)
        ]
        return outs[0] if n_calls == 1 else concat_rollouts(outs)

    def state_dict(self) -> dict:
        return {"data": self.prompts.state_dict()}

    def load_state_dict(self, meta: dict, log: Callable = print) -> None:
        self.prompts.load_state_dict(meta["data"])


class SortedSource(BatchSource):
    """rollout.scheduler='sorted': the next update batch of the SortedRL scheduler; `seed`
    (train.seed) keys its groups."""

    def __init__(
        self,
        rollout_cfg: RolloutConfig,
        sampler_cfg: SamplerConfig,
        quant_cfg: QuantConfig,
        sorted_cfg: SortedConfig,
        prompts,
        model_cfg: ModelConfig,
        mesh: Mesh,
        *,
        max_prompt_len: int,
        pad_token_id: int,
        seed: int,
    ):
        super().__init__(
            rollout_cfg,
            sampler_cfg,
            quant_cfg,
            prompts,
            model_cfg,
            mesh,
            max_prompt_len=max_prompt_len,
            pad_token_id=pad_token_id,
        )
        if not isinstance(sorted_cfg, SortedConfig):
            raise ValueError(
                f"sorted_cfg: expected a SortedConfig (sparserl_jax.rollout.config), got {type(sorted_cfg).__name__}"
            )
        if rollout_cfg.rows_per_call:
            raise ValueError(
                f"rollout.rows_per_call={rollout_cfg.rows_per_call} is for "
                "rollout.scheduler='batch'; the sorted scheduler's memory is set by sorted.slots"
            )
        check_number("train.seed (seed)", seed, integer=True)
        r, s = rollout_cfg, sorted_cfg
        self.sorted_cfg, self.seed = sorted_cfg, seed
        # Built here, so that the engine's and the scheduler's argument checks run now (building
        # them allocates and compiles nothing). One engine for the run: every group's prompts
        # are padded to data.max_prompt_len, so each of its programs compiles once.
        engine = SlotEngine(
            model_cfg,
            sampler_cfg,
            s.slots or r.rows,
            max_prompt_len,
            segment_chunks=s.segment_chunks,
            mesh=self.rollout.mesh,  # its slots over the rollout mesh's data x fsdp
            manual_axes=self.rollout.manual_axes,  # data, tensor:N: each row group its own slots alone
        )
        self.scheduler = SortedScheduler(engine, s, prompts_per_batch=r.prompts, samples=r.samples)

    @property
    def at_group_boundary(self) -> bool:
        return self.scheduler.at_group_boundary

    def next(self, params, key, iteration: int) -> RolloutBatch:
        """The slot engine's next update batch (`key` unused: SortedRL's keys are per group),
        loading a group of prompts at a group boundary."""
        t0 = time.perf_counter()
        sched = self.scheduler
        if sched.at_group_boundary:
            examples = _next_prompts(self.prompts, self.sorted_cfg.group_batches)
            tokens, lengths = pad_prompt_batch(  # the engine's one prompt width
                [e.prompt_ids for e in examples], self.pad_token_id, sched.engine.P, fixed=True
            )
            group_key = jax.random.fold_in(
                jax.random.fold_in(jax.random.key(self.seed), SORTED_KEY_SALT), sched.group + 1
            )
            sched.load_group(examples, tokens, lengths, group_key)
        params = quant.quantize_params(self.rollout.place(params), self.quant_cfg)  # QuRL: the behaviour weights
        examples, tokens, lengths, fin, extra = sched.next_batch(params, iteration)
        out = fin.to_rollout()
        seconds = time.perf_counter() - t0
        return RolloutBatch(
            examples,
            tokens,
            lengths,
            out,
            {**rollout_metrics(out, tokens, lengths, seconds, self.sampler_cfg, self.model_cfg), **extra},
        )

    def state_dict(self) -> dict:
        meta = super().state_dict()
        meta.update(sorted_group=self.scheduler.group, sorted_group_boundary=self.scheduler.at_group_boundary)
        return meta

    def load_state_dict(self, meta: dict, log: Callable = print) -> None:
        super().load_state_dict(meta)
        self.scheduler.group = int(meta.get("sorted_group", -1))
        if not meta.get("sorted_group_boundary", True):
            log(
                "this checkpoint was saved inside a SortedRL group: its remaining "
                "prompts are skipped (resume is exact only from group boundaries)"
            )


SOURCES = {"batch": BatchSource, "sorted": SortedSource}  # rollout.scheduler -> its source
