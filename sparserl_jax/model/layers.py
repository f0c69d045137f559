"""Stateless building blocks: RMSNorm, rotary embeddings (with Llama-3 scaling), SwiGLU MLP."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from sparserl_jax.model.config import ModelConfig
from sparserl_jax.quant.core import dot


def rms_norm(x: Float[Array, "... D"], weight: Float[Array, " D"], eps: float) -> Float[Array, "... D"]:
    """RMSNorm computed in float32, cast back to the input dtype before the weight (as HF does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    normed = x32.astype(x.dtype)
    if jnp.finfo(normed.dtype).bits >= 32 or weight.dtype != normed.dtype:
        return weight * normed
    return _narrow_weighted(weight, normed)


@jax.custom_vjp
def _narrow_weighted(weight: Float[Array, " D"], normed: Float[Array, "... D"]) -> Float[Array, "... D"]:
    """weight * normed in a narrow dtype (bfloat16), its input gradient autodiff's (g * weight,
    torch's bits) and the weight's gradient the exact products summed in float32 over the tokens,
    rounded once (torch rounds each product to bfloat16, then accumulates in float): autodiff
    summed bfloat16 products, which XLA:CPU runs as a tree of bfloat16 reduce-windows (2.3x this
    backward's time at [768, 576], one core; 4.5x its float64 error)."""
    return weight * normed


def _narrow_weighted_fwd(weight, normed):
    return weight * normed, (weight, normed)


def _narrow_weighted_bwd(res, g):
    weight, normed = res
    tokens = tuple(range(g.ndim - 1))
    d_weight = jnp.sum(g.astype(jnp.float32) * normed.astype(jnp.float32), axis=tokens)
    return d_weight.astype(weight.dtype), g * weight


_narrow_weighted.defvjp(_narrow_weighted_fwd, _narrow_weighted_bwd)


def rope_inv_freq(cfg: ModelConfig) -> Float[Array, " H2"]:
    """Inverse frequencies (head_dim / 2 of them), with the "llama3" scaling when configured."""
    H = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, H, 2, dtype=jnp.float32) / H))
    sc = cfg.rope_scaling
    if sc is None:
        return inv_freq
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / sc.factor, inv_freq)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


@functools.lru_cache(maxsize=64)
def rope_frequencies(cfg: ModelConfig) -> np.ndarray:
    """rope_inv_freq as float32 constants, computed once per model by jax's eager operations: HF's
    formula operation for operation (inside a jitted program XLA rewrites 1 / theta ** x as
    theta ** -x, one float32 rounding off on some frequencies), the same for the learner's tables
    and the decode step's."""
    with jax.ensure_compile_time_eval():
        inv_freq = np.asarray(rope_inv_freq(cfg), np.float32)
    inv_freq.setflags(write=False)
    return inv_freq


RopeTables = tuple[Float[Array, "B T H2"], Float[Array, "B T H2"]]


def rope_tables(positions: Int[Array, "B T"], inv_freq: Float[Array, " H2"]) -> RopeTables:
    """cos and sin of every position's angles, float32: computed once for all layers (and both of
    a layer's q and k) rather than inside each layer's RoPE."""
    angles_BxTxH2 = positions[..., None].astype(jnp.float32) * inv_freq
    return jnp.cos(angles_BxTxH2), jnp.sin(angles_BxTxH2)


def sequence_rope_tables(T: int, cfg: ModelConfig) -> RopeTables:
    """rope_tables of positions 0 .. T - 1 ([1, T, H / 2], broadcast over rows) as constants of
    the program, computed in float32 NumPy while it is traced (no program of their own to compile
    per width): left in the program, XLA:CPU fused the angles' cos and sin into each layer's RoPE,
    one of each per element of [B, T, N, H] rather than of [T, H / 2], in the forward and again in
    the backward."""
    angles_1xTxH2 = np.arange(T, dtype=np.float32)[None, :, None] * rope_frequencies(cfg)
    return jnp.asarray(np.cos(angles_1xTxH2)), jnp.asarray(np.sin(angles_1xTxH2))


def apply_rope(x: Float[Array, "B T N H"], rope: RopeTables) -> Float[Array, "B T N H"]:
    """Rotate-half RoPE (HF convention: the two halves of the head dim form the pairs), from the
    positions' rope_tables."""
    cos, sin = (t[:, :, None, :] for t in rope)
    x32 = x.astype(jnp.float32)
    x1, x2 = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return rotated.astype(x.dtype)


def silu(x: Float[Array, "*shape"]) -> Float[Array, "*shape"]:
    """SiLU as torch computes it: a narrow dtype's (bfloat16) in float32, rounded once (its float
    opmath; _narrow_silu), float32's as jax.nn.silu. jax.nn.silu on bfloat16 rounds the sigmoid,
    then the product: 39% of a random bfloat16 input off torch's bits, its gradient up to hundreds
    of ulps off; XLA:CPU also runs that form 1.7x slower (forward) than the float32 one."""
    if jnp.finfo(x.dtype).bits >= 32:
        return jax.nn.silu(x)
    return _narrow_silu(x)


@jax.custom_vjp
def _narrow_silu(x):
    """silu of x in float32 rounded to x's dtype; its backward torch's silu_backward (float32,
    rounded once), recomputed from x."""
    return jax.nn.silu(x.astype(jnp.float32)).astype(x.dtype)


def _silu_fwd(x):
    return _narrow_silu(x), x


def _silu_bwd(x, g):
    # the barrier keeps XLA from merging this sigmoid with the forward's and storing that float32
    # [.., F] for the backward (twice x's bytes: +5% of the learner's micro-batch temporaries)
    x32 = jax.lax.optimization_barrier(x).astype(jnp.float32)
    sigmoid = jax.nn.sigmoid(x32)
    return ((g.astype(jnp.float32) * (sigmoid * (1 + x32 * (1 - sigmoid)))).astype(x.dtype),)


_narrow_silu.defvjp(_silu_fwd, _silu_bwd)


def swiglu_mlp(x: Float[Array, "B T D"], layer: dict, accumulate: str = "output") -> Float[Array, "B T D"]:
    """`accumulate`: quant.core.ACCUMULATIONS (model/precision.py's accumulation(cfg))."""
    gate_BxTxF = dot("btd,df->btf", x, layer["gate"], accumulate=accumulate)
    up_BxTxF = dot("btd,df->btf", x, layer["up"], accumulate=accumulate)
    return dot("btf,fd->btd", silu(gate_BxTxF) * up_BxTxF, layer["down"], accumulate=accumulate)
