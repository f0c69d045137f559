"""Owns the per-iteration rollout metrics: response lengths, timing, KV kept vs dense, bubbles.
Touches nothing: pure host-side functions of a finished Rollout (no sampling, no rewards).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from sparserl_jax.rollout.sampler import cache_capacity


def kv_statistics(out, prompt_lengths: np.ndarray, kv_cfg, P: int, model_cfg, max_new: int) -> dict:
    """KV entries the sparse sampler kept vs a dense cache, per generated token, and cache bytes."""
    mask = np.asarray(out.mask)
    seen = prompt_lengths[:, None] + np.arange(mask.shape[1])[None]
    kept = float(np.sum(np.asarray(out.kept) * mask))
    dense = float(np.sum(seen * mask))
    bytes_per_slot = (
        2 * model_cfg.n_layers * model_cfg.n_kv_heads * model_cfg.head_dim * (jnp.dtype(model_cfg.dtype).itemsize)
    )
    B = mask.shape[0]
    dense_slots = cache_capacity(dataclasses.replace(kv_cfg, policy="none"), P, max_new)
    return {
        "kv/kept_mean": kept / max(mask.sum(), 1),
        "kv/dense_mean": dense / max(mask.sum(), 1),
        "kv/saving": 1.0 - kept / max(dense, 1.0),
        "kv/cache_bytes": float(B * cache_capacity(kv_cfg, P, max_new) * bytes_per_slot),
        "kv/dense_cache_bytes": float(B * dense_slots * bytes_per_slot),
        "kv/compressions": float(np.mean(np.asarray(out.n_compressions))),
        "kv/evicted_fraction": float(np.mean(np.asarray(out.evicted_fraction))),
    }


def rollout_bubble(lengths: np.ndarray, max_new_tokens: int, buffer: int) -> dict:
    """The static sampler's bubble ratio: its B rows run until the longest ends (whole chunks of
    `buffer` steps), so 1 - generated tokens / (B x steps); with every step taking the same time
    this is also SortedRL's wall-time form (the prefill, not timed apart, is left out)."""
    lengths = np.asarray(lengths)
    steps = min(-(-int(lengths.max()) // buffer) * buffer, -(-max_new_tokens // buffer) * buffer)
    bubble = 1.0 - float(lengths.sum()) / max(lengths.size * steps, 1)
    return {"rollout/bubble_slots": bubble, "rollout/bubble_wall": bubble}


def rollout_metrics(
    out, prompt_tokens: np.ndarray, prompt_lengths: np.ndarray, seconds: float, sampler_cfg, model_cfg
) -> dict:
    """response/*, time/rollout_s, throughput/rollout_tokens_per_s and kv/* of one rollout batch
    (`out` on the host; [B, P] prompt tokens and [B] prompt lengths as the sampler got them), with
    the KV cache and max_new_tokens of the SamplerConfig that sampled it."""
    kv_cfg, max_new = sampler_cfg.kv, sampler_cfg.max_new_tokens
    return {
        "response/length_mean": float(out.lengths.mean()),
        "response/truncated_fraction": float(np.mean(out.lengths >= max_new)),
        "time/rollout_s": seconds,
        "throughput/rollout_tokens_per_s": float(out.lengths.sum()) / max(seconds, 1e-9),
        **kv_statistics(out, prompt_lengths, kv_cfg, prompt_tokens.shape[1], model_cfg, max_new),
    }
