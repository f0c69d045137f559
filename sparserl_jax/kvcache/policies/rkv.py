"""R-KV: SnapKV importance minus redundancy among keys, Z = lambda * I - (1 - lambda) * R
(R-KV rkv/compression/r1_kv.py R1KV.update_kv; the Sparse-RL fork's KVCluster "RKV")."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Float

from sparserl_jax.kvcache import scoring
from sparserl_jax.kvcache.cache import KVCache
from sparserl_jax.kvcache.policies.base import Policy
from sparserl_jax.kvcache.policies.registry import register
from sparserl_jax.kvcache.policies.snapkv import importance

NORM_EPS = 1e-8


def redundancy(kv_cfg, cache: KVCache, layer: int) -> Float[Array, "B K C"]:
    """R_j per KV head (R-KV rkv/utils.py cal_similarity with retain_direction "last"), over the
    keys kv.rkv_redundancy picks: every filled slot ("all_keys", the original) or the candidates
    (filled slots outside the window, "candidates"):
    1. S = K_hat K_hat^T with K_hat = K / (|K| + 1e-8) (cosine similarity), diagonal zeroed,
       entries involving a key outside the set zeroed;
    2. in each row i, the most recent other key j (largest slot, i.e. latest original position)
       with S_ij > redundancy_threshold gets S_ij = 0, so the newest near-duplicate is not
       penalised by row i. Rows without such a j: "all_keys" zeroes S_i0 (the original's search
       returns index 0), "candidates" leaves the row alone;
    3. R_j = mean over the rows i of the set of S_ij (sum divided by the size of the set);
    4. softmax of R over the set; compress reads it on the candidates only.
    """
    C = cache.capacity
    if kv_cfg.rkv_redundancy == "all_keys":
        over_BxC = scoring.valid_slots(cache.fill, C)
    else:
        over_BxC = scoring.candidate_slots(cache.fill, C, kv_cfg.window)
    k_BxKxCxH = cache.k[layer].astype(jnp.float32)
    k_hat = k_BxKxCxH / (jnp.linalg.norm(k_BxKxCxH, axis=-1, keepdims=True) + NORM_EPS)
    s_BxKxCxC = jnp.einsum("bkih,bkjh->bkij", k_hat, k_hat)
    slot_C = scoring.slots(C)
    pair_BxCxC = over_BxC[:, :, None] & over_BxC[:, None, :] & (slot_C[:, None] != slot_C[None, :])
    s_BxKxCxC = jnp.where(pair_BxCxC[:, None], s_BxKxCxC, 0.0)
    similar = pair_BxCxC[:, None] & (s_BxKxCxC > kv_cfg.redundancy_threshold)
    none_found = 0 if kv_cfg.rkv_redundancy == "all_keys" else -1
    newest_BxKxC = jnp.max(jnp.where(similar, slot_C, none_found), axis=-1)
    s_BxKxCxC = jnp.where(slot_C == newest_BxKxC[..., None], 0.0, s_BxKxCxC)
    n_over_B = jnp.maximum(over_BxC.sum(axis=-1), 1).astype(jnp.float32)
    r_BxKxC = s_BxKxCxC.sum(axis=2) / n_over_B[:, None, None]
    return scoring.masked_softmax(r_BxKxC, over_BxC[:, None, :])


def score(kv_cfg, cache: KVCache, layer: int, key=None) -> Float[Array, "B K C"]:
    """Z = lambda * I - (1 - lambda) * R, with I SnapKV's pooled importance."""
    lam = kv_cfg.rkv_lambda
    return lam * importance(kv_cfg, cache, layer) - (1.0 - lam) * redundancy(kv_cfg, cache, layer)


POLICY = register(Policy(name="rkv", score=score, state=("window_q",)))
