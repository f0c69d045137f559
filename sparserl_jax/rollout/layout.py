"""Owns the rollout layout (`rollout.mesh`): the mesh the sampler decodes on and where the weights
live on it, apart from the training layout (model/sharding.py: parameters fully sharded over
"fsdp", split Megatron-style over "tensor"). Touches no prompts, rewards or run state.

  train     the training mesh and layout as they are: no copy of the weights, any model that
            trains decodes; the decode loop gathers each layer's weights and splits the
            logits' partial sums across devices in every step (XLA partitions it).
  data      one group per device: the weights replicated (a full copy on every device), the
            rows split over every device, and each device decodes its own rows alone
            (on_mesh.generate_per_device: the whole sampler under shard_map), so the decode
            loop moves nothing between devices but its scalar stop test.
  tensor:N  groups of N devices, each holding the weights split over its N as the partition
            rules split them over "tensor" (heads, MLP hidden dim, vocabulary); the rows split
            over the groups, each group decoding its own rows alone (for a model whose weights
            do not fit one device). Inside a group XLA partitions the step over "tensor".

With `data` or `tensor:N` the weights are resharded from the training layout once per
iteration (`RolloutMesh.place`: a jitted all-gather of each weight of the compute copy) where the
rollout source receives them, a second copy beside the training one; the training layout stays
as it is. Every decoder follows the layout: the static sampler (`RolloutMesh.generate`), SortedRL's
slot engine (its programs per row group, `manual_axes`: rollout/engine_programs.py jitted) and
evaluation (evaluate.py evaluate_examples).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparserl_jax.model import sharding as shd
from sparserl_jax.rollout.on_mesh import generate_on_mesh, generate_per_device
from sparserl_jax.rollout.sampler import Rollout, SamplerConfig

SETTING = "rollout.mesh"
LAYOUTS = ("train", "data", "tensor:N")  # rollout.mesh's accepted values (N: devices per group)


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    """A parsed rollout.mesh: `kind` ("train", "data" or "tensor") and, for "tensor", the
    devices of a group (`tensor`)."""

    kind: str = "train"
    tensor: int = 1

    @classmethod
    def parse(cls, value: str) -> RolloutLayout:
        """rollout.mesh's value ("train", "data", "tensor:N" with N >= 1) as a layout."""
        if value in ("train", "data"):
            return cls(value)
        head, _, n = value.partition(":") if isinstance(value, str) else ("", "", "")
        if head == "tensor" and n.isdigit() and int(n) >= 1:
            return cls("tensor", int(n))
        raise ValueError(
            f"{SETTING}={value!r}: accepted values are {LAYOUTS} (N a positive integer: devices per group)"
        )


def check_layout(value: str) -> None:
    """rollout.mesh names a layout (RolloutConfig's check)."""
    RolloutLayout.parse(value)


def rollout_mesh(value: str, train_mesh: Mesh) -> RolloutMesh:
    """The rollout mesh rollout.mesh=`value` names over the devices of `train_mesh` (the same
    devices in the same order: the training mesh's device list regrouped)."""
    layout = RolloutLayout.parse(value)
    if layout.kind == "train":
        return RolloutMesh(layout, train_mesh)
    devices = np.asarray(train_mesh.devices).reshape(-1)
    n = devices.size
    if n % layout.tensor:
        raise ValueError(f"{SETTING}={value!r}: {layout.tensor} devices per group must divide the mesh's {n} devices")
    shape = (n // layout.tensor, 1, layout.tensor)
    auto = (jax.sharding.AxisType.Auto,) * len(shd.AXES)
    return RolloutMesh(layout, Mesh(devices.reshape(shape), shd.AXES, axis_types=auto))


@dataclasses.dataclass(frozen=True)
class RolloutMesh:
    """A rollout layout on its mesh: what the rollout sources (rollout/source.py) decode with."""

    layout: RolloutLayout
    mesh: Mesh

    @property
    def per_device(self) -> bool:
        """Whether each row group decodes alone (data, tensor:N on several devices)."""
        return self.layout.kind != "train" and self.mesh.size > 1

    @property
    def manual_axes(self) -> tuple[str, ...]:
        """The mesh axes a row group decodes alone over, under shard_map: every axis for "data"
        (each device its rows), data and fsdp for "tensor:N" (XLA partitions a group's step over
        its "tensor" devices); none for "train" or one device (XLA partitions the whole program)."""
        if not self.per_device:
            return ()
        return shd.AXES if self.layout.kind == "data" else shd.BATCH

    @property
    def row_groups(self) -> int:
        """How many ways a sampler call's rows are split (each call's rows: a multiple of it)."""
        return math.prod(self.mesh.shape[a] for a in shd.BATCH)

    def param_shardings(self, params: Any) -> Any:
        """Each weight's place on the rollout mesh: replicated (data), or split over a group's
        "tensor" axis by the partition rules (tensor:N; the rollout mesh's fsdp axis is 1)."""
        if self.layout.kind == "data":
            return jax.tree.map(lambda _: NamedSharding(self.mesh, P()), params)
        return shd.param_shardings(params, self.mesh)

    def place(self, params: Any) -> Any:
        """`params` in the rollout layout: as they are for "train" (or one device), or when every
        array already lives on the rollout mesh (placed before, perhaps quantized since), else a
        copy resharded from wherever they live (the training layout), a jitted program per
        weight. Call it once per iteration, before the iteration's sampler calls."""
        if not self.per_device or all(_on_mesh(x, self.mesh) for x in jax.tree.leaves(params)):
            return params
        return jax.tree.map(lambda x, s: _reshard(s)(x), params, self.param_shardings(params))

    def generate(
        self,
        params: Any,
        model_cfg: Any,
        tokens: np.ndarray,
        lengths: np.ndarray,
        key: jax.Array,
        sampler_cfg: SamplerConfig,
        request_ids: np.ndarray | None = None,
    ) -> Rollout:
        """One sampler call on this layout (`params` placed by `place`), as host numpy arrays on
        every process (a collective): on_mesh.generate_per_device, or for "train"
        on_mesh.generate_on_mesh on the training mesh."""
        if self.per_device:
            return generate_per_device(
                params,
                model_cfg,
                tokens,
                lengths,
                key,
                sampler_cfg,
                self.mesh,
                request_ids,
                manual_axes=self.manual_axes,
            )
        return generate_on_mesh(params, model_cfg, tokens, lengths, key, sampler_cfg, self.mesh, request_ids)


def _on_mesh(x: Any, mesh: Mesh) -> bool:
    """Whether array `x` is laid out on `mesh` (a NamedSharding over it)."""
    sharding = getattr(x, "sharding", None)
    return isinstance(sharding, NamedSharding) and sharding.mesh == mesh


@functools.lru_cache(maxsize=64)
def _reshard(sharding: NamedSharding) -> Any:
    """A jitted identity onto `sharding`: XLA's all-gather (or slice) moves a weight from its
    training shards to its rollout place. One weight a program, so the move needs at most one
    weight's full copy beside the two layouts (XLA may go through one: tensor:N from fsdp)."""
    return jax.jit(lambda x: x, out_shardings=sharding)
