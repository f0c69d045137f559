"""Sharding: a 3-axis device mesh, partition rules on parameter paths, and sharded entry points.

The mesh has axes ("data", "fsdp", "tensor"). Batches split over data x fsdp; parameters are
fully sharded over fsdp (ZeRO-3 style: gathered per use by XLA) and split Megatron-style over
tensor (heads, MLP hidden dim, vocabulary). The entry points hand the model their mesh, which
keeps the activations on the batch split (model/activation_sharding.py): without it XLA would
split the activations' model dim as the weights' instead, every device holding the whole batch.
Rules are regexes on the '/'-joined parameter path, so the same pure model code runs on 1 CPU,
8 fake CPU devices, one GPU or a multi-host pod: only the mesh changes. A dim that its mesh axes
do not divide is replicated instead (logged once).

Usage (jit + NamedSharding, the modern pjit):
    mesh = make_mesh(MeshConfig(data=-1, fsdp=2, tensor=2))
    params = shard_params(params, mesh)            # or init_sharded_params(cfg, key, mesh)
    logits = sharded_logits(mesh, cfg)(params, shard_batch(tokens, mesh))
    cache = init_sharded_cache(mesh, cfg, batch, capacity)
    step_logits, cache = sharded_prefill(mesh, cfg, cache)(params, tokens, lengths, cache)
    step_logits, cache = sharded_decode_step(mesh, cfg, cache)(params, cache, next_tokens)
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Int

from sparserl_jax.kvcache import cache as kvc
from sparserl_jax.mesh_axes import AXES, BATCH, entry_size, fit_spec
from sparserl_jax.model import transformer
from sparserl_jax.model.config import ModelConfig

# First match wins. Shapes: embed [V, D], q [D, N, H], k/v [D, K, H], o [N, H, D],
# biases [N, H] / [K, H], gate/up [D, F], down [F, D], lm_head [D, V], norms [D] or [H].
PARTITION_RULES: tuple[tuple[str, P], ...] = (
    (r"^embed$", P("tensor", "fsdp")),
    (r"^lm_head$", P("fsdp", "tensor")),
    (r"^layers/\d+/(q|k|v)$", P("fsdp", "tensor", None)),
    (r"^layers/\d+/o$", P("tensor", None, "fsdp")),
    (r"^layers/\d+/(q|k|v)_bias$", P("tensor", None)),
    (r"^layers/\d+/(gate|up)$", P("fsdp", "tensor")),
    (r"^layers/\d+/down$", P("tensor", "fsdp")),
    (r"(^|/)\w*norm$", P()),
)


# ----------------------------------------------------------------------------- mesh


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Sizes of the ("data", "fsdp", "tensor") mesh axes; one of them may be -1 ("the rest")."""

    data: int = -1
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        sizes = dataclasses.asdict(self)
        for name, size in sizes.items():
            if not isinstance(size, int) or (size < 1 and size != -1):
                raise ValueError(f"mesh.{name}={size!r} must be a positive int or -1 (the rest)")
        rest = [name for name, size in sizes.items() if size == -1]
        if len(rest) > 1:
            raise ValueError(f"mesh.{rest[0]} and mesh.{rest[1]} are both -1: at most one axis may take the rest")

    def resolve(self, n_devices: int) -> tuple[int, int, int]:
        """Axis sizes for `n_devices` devices, with -1 replaced by what is left."""
        sizes = dataclasses.asdict(self)
        fixed = math.prod(s for s in sizes.values() if s != -1)
        setting = " x ".join(f"mesh.{name}={size}" for name, size in sizes.items())
        if -1 in sizes.values():
            if n_devices % fixed:
                raise ValueError(f"{setting}: the fixed axes ({fixed}) must divide the {n_devices} devices")
            sizes = {k: (n_devices // fixed if s == -1 else s) for k, s in sizes.items()}
        elif fixed != n_devices:
            raise ValueError(
                f"{setting} = {fixed} devices, but {n_devices} are available; "
                "make the product match or set one axis to -1"
            )
        return sizes["data"], sizes["fsdp"], sizes["tensor"]


def make_mesh(mesh_cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """The ("data", "fsdp", "tensor") mesh over `devices` (default: every device of every process).

    jax.make_mesh orders devices for the interconnect (TPU torus, GPU ids). With several
    processes the leading "data" axis is the one that spans hosts (slowest links, least traffic).
    Axes are Auto: XLA propagates shardings through the model (no explicit-sharding types).
    """
    devices = list(jax.devices() if devices is None else devices)
    shape = mesh_cfg.resolve(len(devices))
    auto = (jax.sharding.AxisType.Auto,) * len(AXES)
    return jax.make_mesh(shape, AXES, axis_types=auto, devices=devices)


# ----------------------------------------------------------------------------- specs


def path_str(path: tuple) -> str:
    """'/'-joined key path of a pytree leaf, e.g. 'layers/3/q'."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def param_specs(
    params_or_shapes: Any,
    axis_sizes: Mapping[str, int],
    rules: Sequence[tuple[str, P]] = PARTITION_RULES,
) -> Any:
    """PartitionSpec per parameter from the first rule matching its path, fitted to the mesh.

    Works on arrays and on jax.eval_shape output alike (only `.shape` is read), so a 7B model's
    layout can be planned without allocating it. `axis_sizes` is e.g. dict(mesh.shape).
    """

    def spec_for(path, leaf):
        name = path_str(path)
        for pattern, spec in rules:
            if re.search(pattern, name):
                if len(spec) > len(leaf.shape):
                    raise ValueError(
                        f"partition rule {pattern!r} -> {spec} has more entries than "
                        f"param {name!r} has dims {tuple(leaf.shape)}"
                    )
                return fit_spec(spec, leaf.shape, axis_sizes, what=f"param {name!r}")
        raise ValueError(f"no partition rule matches param {name!r}; add one to sharding.PARTITION_RULES")

    return jax.tree_util.tree_map_with_path(spec_for, params_or_shapes)


def param_shardings(params_or_shapes: Any, mesh: Mesh, rules: Sequence[tuple[str, P]] = PARTITION_RULES) -> Any:
    """NamedSharding per parameter (same pytree); accepts jax.eval_shape output."""
    specs = param_specs(params_or_shapes, dict(mesh.shape), rules)
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def place(tree: Any, shardings: Any) -> Any:
    """Put host or single-device arrays onto global shardings; on several processes every
    process must hold the same full values (each one then keeps only its own shards). Arrays
    already spread over the processes (e.g. a jit's outputs) are resharded."""

    def put(x, sharding):
        if sharding.is_fully_addressable or (isinstance(x, jax.Array) and not x.is_fully_addressable):
            return jax.device_put(x, sharding)
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])

    return jax.tree_util.tree_map(put, tree, shardings)


def shard_params(params: Any, mesh: Mesh) -> Any:
    """Params laid out on `mesh` by PARTITION_RULES."""
    return place(params, param_shardings(params, mesh))


def abstract_params(cfg: ModelConfig) -> Any:
    """Shapes and dtypes of init_params(cfg) (jax.ShapeDtypeStruct leaves), nothing allocated."""
    return jax.eval_shape(functools.partial(transformer.init_params, cfg), jax.random.key(0))


def init_sharded_params(cfg: ModelConfig, key: jax.Array, mesh: Mesh) -> Any:
    """init_params computed directly into its shards (no full copy on any device or host)."""
    shardings = param_shardings(abstract_params(cfg), mesh)
    return jax.jit(functools.partial(transformer.init_params, cfg), out_shardings=shardings)(key)


# ----------------------------------------------------------------------------- batches, cache


def data_sharding(mesh: Mesh) -> NamedSharding:
    """[B, ...] arrays (tokens, lengths, logits, rewards) split on B over data x fsdp."""
    return NamedSharding(mesh, P(BATCH))


def shard_batch(x: Any, mesh: Mesh) -> Any:
    """Put a [B, ...] array (or pytree of them, same on every process) on data_sharding(mesh)."""
    n = entry_size(BATCH, dict(mesh.shape))
    for leaf in jax.tree_util.tree_leaves(x):
        if leaf.shape[0] % n:
            raise ValueError(f"batch size {leaf.shape[0]} must be a multiple of mesh data x fsdp = {n}")
    sharding = data_sharding(mesh)
    return place(x, jax.tree_util.tree_map(lambda _: sharding, x))


def cache_specs(cache: kvc.KVCache, axis_sizes: Mapping[str, int]) -> kvc.KVCache:
    """A KVCache of PartitionSpecs: batch over data x fsdp, KV (or query) heads over tensor."""

    def fit(spec, arrays):
        if arrays is None:
            return None
        return tuple(fit_spec(spec, a.shape, axis_sizes, what="KV cache") for a in arrays)

    heads = P(BATCH, "tensor")  # k, v [B,K,C,H]; pos, mass [B,K,C]; window_q [B,N,W,H]
    return cache.replace(
        k=fit(heads, cache.k),
        v=fit(heads, cache.v),
        pos=fit(heads, cache.pos),
        fill=fit_spec(P(BATCH), cache.fill.shape, axis_sizes, what="KV cache"),
        length=fit_spec(P(BATCH), cache.length.shape, axis_sizes, what="KV cache"),
        mass=fit(heads, cache.mass),
        window_q=fit(heads, cache.window_q),
    )


def cache_shardings(cache: kvc.KVCache, mesh: Mesh) -> kvc.KVCache:
    """A KVCache of NamedShardings (accepts jax.eval_shape output)."""
    specs = cache_specs(cache, dict(mesh.shape))
    return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def _cache_factory(cfg: ModelConfig, batch: int, capacity: int, **cache_kw) -> Callable:
    return functools.partial(
        kvc.init_cache,
        batch,
        cfg.n_layers,
        cfg.n_kv_heads,
        capacity,
        cfg.head_dim,
        jnp.dtype(cfg.dtype),
        n_heads=cfg.n_heads,
        **cache_kw,
    )


def init_sharded_cache(mesh: Mesh, cfg: ModelConfig, batch: int, capacity: int, **cache_kw) -> kvc.KVCache:
    """An empty KVCache created directly in its shards (`cache_kw`: track_mass, window)."""
    make = _cache_factory(cfg, batch, capacity, **cache_kw)
    shardings = cache_shardings(jax.eval_shape(make), mesh)
    return jax.jit(make, out_shardings=shardings)()


# ----------------------------------------------------------------------------- entry points


def sharded_logits(mesh: Mesh, cfg: ModelConfig) -> Callable:
    """jit of transformer.logits: (params, tokens [B, T]) -> float32 logits [B, T, V], B split
    over data x fsdp (B must be a multiple of their product)."""
    batch = data_sharding(mesh)

    def fn(params, tokens: Int[Array, "B T"]):
        return transformer.logits(params, cfg, tokens, mesh=mesh)

    p_sh = param_shardings(abstract_params(cfg), mesh)
    return jax.jit(fn, in_shardings=(p_sh, batch), out_shardings=batch)


def sharded_prefill(
    mesh: Mesh, cfg: ModelConfig, cache: kvc.KVCache, *, observe_prefill: Callable | None = None
) -> Callable:
    """jit of transformer.prefill: (params, tokens [B, T], lengths [B], cache) -> (logits [B, V],
    cache). `cache` (a KVCache or its eval_shape) fixes the cache layout; the cache is donated."""
    batch = data_sharding(mesh)
    c_sh = cache_shardings(cache, mesh)

    def fn(params, tokens, lengths, cache):
        return transformer.prefill(params, cfg, tokens, lengths, cache, observe_prefill=observe_prefill, mesh=mesh)

    p_sh = param_shardings(abstract_params(cfg), mesh)
    return jax.jit(fn, in_shardings=(p_sh, batch, batch, c_sh), out_shardings=(batch, c_sh), donate_argnums=3)


def sharded_decode_step(
    mesh: Mesh,
    cfg: ModelConfig,
    cache: kvc.KVCache,
    *,
    attn_impl: str = "auto",
    observe: Callable | None = None,
) -> Callable:
    """jit of transformer.decode_step: (params, cache, tokens [B]) -> (logits [B, V], cache),
    the cache keeping its layout from step to step (donated, so updated in place); attention
    runs per device on its cache shard (shard_map over `mesh`)."""
    batch = data_sharding(mesh)
    c_sh = cache_shardings(cache, mesh)

    def fn(params, cache, tokens):
        return transformer.decode_step(params, cfg, cache, tokens, attn_impl=attn_impl, observe=observe, mesh=mesh)

    p_sh = param_shardings(abstract_params(cfg), mesh)
    return jax.jit(fn, in_shardings=(p_sh, c_sh, batch), out_shardings=(batch, c_sh), donate_argnums=1)
