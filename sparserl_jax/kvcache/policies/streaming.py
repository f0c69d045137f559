"""StreamingLLM: keep the first n_sinks entries by original position (attention sinks) and the
most recent ones.

Kept keys keep their original RoPE positions, as in the Sparse-RL fork's "streamingllm"
(sglang/compress/r1kv_utils.py KVCluster: first_tokens + the last budget - first_tokens entries
of the rotated cache), R-KV, SnapKV and kvpress. The original StreamingLLM
(mit-han-lab/streaming-llm, pos_shift) instead re-rotates cached keys to their in-cache
positions; that is not offered (see docs/implementation.md, "Method: as the authors run it")."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from sparserl_jax.kvcache import scoring
from sparserl_jax.kvcache.cache import KVCache
from sparserl_jax.kvcache.policies.base import Policy
from sparserl_jax.kvcache.policies.registry import register


def recency(kv_cfg, cache: KVCache, layer: int, key=None) -> Float[Array, "B K C"]:
    """Score = original position: the most recent entries win."""
    return cache.pos[layer].astype(jnp.float32)


def sinks(kv_cfg, cache: KVCache) -> Bool[Array, "B C"]:
    """The first n_sinks slots hold the n_sinks smallest original positions (slots are in
    position order and sinks are never evicted)."""
    B = cache.fill.shape[0]
    sink_C = scoring.slots(cache.capacity) < kv_cfg.n_sinks
    return jnp.broadcast_to(sink_C[None, :], (B, cache.capacity))


POLICY = register(Policy(name="streaming", score=recency, forced=sinks))
