"""Owns one static-sampler call over a device mesh: the rows split over data x fsdp, the outputs
gathered to every process. Touches no prompts, rewards or run state (the caller pads the batch).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from sparserl_jax.distributed import to_host
from sparserl_jax.model import sharding as shd
from sparserl_jax.rollout.sampler import Rollout, SamplerConfig, generate_jit


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
