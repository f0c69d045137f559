"""SnapKV: keep the keys the last w queries attend to most (pooled), plus the window itself."""

from __future__ import annotations

from jaxtyping import Array, Float

from sparserl_jax.kvcache import scoring
from sparserl_jax.kvcache.cache import KVCache
from sparserl_jax.kvcache.policies.base import Policy
from sparserl_jax.kvcache.policies.registry import register


def importance(kv_cfg, cache: KVCache, layer: int, key=None) -> Float[Array, "B K C"]:
    """I_j, in this order (docs/methods.md#kv-compression; R-KV rkv/compression/r1_kv.py
    R1KV.update_kv and the Sparse-RL fork's sglang/compress/r1kv_utils.py
    KVCluster.get_compress_indices):
    1. logits of each of the w window queries (cache.window_q: the queries at the positions of
       the last w slots) to every candidate key j, the filled slots outside the window;
    2. kv.gqa_reduce "max_logits" (authors): max over the G query heads that share a KV head;
    3. softmax over the candidate keys only (every window query comes after every candidate, so
       no causal mask is needed; the window keys take no share of the probability);
    4. mean over the w queries; ("max_probs": steps 3-4 per query head, then the max over G);
    5. max-pool with kernel `pool_kernel`, stride 1, same padding, over the candidate slots only
       (window and empty slots neither contribute to nor receive a pooled value).
    Neighbours are neighbouring kept slots, as in SnapKV applied to an already compressed cache.
    """
    cand_BxC = scoring.candidate_slots(cache.fill, cache.capacity, kv_cfg.window)
    logits_BxKxGxWxC = scoring.attention_logits(cache.window_q[layer], cache.k[layer])
    if kv_cfg.gqa_reduce == "max_logits":
        logits_BxKxWxC = scoring.group_max(logits_BxKxGxWxC)
        p_BxKxWxC = scoring.masked_softmax(logits_BxKxWxC, cand_BxC[:, None, None, :])
        i_BxKxC = p_BxKxWxC.mean(axis=2)
    else:
        p_BxKxGxWxC = scoring.masked_softmax(logits_BxKxGxWxC, cand_BxC[:, None, None, None, :])
        i_BxKxC = scoring.group_max(p_BxKxGxWxC.mean(axis=3))
    return scoring.max_pool(i_BxKxC, cand_BxC, kv_cfg.pool_kernel)


POLICY = register(Policy(name="snapkv", score=importance, state=("window_q",)))
