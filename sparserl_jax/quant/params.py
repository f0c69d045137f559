"""A quantized copy of the policy's params (QuRL's behaviour policy) and invariant scaling."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from sparserl_jax.quant.config import HEAD, KEEP_FULL, PROJECTIONS, QuantConfig
from sparserl_jax.quant.core import QWeight, quantize


def _contracting_axes(name: str, ndim: int) -> tuple[int, ...]:
    n_out = 1 if name == HEAD else PROJECTIONS[name]
    return tuple(range(ndim - n_out))


def _qweight(values, scale, cfg: QuantConfig) -> QWeight:
    act = cfg.format if cfg.mode == "w8a8" else None
    return QWeight(values, scale, fmt=cfg.format, act=act, impl=cfg.impl)


def _quantize_weight(name: str, w, cfg: QuantConfig) -> QWeight:
    return _qweight(*quantize(w, cfg.format, _contracting_axes(name, w.ndim)), cfg)


def _map_kernels(params: dict, cfg: QuantConfig, fn) -> dict:
    """params with fn(name, w) in place of every kernel to quantize."""
    out = dict(params)
    if HEAD in params and HEAD not in cfg.skip:
        out[HEAD] = fn(HEAD, params[HEAD])
    out["layers"] = [
        {name: fn(name, w) if name in PROJECTIONS and name not in cfg.skip else w
         for name, w in layer.items()}
        for layer in params["layers"]
    ]
    return out


def _check_weights(params: dict, cfg: QuantConfig) -> None:
    for i, layer in enumerate(params["layers"]):
        for name in layer:
            if name not in PROJECTIONS and name not in KEEP_FULL:
                raise ValueError(
                    f"quant.format={cfg.format!r}: cannot quantize layers[{i}].{name} (a weight this "
                    f"module does not know); quantizable: {tuple(PROJECTIONS)}, full precision: "
                    f"{KEEP_FULL}"
                )


def _out_sharding(name: str, s, ndim: int):
    """Values like the kernel; the scale with its (size-1) contracting axes unsharded."""
    if not isinstance(s, NamedSharding):
        return s, s
    spec = list(s.spec) + [None] * (ndim - len(s.spec))
    for a in _contracting_axes(name, ndim):
        spec[a] = None
    return s, NamedSharding(s.mesh, PartitionSpec(*spec))


def _out_shardings(params: dict, cfg: QuantConfig):
    """Output shardings following the kernels' NamedShardings (None when not on a mesh)."""
    if not all(isinstance(getattr(x, "sharding", None), NamedSharding) for x in jax.tree.leaves(params)):
        return None
    tree = _map_kernels(params, cfg, lambda name, w: _qweight(*_out_sharding(name, w.sharding, w.ndim), cfg))
    return jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else x, tree)


@functools.lru_cache(maxsize=16)
def _compiled(cfg: QuantConfig, treedef, shardings):
    out_shardings = None if shardings is None else jax.tree.unflatten(treedef, shardings)
    return jax.jit(functools.partial(_map_kernels, cfg=cfg, fn=functools.partial(
        _quantize_weight, cfg=cfg)), out_shardings=out_shardings)


def quantize_params(params: dict, cfg: QuantConfig) -> dict:
    """The same tree with the q/k/v/o and gate/up/down kernels (and lm_head unless skipped) as
    QWeights; one jitted program per (config, layout). Sharded params give sharded QWeights."""
    if not cfg.enabled:
        return params
    _check_weights(params, cfg)
    shardings = _out_shardings(params, cfg)
    if shardings is None:
        return _compiled(cfg, None, None)(params)
    leaves, treedef = jax.tree.flatten(shardings)
    return _compiled(cfg, treedef, tuple(leaves))(params)


def abstract_quantized(params_or_shapes: dict, cfg: QuantConfig) -> dict:
    """jax.eval_shape of quantize_params (plans the quantized copy's memory without allocating)."""
    _check_weights(params_or_shapes, cfg)
    return jax.eval_shape(functools.partial(_map_kernels, cfg=cfg, fn=functools.partial(
        _quantize_weight, cfg=cfg)), params_or_shapes)


def invariant_scale(params: dict, s: float) -> dict:
    """QuRL's invariant scaling: each attention RMSNorm scale (the one feeding q/k/v) times s and
    the q/k/v kernels divided by s: the same function in exact arithmetic, with larger norm
    outputs relative to the kernels' quantization grid."""
    layers = []
    for layer in params["layers"]:
        layer = dict(layer)
        layer["attn_norm"] = (layer["attn_norm"] * s).astype(layer["attn_norm"].dtype)
        for name in ("q", "k", "v"):
            layer[name] = (layer[name] / s).astype(layer[name].dtype)
        layers.append(layer)
    return {**params, "layers": layers}


def quantized_bytes(params: dict) -> int:
    """Bytes of the QWeights' values and scales plus the full-precision leaves of a quantized tree."""
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QWeight))
    return sum(x.nbytes if isinstance(x, QWeight) else x.size * jnp.dtype(x.dtype).itemsize
               for x in leaves)
