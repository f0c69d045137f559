"""H2O (heavy hitters): keep the entries with the largest attention mass accumulated over the
prompt and every decode step so far (cache.mass, kept by the observers), plus the recent window.

The recent window is the common frame's last w keys (kv.window), not H2O's original half of the
budget, so every policy keeps the same recent entries and differs only in how it fills the rest."""

from __future__ import annotations

from jaxtyping import Array, Float

from sparserl_jax.kvcache.cache import KVCache
from sparserl_jax.kvcache.policies.base import Policy
from sparserl_jax.kvcache.policies.registry import register


def heavy_hitter_mass(kv_cfg, cache: KVCache, layer: int, key=None) -> Float[Array, "B K C"]:
    """Score = accumulated attention mass (summed over the G query heads of each KV head)."""
    return cache.mass[layer]


POLICY = register(Policy(name="h2o", score=heavy_hitter_mass, state=("mass",)))
