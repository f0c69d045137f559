"""GRPO group-relative advantages (docs/methods.md#the-objective).

Layout: the batch holds B = n_prompts * n responses, the n samples of one prompt in consecutive
rows (rows g*n .. g*n + n - 1 belong to prompt g). Keep groups whole when shuffling or splitting.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float


def grpo_advantages(
    rewards: Float[Array, " B"],
    group_size: int,
    *,
    eps: float = 1e-6,
    std_ddof: int = 1,
    scale_by_std: bool = True,
) -> Float[Array, " B"]:
    """A_i = (R_i - mean_group R) / (std_group R + eps) over groups of `group_size` consecutive
    samples. std_ddof=1 is the unbiased group std (torch.std, the authors' code); a group of one
    sample gets A = 0. scale_by_std=False gives the mean-centred variant (Dr. GRPO)."""
    B = rewards.shape[0]
    if group_size < 1 or B % group_size:
        raise ValueError(f"group_size={group_size} must be >= 1 and divide the batch of {B} rewards")
    r_GxN = rewards.astype(jnp.float32).reshape(B // group_size, group_size)
    centred_GxN = r_GxN - jnp.mean(r_GxN, axis=1, keepdims=True)
    if group_size == 1:
        return jnp.zeros((B,), jnp.float32)
    if scale_by_std:
        std_G = jnp.std(r_GxN, axis=1, ddof=std_ddof, keepdims=True)
        centred_GxN = centred_GxN / (std_G + eps)
    return centred_GxN.reshape(B)


def token_advantages(advantages: Float[Array, " B"], mask: Bool[Array, "B T"]) -> Float[Array, "B T"]:
    """Broadcast each response's advantage to its tokens (0 outside the mask)."""
    return jnp.where(mask, advantages.astype(jnp.float32)[:, None], 0.0)
