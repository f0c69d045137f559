"""Reference (pure jnp) single-query attention over a slot cache: the spec the Pallas kernels meet."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


def decode_attention_ref(
    q: Float[Array, "B N H"],
    k: Float[Array, "B K C H"],
    v: Float[Array, "B K C H"],
    fill: Int[Array, " B"],
    scale: float | None = None,
) -> tuple[Float[Array, "B N H"], Float[Array, "B N"]]:
    """Attention of one query per sequence to slots [0, fill[b]) of its cache.

    Query head n reads KV head n // G (grouped-query attention). Scores, softmax and the
    weighted sum accumulate in float32. Returns the output (in q's dtype) and the float32
    log-sum-exp of the scaled scores, from which per-slot probabilities can be recovered
    (p = exp(score - lse)), e.g. for H2O's accumulated attention.
    """
    B, N, H = q.shape
    K, C = k.shape[1], k.shape[2]
    G = N // K
    scale = H**-0.5 if scale is None else scale
    q_BxKxGxH = q.reshape(B, K, G, H)
    s_BxKxGxC = jnp.einsum("bkgh,bkch->bkgc", q_BxKxGxH, k, preferred_element_type=jnp.float32) * scale
    valid_BxC = jnp.arange(C)[None, :] < fill[:, None]
    s_BxKxGxC = jnp.where(valid_BxC[:, None, None, :], s_BxKxGxC, -jnp.inf)
    lse_BxKxG = jax.nn.logsumexp(s_BxKxGxC, axis=-1)
    p_BxKxGxC = jnp.exp(s_BxKxGxC - lse_BxKxG[..., None])
    o_BxKxGxH = jnp.einsum("bkgc,bkch->bkgh", p_BxKxGxC, v.astype(jnp.float32), preferred_element_type=jnp.float32)
    return o_BxKxGxH.reshape(B, N, H).astype(q.dtype), lse_BxKxG.reshape(B, N)
