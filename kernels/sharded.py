"""Decode attention under `shard_map`: every device attends with its own shard of the KV cache.

A Pallas call is a custom call, opaque to XLA's SPMD partitioner: fed a cache sharded over the
batch or the KV heads, the partitioner all-gathers the whole cache onto every device before the
kernel, in every layer of every decode step. `shard_attention` runs the attention function
inside `shard_map` instead, with the cache's own layout (model/sharding.py `cache_specs`, fitted
to the mesh by the same `fit_spec`, sparserl_jax/mesh_axes.py): the
batch over data x fsdp (the longest prefix of those axes that divides B), the KV heads - and the
query heads that read them - over tensor when tensor divides the KV head count, replicated
otherwise. Attention is independent per (sequence, KV head), so each device's result is exactly
its shard of the single-device result and no collective is needed.

The mesh is an explicit argument (`decode_attention(..., mesh=...)`, carried by
`SamplerConfig.mesh` and `transformer.decode_step(mesh=...)`); None or a one-device mesh calls
the attention function directly.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from sparserl_jax.mesh_axes import BATCH, fit_spec

try:  # jax >= 0.7: jax.shard_map (check_vma); older: jax.experimental.shard_map (check_rep)
    _shard_map = jax.shard_map
    _NO_CHECK = {"check_vma": False}
except AttributeError:  # pragma: no cover - jax releases before jax.shard_map
    from jax.experimental.shard_map import shard_map as _shard_map

    _NO_CHECK = {"check_rep": False}

HEAD_AXIS = "tensor"  # the KV heads (and the query heads that read them) split over it


def attention_specs(mesh: Mesh, batch: int, n_kv_heads: int) -> tuple[P, P, P]:
    """(spec of q [B, N, H] and outputs, spec of k / v [B, K, C, H], spec of fill [B]).

    The same layout as the sharded KV cache, so the cache enters the shard_map unmoved.
    """
    sizes = dict(mesh.shape)
    cache_spec = fit_spec(P(BATCH, HEAD_AXIS), (batch, n_kv_heads), sizes, what="decode attention")
    return cache_spec, cache_spec, P(cache_spec[0])


def shard_attention(attend: Callable, mesh: Mesh | None, q, k, v, fill) -> tuple[jax.Array, jax.Array]:
    """`attend(q, k, v, fill) -> (o [B, N, H], lse [B, N])` run per device under shard_map."""
    if mesh is None or mesh.size == 1:
        return attend(q, k, v, fill)
    missing = [a for a in (*BATCH, HEAD_AXIS) if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"decode attention mesh axes {mesh.axis_names} lack {missing}; expected a "
            f"{(*BATCH, HEAD_AXIS)} mesh (sharding.make_mesh)"
        )
    q_spec, kv_spec, fill_spec = attention_specs(mesh, q.shape[0], k.shape[1])
    fn = _shard_map(
        attend,
        mesh=mesh,
        in_specs=(q_spec, kv_spec, kv_spec, fill_spec),
        out_specs=(q_spec, q_spec),
        **_NO_CHECK,
    )
    return fn(q, k, v, fill)


__all__ = ["attention_specs", "shard_attention"]
