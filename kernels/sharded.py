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

try:  # jax >= 0.7: jax.shard_map (check_vma, axis_names); older: jax.experimental's (check_rep, auto)
    _shard_map = jax.shard_map
    _NO_CHECK = {"check_vma": False}
    _NEW_API = True
except AttributeError:  # pragma: no cover - jax releases before jax.shard_map
    from jax.experimental.shard_map import shard_map as _shard_map

    _NO_CHECK = {"check_rep": False}
    _NEW_API = False

HEAD_AXIS = "tensor"  # the KV heads (and the query heads that read them) split over it


def attention_specs(mesh: Mesh, batch: int, n_kv_heads: int, manual: tuple[str, ...] = ()) -> tuple[P, P, P]:
    """(spec of q [B, N, H] and outputs, spec of k / v [B, K, C, H], spec of fill [B]).

    The same layout as the sharded KV cache, so the cache enters the shard_map unmoved. Axes in
    `manual` are manual already (the call runs inside a shard_map over them, its arrays local to
    them) and are left out.
    """
    sizes = dict(mesh.shape)
    rows = tuple(a for a in BATCH if a not in manual) or None
    heads = None if HEAD_AXIS in manual else HEAD_AXIS
    cache_spec = fit_spec(P(rows, heads), (batch, n_kv_heads), sizes, what="decode attention")
    return cache_spec, cache_spec, P(cache_spec[0])


def _manual_axes() -> tuple[str, ...]:
    """The mesh axes an enclosing shard_map has made manual (rollout/on_mesh.py
    generate_per_device: a row group decoding alone); none outside one."""
    get = getattr(jax.sharding, "get_abstract_mesh", None)
    return tuple(get().manual_axes) if get is not None else ()


def shard_attention(attend: Callable, mesh: Mesh | None, q, k, v, fill) -> tuple[jax.Array, jax.Array]:
    """`attend(q, k, v, fill) -> (o [B, N, H], lse [B, N])` run per device under shard_map. Inside
    a shard_map over some of the mesh's axes (a row group of rollout.mesh=tensor:N) the arrays are
    the group's, and the attention is split over the remaining axes of the enclosing mesh."""
    if mesh is None or mesh.size == 1:
        return attend(q, k, v, fill)
    missing = [a for a in (*BATCH, HEAD_AXIS) if a not in mesh.axis_names]
    if missing:
        raise ValueError(
            f"decode attention mesh axes {mesh.axis_names} lack {missing}; expected a "
            f"{(*BATCH, HEAD_AXIS)} mesh (sharding.make_mesh)"
        )
    manual = _manual_axes()
    if manual:
        free = tuple(a for a in mesh.axis_names if a not in manual)
        if all(mesh.shape[a] == 1 for a in free):
            return attend(q, k, v, fill)
        mesh = jax.sharding.get_abstract_mesh()
    else:
        free = None
    q_spec, kv_spec, fill_spec = attention_specs(mesh, q.shape[0], k.shape[1], manual)
    fn = per_device(attend, mesh, (q_spec, kv_spec, kv_spec, fill_spec), (q_spec, q_spec), free)
    return fn(q, k, v, fill)


def per_device(fn: Callable, mesh: Mesh, in_specs, out_specs, manual_axes: tuple[str, ...] | None = None) -> Callable:
    """`fn` under shard_map on `mesh`, on every jax this package supports: each device runs it on
    its own blocks (in_specs / out_specs), manual over `manual_axes` (None: every axis; the others
    stay automatic, XLA partitioning `fn` over them). Replication of the outputs is not checked:
    out_specs say which blocks make each result."""
    if manual_axes is None or set(manual_axes) == set(mesh.axis_names):
        axes = {}
    elif _NEW_API:
        axes = {"axis_names": frozenset(manual_axes)}
    else:  # pragma: no cover - jax releases before jax.shard_map
        axes = {"auto": frozenset(mesh.axis_names) - set(manual_axes)}
    return _shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **_NO_CHECK, **axes)


__all__ = ["attention_specs", "per_device", "shard_attention"]
