"""Where a full-sequence pass's activations live on a mesh: rows over data x fsdp, heads over tensor.

The weights are fully sharded over fsdp (model/sharding.py PARTITION_RULES: the embedding's model
dim among them). Left to itself, XLA's partitioner propagates that split into the residual stream:
every device then holds the WHOLE batch with D split, reduces every projection with an all-reduce
and gathers no weight. Pinning the residual stream x_BxTxD to the batch split at the layer
boundaries (after the embedding lookup, after every block, the final hidden state; the lookup reads
the table gathered over data x fsdp, so its output is born on the rows), and queries,
keys, values and the attention output to heads over tensor, keeps the activations where the
batch is: each device computes its own B / (data x fsdp) rows, a layer's weights are all-gathered
where it runs (ZeRO-3) and their gradients summed over the row shards (XLA, CPU and TPU alike at
the test's sizes: one combined all-reduce, of which each device keeps its shard).
tests/test_fsdp_layout.py reads this from the compiled programs.

The model is pure and mesh-agnostic: `ActivationSharding(None)` (no mesh, or one device) pins
nothing, so the same code runs unchanged on one device, and nothing is pinned inside shard_map
(a per-device program, e.g. the rollout's, already holds only its own rows). A dim that its mesh
axes do not divide is left replicated (mesh_axes.fit_spec). The pins are
jax.lax.with_sharding_constraint on NamedShardings of the concrete mesh passed in, no mesh context.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from sparserl_jax.mesh_axes import BATCH, entry_size, fit_spec

ROWS = P(BATCH)  # [B, ...]: rows over data x fsdp
HEADS = P(BATCH, None, "tensor")  # [B, T, N, H]: rows over data x fsdp, heads over tensor
EMBED_TABLE = P("tensor", None)  # [V, D] where a lookup reads it: vocabulary over tensor, D whole


@dataclasses.dataclass(frozen=True)
class ActivationSharding:
    """The activation layout of one mesh (hashable: a static part of the jitted programs).
    `mesh` None, or a mesh of one device: every method returns its input unchanged."""

    mesh: Mesh | None = None

    def __post_init__(self):
        if self.mesh is not None and self.mesh.size == 1:
            object.__setattr__(self, "mesh", None)

    def batch_shards(self, rows: int) -> int:
        """How many devices `rows` rows split over: data x fsdp, or the part of it that divides
        `rows` (1 without a mesh)."""
        if self.mesh is None:
            return 1
        entry = fit_spec(ROWS, (rows,), dict(self.mesh.shape), what="activation rows")[0]
        return 1 if entry is None else entry_size(entry, dict(self.mesh.shape))

    def pin(self, x: Array, spec: P) -> Array:
        """`x` constrained to `spec` (fitted to its shape) on the mesh; `x` itself without one, and
        inside shard_map (a per-device program holds only its own rows already)."""
        if self.mesh is None or jax.sharding.get_abstract_mesh().manual_axes:
            return x
        spec = fit_spec(spec, x.shape, dict(self.mesh.shape), what="activation")
        return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))

    def rows(self, x: Float[Array, "B ..."]) -> Float[Array, "B ..."]:
        """A [B, ...] activation (the residual stream, the final hidden state) split on B."""
        return self.pin(x, ROWS)

    def lookup_table(self, embed: Float[Array, "V D"]) -> Float[Array, "V D"]:
        """The embedding table whole over data x fsdp (vocabulary still over tensor) where a lookup
        reads it: gathered like any layer's weights (ZeRO-3), so the lookup's output is born split
        on its rows. From a table split on D (model/sharding.py) XLA:TPU otherwise looked up every
        row of the batch on every chip ([B, T, D / fsdp]) and its backward scattered them back so."""
        return self.pin(embed, EMBED_TABLE)

    def heads(self, x: Float[Array, "B T N H"]) -> Float[Array, "B T N H"]:
        """Queries, keys, values or attention output: B split, heads over tensor."""
        return self.pin(x, HEADS)
