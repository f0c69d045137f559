"""Compression: score the slots, keep the top B, and move the kept entries into slots [0, B).

Shared by every policy (the common frame, docs/methods.md#kv-compression): the last w keys are
always kept, empty slots never are, the top B are chosen per (layer, sequence, KV head)
("per_head") or once from layer 0's scores summed over KV heads for every layer and head
("shared"), and kept entries keep their original positions and order. Shapes are static: the
cache keeps its capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from sparserl_jax.kvcache import scoring
from sparserl_jax.kvcache.cache import KVCache, gather_slots
from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.kvcache.policies import POLICIES, Policy


def select_slots(
    score: Float[Array, "B K C"],
    valid: Bool[Array, "B C"],
    forced: Bool[Array, "B C"],
    budget: int,
    keep_B: Int[Array, " B"] | None = None,
) -> Int[Array, "B K budget"]:
    """Slots to keep, ascending (= original-position order): forced slots first, then the
    highest scores among the other filled slots; empty slots only when fewer than `budget` are
    filled (such rows are never compacted). Ties go to the lower slot (a stable sort: unlike
    lax.top_k, which XLA's partitioner gathers whole, a sort stays split over the batch).
    `keep_B` (a budget schedule's, <= budget): row b keeps only its keep_B[b] best; its other
    entries point past the cache (C) and sort last."""
    ranked = jnp.where(forced[:, None, :], jnp.inf, jnp.where(valid[:, None, :], score, -jnp.inf))
    idx = jnp.argsort(ranked, axis=-1, descending=True, stable=True)[..., :budget]
    if keep_B is not None:
        rank = jnp.arange(budget)[None, None, :]
        idx = jnp.where(rank < keep_B[:, None, None], idx, score.shape[-1])
    return jnp.sort(idx, axis=-1)


def _compact_layer(
    cache: KVCache, layer: int, idx: Int[Array, "B K budget"], do: Bool[Array, " B"], keep_B: Int[Array, " B"]
) -> tuple:
    """Gather the kept k, v, pos (and mass) of one layer into slots [0, keep) where `do`; slots
    [keep, C) of compacted rows become empty (pos -1, mass 0; k, v left as garbage)."""
    budget = idx.shape[-1]
    idx = jnp.minimum(idx, cache.capacity - 1)  # a schedule's unkept entries: garbage, then emptied
    tail_C = scoring.slots(cache.capacity)[None, None, :] >= keep_B[:, None, None]
    do4 = do[:, None, None, None]
    do3 = do[:, None, None]

    def head(x, d):
        return x.at[:, :, :budget].set(jnp.where(d, gather_slots(x, idx), x[:, :, :budget]))

    k = head(cache.k[layer], do4)
    v = head(cache.v[layer], do4)
    pos = jnp.where(do3 & tail_C, -1, head(cache.pos[layer], do3))
    mass = None
    if cache.mass is not None:
        mass = jnp.where(do3 & tail_C, 0.0, head(cache.mass[layer], do3))
    return k, v, pos, mass


def compress(
    kv_cfg: KVConfig,
    cache: KVCache,
    key: jax.Array | None = None,
    active: Bool[Array, " B"] | None = None,
) -> KVCache:
    """Keep `budget` entries (a budget schedule's for the tokens each sequence has seen:
    kv_cfg.budget_at) of every sequence that is `active` (default: all) and holds more; fill
    becomes that. Other sequences are returned unchanged, and so is the whole cache for the dense
    policy. `key` is needed by the random policy only."""
    policy: Policy = POLICIES[kv_cfg.policy]
    if policy.score is None:
        return cache
    if policy.needs_key and key is None:
        raise ValueError(f"kv.policy={kv_cfg.policy!r} needs a jax random key in compress()")
    B, C, budget, window = cache.fill.shape[0], cache.capacity, kv_cfg.budget, kv_cfg.window
    if budget >= C:
        return cache  # nothing can exceed the budget
    keep_B = kv_cfg.budget_at(cache.length).astype(cache.fill.dtype)
    do_B = cache.fill > keep_B
    keep_rows = keep_B if kv_cfg.budget_schedule else None
    if active is not None:
        do_B = do_B & active
    valid_BxC = scoring.valid_slots(cache.fill, C)
    forced_BxC = scoring.window_slots(cache.fill, C, window)
    if policy.forced is not None:
        forced_BxC = forced_BxC | (policy.forced(kv_cfg, cache) & valid_BxC)

    def layer_score(layer):
        return policy.score(kv_cfg, cache, layer, key).astype(jnp.float32)

    if kv_cfg.selection == "shared":
        score_Bx1xC = layer_score(0).sum(axis=1, keepdims=True)
        idx = select_slots(score_Bx1xC, valid_BxC, forced_BxC, budget, keep_rows)
        K = cache.k[0].shape[1]
        idx_per_layer = [jnp.broadcast_to(idx, (B, K, budget))] * cache.n_layers
    else:
        idx_per_layer = [
            select_slots(layer_score(i), valid_BxC, forced_BxC, budget, keep_rows) for i in range(cache.n_layers)
        ]
    k, v, pos, mass = zip(*(_compact_layer(cache, i, idx, do_B, keep_B) for i, idx in enumerate(idx_per_layer)))
    return cache.replace(
        k=tuple(k),
        v=tuple(v),
        pos=tuple(pos),
        mass=tuple(mass) if cache.mass is not None else None,
        fill=jnp.where(do_B, keep_B, cache.fill).astype(cache.fill.dtype),
    )


def kept_positions(cache: KVCache) -> tuple[Int[Array, "B K C"], ...]:
    """Per layer, the original position held by each slot, -1 for empty slots."""
    valid_Bx1xC = scoring.valid_slots(cache.fill, cache.capacity)[:, None, :]
    return tuple(jnp.where(valid_Bx1xC, p, -1) for p in cache.pos)
