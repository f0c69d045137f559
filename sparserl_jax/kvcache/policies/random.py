"""Control: uniform random scores (plus the always-kept window); deterministic for a given key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sparserl_jax.kvcache.cache import KVCache
from sparserl_jax.kvcache.policies.base import Policy
from sparserl_jax.kvcache.policies.registry import register


def random_scores(kv_cfg, cache: KVCache, layer: int, key: jax.Array) -> Float[Array, "B K C"]:
    """Independent U(0, 1) scores per layer (the key folded with the layer index). `key` is one
    key for the whole batch, or a [B] array of keys, one per sequence (the sampler's per-request
    keys: a sequence's scores then do not depend on the other rows of its batch)."""
    shape = cache.pos[layer].shape
    if key.ndim == 1:
        draw = lambda k: jax.random.uniform(jax.random.fold_in(k, layer), shape[1:], jnp.float32)  # noqa: E731
        return jax.vmap(draw)(key)
    return jax.random.uniform(jax.random.fold_in(key, layer), shape, jnp.float32)


POLICY = register(Policy(name="random", score=random_scores, needs_key=True))
