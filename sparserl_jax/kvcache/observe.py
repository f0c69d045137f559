"""Observers that keep the eviction state up to date while the model runs.

- mass (H2O): attention each key has received, summed over the G query heads of its KV head,
  over the prompt (causal column sums) and every decode step.
- window_q (SnapKV, R-KV): the last w queries, in a ring indexed by position % w, so at any time
  it holds the queries at the positions of the last w keys.

`observe_decode(kv_cfg)` / `observe_prefill(kv_cfg)` return the hooks the model's decode_step /
prefill take (None when the policy keeps no state).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from sparserl_jax.kvcache import scoring
from sparserl_jax.kvcache.cache import KVCache
from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.kvcache.policies import POLICIES

PROMPT_QUERY_CHUNK = 256


def _set_layer(xs: tuple, layer: int, x) -> tuple:
    return tuple(x if i == layer else old for i, old in enumerate(xs))


# ----------------------------------------------------------------------------- decode


def accumulate_mass(cache: KVCache, layer: int, q: Float[Array, "B N H"], lse: Float[Array, "B N"]) -> KVCache:
    """H2O: add this step's attention probs exp(q.k / sqrt(H) - lse) over slots [0, fill + 1)
    (the new token is in slot fill), summed over the G query heads of each KV head. The new
    slot starts from zero whatever it held before."""
    B, N, _ = q.shape
    K, C = cache.k[layer].shape[1], cache.capacity
    logits_BxKxGxC = scoring.attention_logits(q[:, :, None, :], cache.k[layer])[:, :, :, 0]
    p_BxKxGxC = jnp.exp(logits_BxKxGxC - lse.reshape(B, K, N // K)[..., None])
    seen_BxC = scoring.valid_slots(cache.fill + 1, C)
    p_BxKxC = jnp.where(seen_BxC[:, None, :], p_BxKxGxC.sum(axis=2), 0.0)
    old_BxKxC = jnp.where(scoring.valid_slots(cache.fill, C)[:, None, :], cache.mass[layer], 0.0)
    return cache.replace(mass=_set_layer(cache.mass, layer, old_BxKxC + p_BxKxC))


def record_window_query(cache: KVCache, layer: int, q: Float[Array, "B N H"], lse=None) -> KVCache:
    """SnapKV/R-KV: store this step's query (position `length`) in ring slot length % w."""
    W = cache.window_q[layer].shape[2]
    b = jnp.arange(q.shape[0])
    wq = cache.window_q[layer]
    wq = wq.at[b, :, cache.length % W].set(q.astype(wq.dtype))
    return cache.replace(window_q=_set_layer(cache.window_q, layer, wq))


# ----------------------------------------------------------------------------- prefill


def prompt_mass(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    lengths: Int[Array, " B"],
    chunk: int = PROMPT_QUERY_CHUNK,
) -> Float[Array, "B K T"]:
    """H2O's mass after the prompt: for key j, the sum over real queries i >= j of the causal
    attention prob p_ij, summed over the G query heads of each KV head. Queries are processed
    `chunk` at a time, so no [B, N, T, T] array is formed; padded queries and keys are excluded."""
    B, T = q.shape[:2]
    chunk = min(chunk, T)
    n_chunks = -(-T // chunk)
    pad = n_chunks * chunk - T
    q_BxNxTxH = jnp.swapaxes(jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0))), 1, 2)
    k_BxKxTxH = jnp.swapaxes(k, 1, 2)
    key_T = jnp.arange(T)

    def one_chunk(mass_BxKxT, start):
        q_c = jax.lax.dynamic_slice_in_dim(q_BxNxTxH, start, chunk, axis=2)
        logits_BxKxGxcxT = scoring.attention_logits(q_c, k_BxKxTxH)
        query_c = start + jnp.arange(chunk)
        causal_cxT = key_T[None, :] <= query_c[:, None]
        real_Bxc = query_c[None, :] < lengths[:, None]
        mask = causal_cxT[None, None, None] & real_Bxc[:, None, None, :, None]
        p = scoring.masked_softmax(logits_BxKxGxcxT, mask)
        return mass_BxKxT + p.sum(axis=(2, 3)), None

    starts = jnp.arange(n_chunks) * chunk
    init = jnp.zeros((B, k.shape[2], T), jnp.float32)
    mass_BxKxT, _ = jax.lax.scan(one_chunk, init, starts)
    return mass_BxKxT


def prompt_window_queries(
    q: Float[Array, "B T N H"], lengths: Int[Array, " B"], window: int
) -> Float[Array, "B N W H"]:
    """The last w real prompt queries of each sequence, ring slot r holding the position p in
    [length - w, length) with p % w == r (zeros for p < 0, i.e. prompts shorter than w)."""
    r_W = jnp.arange(window)
    start_B = lengths - window
    p_BxW = start_B[:, None] + (r_W[None, :] - start_B[:, None]) % window
    picked_BxWxNxH = jnp.take_along_axis(q, jnp.maximum(p_BxW, 0)[:, :, None, None], axis=1)
    picked_BxWxNxH = jnp.where((p_BxW >= 0)[:, :, None, None], picked_BxWxNxH, 0)
    return jnp.swapaxes(picked_BxWxNxH, 1, 2)


def init_mass_from_prompt(cache: KVCache, qs, ks, lengths) -> KVCache:
    T, C = ks[0].shape[1], cache.capacity
    mass = tuple(jnp.pad(prompt_mass(q, k, lengths), ((0, 0), (0, 0), (0, C - T))) for q, k in zip(qs, ks))
    return cache.replace(mass=mass)


def init_window_from_prompt(cache: KVCache, qs, ks, lengths) -> KVCache:
    W = cache.window_q[0].shape[2]
    window_q = tuple(prompt_window_queries(q, lengths, W).astype(old.dtype) for q, old in zip(qs, cache.window_q))
    return cache.replace(window_q=window_q)


# ----------------------------------------------------------------------------- hooks

_DECODE = {"mass": accumulate_mass, "window_q": record_window_query}
_PREFILL = {"mass": init_mass_from_prompt, "window_q": init_window_from_prompt}


def _chain(fns):
    if not fns:
        return None

    def run(cache, *args):
        for fn in fns:
            cache = fn(cache, *args)
        return cache

    return run


def observe_decode(kv_cfg: KVConfig) -> Callable[..., KVCache] | None:
    """decode_step's `observe(cache, layer, q[B,N,H], lse[B,N]) -> cache` for this policy."""
    return _chain([_DECODE[s] for s in POLICIES[kv_cfg.policy].state])


def observe_prefill(kv_cfg: KVConfig) -> Callable[..., KVCache] | None:
    """prefill's `observe_prefill(cache, qs, ks, lengths) -> cache` for this policy."""
    return _chain([_PREFILL[s] for s in POLICIES[kv_cfg.policy].state])
