"""R-KV: SnapKV importance minus redundancy among keys, Z = lambda * I - (1 - lambda) * R."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from sparserl_jax.kvcache import scoring
from sparserl_jax.kvcache.cache import KVCache
from sparserl_jax.kvcache.config import KVConfig
from sparserl_jax.kvcache.policies.base import Policy
from sparserl_jax.kvcache.policies.snapkv import importance

NORM_EPS = 1e-8


def redundancy(kv_cfg: KVConfig, cache: KVCache, layer: int) -> Float[Array, "B K C"]:
    """R_j, per KV head over the candidate keys (filled slots outside the window):
    1. S = K_hat K_hat^T with K_hat = K / (|K| + 1e-8) (cosine similarity), diagonal zeroed,
       entries involving a non-candidate slot zeroed;
    2. in each row i, the most recent other candidate j (largest slot, i.e. latest original
       position) with S_ij > redundancy_threshold gets S_ij = 0, so the newest near-duplicate is
       not penalised by row i (rows without such a j are left alone);
    3. R_j = mean over the candidate rows i of S_ij (sum divided by the number of candidates);
    4. softmax of R over the candidate keys j.
    """
    cand_BxC = scoring.candidate_slots(cache.fill, cache.capacity, kv_cfg.window)
    k_BxKxCxH = cache.k[layer].astype(jnp.float32)
    k_hat = k_BxKxCxH / (jnp.linalg.norm(k_BxKxCxH, axis=-1, keepdims=True) + NORM_EPS)
    s_BxKxCxC = jnp.einsum("bkih,bkjh->bkij", k_hat, k_hat)
    slot_C = scoring.slots(cache.capacity)
    pair_BxCxC = (
        cand_BxC[:, :, None] & cand_BxC[:, None, :] & (slot_C[:, None] != slot_C[None, :])
    )
    s_BxKxCxC = jnp.where(pair_BxCxC[:, None], s_BxKxCxC, 0.0)
    similar = pair_BxCxC[:, None] & (s_BxKxCxC > kv_cfg.redundancy_threshold)
    newest_BxKxC = jnp.max(jnp.where(similar, slot_C, -1), axis=-1)
    s_BxKxCxC = jnp.where(slot_C == newest_BxKxC[..., None], 0.0, s_BxKxCxC)
    n_cand_B = jnp.maximum(cand_BxC.sum(axis=-1), 1).astype(jnp.float32)
    r_BxKxC = s_BxKxCxC.sum(axis=2) / n_cand_B[:, None, None]
    return scoring.masked_softmax(r_BxKxC, cand_BxC[:, None, :])


def score(kv_cfg: KVConfig, cache: KVCache, layer: int, key=None) -> Float[Array, "B K C"]:
    """Z = lambda * I - (1 - lambda) * R, with I SnapKV's pooled importance."""
    lam = kv_cfg.rkv_lambda
    return lam * importance(kv_cfg, cache, layer) - (1.0 - lam) * redundancy(kv_cfg, cache, layer)


POLICY = Policy(name="rkv", score=score, state=("window_q",))
