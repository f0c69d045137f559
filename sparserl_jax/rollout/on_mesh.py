"""Owns one static-sampler call over a device mesh: the rows split over data x fsdp, the outputs
gathered to every process. Touches no prompts, rewards or run state (the caller pads the batch).

Two ways (rollout/layout.py picks one from rollout.mesh): `generate_on_mesh` hands the sampler
the mesh and lets XLA partition it (the training layout: weights gathered per use inside the
decode loop); `generate_per_device` runs the whole sampler under shard_map, each row group
decoding its own rows alone with its own copy of the weights, so the decode loop moves nothing
between devices but its scalar stop test.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sparserl_jax.distributed import to_host
from sparserl_jax.kernels.sharded import per_device
from sparserl_jax.model import sharding as shd
from sparserl_jax.model.config import ModelConfig
from sparserl_jax.rollout.sampler import Rollout, SamplerConfig, generate, generate_jit


def generate_on_mesh(
    params: Any,
    model_cfg: Any,
    tokens: np.ndarray,
    lengths: np.ndarray,
    key: jax.Array,
    sampler_cfg: SamplerConfig,
    mesh: Mesh | None = None,
    request_ids: np.ndarray | None = None,
) -> Rollout:
    """One sampler call over every row, as host numpy arrays on every process (a collective).

    On a mesh of several devices the rows (the same full values on every process) are split over
    data x fsdp, so each process decodes only its own rows on its own devices, with the decode
    attention under shard_map on `mesh`; the outputs are then gathered to every process. Rows are
    padded to a multiple of data x fsdp by repeating the last one (dropped again): each row's
    result depends on its own values and request id only, so it equals the one-process result.
    `request_ids` (default: the row index) pick each row's random keys (sampler.request_keys).
    """
    B = tokens.shape[0]
    ids = np.arange(B, dtype=np.int32) if request_ids is None else np.asarray(request_ids, np.int32)
    if mesh is None or mesh.size == 1:
        return jax.device_get(
            generate_jit(
                params, model_cfg, jnp.asarray(tokens), jnp.asarray(lengths), key, sampler_cfg, jnp.asarray(ids)
            )
        )
    pad = -B % (mesh.shape["data"] * mesh.shape["fsdp"])
    tokens, lengths, ids = (np.concatenate([x, np.repeat(x[-1:], pad, axis=0)]) for x in (tokens, lengths, ids))
    out = to_host(
        generate_jit(
            params,
            model_cfg,
            shd.shard_batch(tokens, mesh),
            shd.shard_batch(lengths, mesh),
            key,
            dataclasses.replace(sampler_cfg, mesh=mesh),
            shd.shard_batch(ids, mesh),
        )
    )
    kept = out.kept_positions
    out = jax.tree.map(lambda x: x[:B], out.replace(kept_positions=None))
    return out.replace(kept_positions=None if kept is None else kept[:, :, :B])


def generate_per_device(
    params: Any,
    model_cfg: ModelConfig,
    tokens: np.ndarray,
    lengths: np.ndarray,
    key: jax.Array,
    sampler_cfg: SamplerConfig,
    mesh: Mesh,
    request_ids: np.ndarray | None = None,
    *,
    manual_axes: tuple[str, ...] = shd.AXES,
) -> Rollout:
    """One sampler call with the rows split over data x fsdp of `mesh` and each of those row groups
    decoding alone: the sampler runs under shard_map, manual over `manual_axes` (every axis: each
    device its own rows with `params` replicated; data and fsdp: each group of "tensor" devices
    its rows, XLA partitioning its step over "tensor" as `params` are laid out). The loop's stop
    test is the one collective (every group runs until every row has finished), so each row's
    result equals the one-device call's, as host numpy arrays on every process (a collective).
    Rows are padded to a multiple of the groups by repeating the last one (dropped again)."""
    B = tokens.shape[0]
    ids = np.arange(B, dtype=np.int32) if request_ids is None else np.asarray(request_ids, np.int32)
    pad = -B % math.prod(mesh.shape[a] for a in shd.BATCH)
    tokens, lengths, ids = (np.concatenate([x, np.repeat(x[-1:], pad, axis=0)]) for x in (tokens, lengths, ids))
    fn = _per_device_program(model_cfg, sampler_cfg, mesh, tuple(manual_axes))
    out = to_host(fn(params, *shd.shard_batch((tokens, lengths, ids), mesh), key))
    kept = out.kept_positions
    out = jax.tree.map(lambda x: x[:B], out.replace(kept_positions=None))
    return out.replace(kept_positions=None if kept is None else kept[:, :, :B])


@functools.lru_cache(maxsize=16)
def _per_device_program(model_cfg: ModelConfig, cfg: SamplerConfig, mesh: Mesh, manual_axes: tuple[str, ...]):
    """The jitted sampler under shard_map for generate_per_device: params and key replicated over
    the row groups, every [B, ...] input and output split over data x fsdp (kept_positions
    [R, L, B, K, C] on its B)."""
    rows = P(shd.BATCH)
    inner_mesh = None if set(manual_axes) == set(mesh.axis_names) else mesh
    local_cfg = dataclasses.replace(cfg, mesh=inner_mesh)

    def local(params, tokens, lengths, ids, key):
        return generate(params, model_cfg, tokens, lengths, key, local_cfg, ids, stop_axes=shd.BATCH)

    out_specs = Rollout(**{f.name: rows for f in dataclasses.fields(Rollout)})
    out_specs = out_specs.replace(kept_positions=P(None, None, shd.BATCH))
    return jax.jit(per_device(local, mesh, (P(), rows, rows, rows, P()), out_specs, manual_axes))
