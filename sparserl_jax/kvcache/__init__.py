"""Fixed-slot KV cache and the eviction policies (Sparse-RL section 1.5).

The sampler's API:
  cache_for(kv_cfg, model_cfg, batch, prompt_len, dtype=None, *, capacity=None) -> KVCache
  observe_prefill(kv_cfg) -> hook or None        (model.prefill's observe_prefill=)
  observe_decode(kv_cfg) -> hook or None         (model.decode_step's observe=)
  compress(kv_cfg, cache, key=None, active=None) -> KVCache
  resize(cache, capacity) -> KVCache
  kept_positions(cache) -> per layer [B, K, C] original positions, -1 for empty slots
  position_kept(cache, n) -> [B, n] fraction of each position's (layer, KV head) entries held
"""

from __future__ import annotations

from typing import Protocol

from sparserl_jax.kvcache.cache import KVCache, init_cache, position_kept, resize
from sparserl_jax.kvcache.compress import compress, kept_positions
from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.kvcache.observe import observe_decode, observe_prefill
from sparserl_jax.kvcache.policies import POLICIES, Policy


class CacheShape(Protocol):
    """What `cache_for` reads of a model's settings (a model/config.py ModelConfig: the model
    stands above the cache and imports it, never the other way round)."""

    @property
    def n_layers(self) -> int: ...
    @property
    def n_heads(self) -> int: ...
    @property
    def n_kv_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def dtype(self) -> str: ...


def cache_for(
    kv_cfg: KVConfig,
    model_cfg: CacheShape,
    batch: int,
    prompt_len: int,
    dtype=None,
    *,
    capacity: int | None = None,
) -> KVCache:
    """An empty cache for `batch` prompts of up to `prompt_len` tokens, with the state the policy
    needs. Sparse policies get kv_cfg.capacity(prompt_len) slots unless `capacity` is given (e.g.
    a prompt-sized cache to compress at prefill, then `resize`); the dense policy needs
    `capacity` (the maximum total length). `dtype` defaults to the model's dtype."""
    if capacity is None:
        if kv_cfg.is_dense:
            raise ValueError("kv.policy='none' (dense): cache_for needs capacity= (prompt + response length)")
        capacity = kv_cfg.capacity(prompt_len)
    if capacity < prompt_len:
        raise ValueError(f"cache capacity={capacity} is smaller than prompt_len={prompt_len}")
    state = POLICIES[kv_cfg.policy].state
    return init_cache(
        batch,
        model_cfg.n_layers,
        model_cfg.n_kv_heads,
        capacity,
        model_cfg.head_dim,
        model_cfg.dtype if dtype is None else dtype,
        n_heads=model_cfg.n_heads,
        track_mass="mass" in state,
        window=kv_cfg.window if "window_q" in state else 0,
    )


__all__ = [
    "CacheShape",
    "KVCache",
    "KVConfig",
    "POLICIES",
    "Policy",
    "cache_for",
    "compress",
    "kept_positions",
    "observe_decode",
    "observe_prefill",
    "position_kept",
    "resize",
]
