"""Pieces every eviction score is built from, written once: which slots are candidates, scaled
attention logits with grouped-query heads, a masked float32 softmax, the max over the G query
heads that share a KV head, and SnapKV's 1-D max-pool.

Slot order is original-position order (prefill writes in order, decode appends, compression keeps
the order), so "the last w keys" are the last w filled slots and neighbouring slots are
neighbouring kept tokens.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int


def slots(capacity: int) -> Int[Array, " C"]:
    return jnp.arange(capacity, dtype=jnp.int32)


def valid_slots(fill: Int[Array, " B"], capacity: int) -> Bool[Array, "B C"]:
    """Filled slots [0, fill)."""
    return slots(capacity)[None, :] < fill[:, None]


def window_slots(fill: Int[Array, " B"], capacity: int, window: int) -> Bool[Array, "B C"]:
    """The last w filled slots [fill - w, fill): the observation window, always kept."""
    c = slots(capacity)[None, :]
    return (c < fill[:, None]) & (c >= fill[:, None] - window)


def candidate_slots(fill: Int[Array, " B"], capacity: int, window: int) -> Bool[Array, "B C"]:
    """Filled slots outside the window [0, fill - w): the entries a policy scores."""
    return slots(capacity)[None, :] < (fill - window)[:, None]


def attention_logits(q: Float[Array, "B N T H"], k: Float[Array, "B K S H"]) -> Float[Array, "B K G T S"]:
    """Scaled scores q.k / sqrt(H) in float32; query head n reads KV head n // G."""
    B, N, T, H = q.shape
    K = k.shape[1]
    q_BxKxGxTxH = q.reshape(B, K, N // K, T, H)
    return jnp.einsum("bkgth,bksh->bkgts", q_BxKxGxTxH, k, preferred_element_type=jnp.float32) * (H**-0.5)


def masked_softmax(x: Float[Array, ...], mask: Bool[Array, ...], axis: int = -1):
    """Float32 softmax over the entries where `mask` holds; 0 elsewhere (and for empty rows)."""
    x = jnp.where(mask, x.astype(jnp.float32), -jnp.inf)
    m = jnp.max(x, axis=axis, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    e = jnp.where(mask, jnp.exp(x - m), 0.0)
    total = jnp.sum(e, axis=axis, keepdims=True)
    return e / jnp.where(total > 0, total, 1.0)


def group_max(x: Float[Array, "B K G ..."]) -> Float[Array, "B K ..."]:
    """GQA: a KV head's score is the max over the G query heads that read it (axis 2)."""
    return jnp.max(x, axis=2)


def max_pool(x: Float[Array, "B K C"], mask: Bool[Array, "B C"], kernel: int) -> Float[Array, "B K C"]:
    """1-D max-pool over the slot axis (stride 1, same padding) among the `mask` slots only.

    Slots outside the mask neither contribute nor receive a value (they read 0), so pooling the
    candidates [0, fill - w) equals pooling the non-window prefix on its own, as SnapKV does.
    """
    x = jnp.where(mask[:, None, :], x, -jnp.inf)
    half = kernel // 2
    pooled = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 1, kernel), (1, 1, 1), ((0, 0), (0, 0), (half, half)))
    return jnp.where(mask[:, None, :], pooled, 0.0)
