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


def _select(params: dict, cfg: QuantConfig) -> dict:
    """The kernels to quantize, as {"layers": [{name: w}], ("lm_head": w)}."""
    sel = {
        "layers": [
            {n: w for n, w in layer.items() if n in PROJECTIONS and n not in cfg.skip} for layer in params["layers"]
        ]
    }
    if HEAD in params and HEAD not in cfg.skip:
        sel[HEAD] = params[HEAD]
    return sel


def _map_selected(sel: dict, fn) -> dict:
    out = {"layers": [{n: fn(n, w) for n, w in layer.items()} for layer in sel["layers"]]}
    if HEAD in sel:
        out[HEAD] = fn(HEAD, sel[HEAD])
    return out


def _merge(params: dict, quantized: dict) -> dict:
    """params with the quantized kernels swapped in; every other leaf is params' own buffer."""
    out = {**params, "layers": [{**layer, **q} for layer, q in zip(params["layers"], quantized["layers"])]}
    if HEAD in quantized:
        out[HEAD] = quantized[HEAD]
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


@functools.lru_cache(maxsize=16)
def _compiled(cfg: QuantConfig, treedef, shardings):
    out_shardings = None if shardings is None else jax.tree.unflatten(treedef, shardings)
    return jax.jit(
        functools.partial(_map_selected, fn=functools.partial(_quantize_weight, cfg=cfg)), out_shardings=out_shardings
    )


def quantize_params(params: dict, cfg: QuantConfig) -> dict:
    """The same tree with the q/k/v/o and gate/up/down kernels (and lm_head when not skipped) as
    QWeights, quantized by one jitted program per (config, layout); the other leaves are params'
    own buffers. Sharded kernels give QWeights sharded like them."""
    if not cfg.enabled:
        return params
    _check_weights(params, cfg)
    sel = _select(params, cfg)
    if not all(isinstance(getattr(w, "sharding", None), NamedSharding) for w in jax.tree.leaves(sel)):
        return _merge(params, _compiled(cfg, None, None)(sel))
    shardings = _map_selected(sel, lambda n, w: _qweight(*_out_sharding(n, w.sharding, w.ndim), cfg))
    leaves, treedef = jax.tree.flatten(shardings)
    return _merge(params, _compiled(cfg, treedef, tuple(leaves))(sel))


def abstract_quantized(params_or_shapes: dict, cfg: QuantConfig) -> dict:
    """jax.eval_shape of quantize_params (plans the quantized copy's memory without allocating)."""
    _check_weights(params_or_shapes, cfg)
    sel = _select(params_or_shapes, cfg)
    return _merge(
        params_or_shapes,
        jax.eval_shape(functools.partial(_map_selected, fn=functools.partial(_quantize_weight, cfg=cfg)), sel),
    )


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
    return sum(x.nbytes if isinstance(x, QWeight) else x.size * jnp.dtype(x.dtype).itemsize for x in leaves)
