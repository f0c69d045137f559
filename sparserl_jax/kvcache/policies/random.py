"""Control: uniform random scores (plus the always-kept window); deterministic for a given key."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from sparserl_jax.kvcache.cache import KVCache
from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.kvcache.policies.base import Policy


def random_scores(kv_cfg: KVConfig, cache: KVCache, layer: int, key: jax.Array) -> Float[Array, "B K C"]:
    """Independent U(0, 1) scores per layer (the key folded with the layer index)."""
    return jax.random.uniform(jax.random.fold_in(key, layer), cache.pos[layer].shape, jnp.float32)


POLICY = Policy(name="random", score=random_scores, needs_key=True)
