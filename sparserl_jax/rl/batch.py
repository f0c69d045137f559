"""The rollout batch the update step consumes, and how its per-token arrays line up.

A batch is a dict of arrays, one row per response (B rows; GRPO groups in consecutive rows):

  tokens        int32   [B, T]  prompt then response, contiguous, right-padded
  response_mask bool    [B, T]  True at position t iff tokens[t + 1] is a response token
  advantages    float32 [B]     one advantage per response (broadcast to its tokens)
  sampler_logp  float32 [B, T]  log pi_sparse(tokens[t + 1] | tokens[:t + 1]) recorded by the sampler
  old_logp      float32 [B, T]  log pi_old of the same token (teacher-forced, theta_old)
  ref_logp      float32 [B, T]  log pi_ref of the same token (teacher-forced, initial weights)
  kept_ids      int32 [B, T, K] optional: the sampler's kept set for that token (top-k / top-p,
                                -1 padded and outside the response); every log-prob above is then
                                renormalised over it (rollout/sampling.py sample_kept)
  top_ids       int32 [B, T, A] optional: the sampler's A most probable tokens at that position
  top_logp      float32 [B, T, A]  and their log-probs under its distribution (-1 / 0 where none):
                                the sparse-dense agreement's support (rl/diagnostics.py)

Every [B, T] array follows model.transformer.token_logprobs: position t scores tokens[t + 1].
For a prompt of length P and a response of length M the mask is True at t = P - 1 .. P + M - 2
(the EOS token included when the response has one). Values outside the mask are ignored.
"""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

TOKEN_KEYS = ("tokens", "response_mask", "sampler_logp", "old_logp", "ref_logp")
BATCH_KEYS = TOKEN_KEYS + ("advantages",)


def response_mask_from_lengths(
    prompt_lengths: Int[Array, " B"], total_lengths: Int[Array, " B"], T: int
) -> Bool[Array, "B T"]:
    """Mask of positions whose next token is a response token: prompt_len - 1 <= t < total - 1."""
    t_BxT = jnp.arange(T)[None, :]
    return (t_BxT >= prompt_lengths[:, None] - 1) & (t_BxT < total_lengths[:, None] - 1)


def assemble(
    prompts: Int[Array, "B P"],
    prompt_lengths: Int[Array, " B"],
    response_tokens: Int[Array, "B M"],
    response_logp: Float[Array, "B M"],
    response_mask: Bool[Array, "B M"],
    *,
    pad_token_id: int = 0,
    response_kept_ids: Int[Array, "B M K"] | None = None,
    response_top: tuple[Int[Array, "B M A"], Float[Array, "B M A"]] | None = None,
) -> dict[str, Array]:
    """Pack right-padded prompts and the sampler's responses (a prefix of valid tokens per row, as
    rollout.sampler.Rollout holds them) into `tokens`, `response_mask` and `sampler_logp` of
    width T = P + M, aligned as above (and `kept_ids` from the responses' kept sets, `top_ids` and
    `top_logp` from their top candidates)."""
    B, P = prompts.shape
    M = response_tokens.shape[1]
    T = P + M
    t_BxT = jnp.broadcast_to(jnp.arange(T)[None, :], (B, T))
    plen_Bx1 = prompt_lengths[:, None].astype(jnp.int32)
    n_resp_Bx1 = jnp.sum(response_mask, axis=1, keepdims=True).astype(jnp.int32)

    j_BxT = t_BxT - plen_Bx1  # response index of the token at position t
    in_resp = (j_BxT >= 0) & (j_BxT < n_resp_Bx1)
    resp_at = jnp.take_along_axis(response_tokens, jnp.clip(j_BxT, 0, M - 1), axis=1)
    prompt_at = jnp.take_along_axis(prompts, jnp.clip(t_BxT, 0, P - 1), axis=1)
    tokens = jnp.where(t_BxT < plen_Bx1, prompt_at, jnp.where(in_resp, resp_at, pad_token_id))

    jn_BxT = j_BxT + 1  # response index of the token that position t scores
    scores_resp = (jn_BxT >= 0) & (jn_BxT < n_resp_Bx1)
    logp_at = jnp.take_along_axis(response_logp, jnp.clip(jn_BxT, 0, M - 1), axis=1)
    out = {
        "tokens": tokens.astype(jnp.int32),
        "response_mask": scores_resp,
        "sampler_logp": jnp.where(scores_resp, logp_at, 0.0).astype(jnp.float32),
    }
    at = lambda x: jnp.take_along_axis(x, jnp.clip(jn_BxT, 0, M - 1)[:, :, None], axis=1)  # noqa: E731
    if response_kept_ids is not None:
        out["kept_ids"] = jnp.where(scores_resp[:, :, None], at(response_kept_ids), -1).astype(jnp.int32)
    if response_top is not None:
        out["top_ids"] = jnp.where(scores_resp[:, :, None], at(response_top[0]), -1).astype(jnp.int32)
        out["top_logp"] = jnp.where(scores_resp[:, :, None], at(response_top[1]), 0.0).astype(jnp.float32)
    return out


def check_batch(batch: dict) -> tuple[int, int]:
    """Check keys and shapes; return (B, T)."""
    missing = [k for k in BATCH_KEYS if k not in batch]
    if missing:
        raise ValueError(f"batch is missing keys {missing}; expected {BATCH_KEYS}")
    B, T = batch["tokens"].shape
    for k in TOKEN_KEYS:
        if batch[k].shape != (B, T):
            raise ValueError(f"batch[{k!r}] has shape {batch[k].shape}, expected {(B, T)}")
    if "kept_ids" in batch and batch["kept_ids"].shape[:2] != (B, T):
        raise ValueError(f"batch['kept_ids'] has shape {batch['kept_ids'].shape}, expected {(B, T)} + (K,)")
    if batch["advantages"].shape != (B,):
        raise ValueError(f"batch['advantages'] has shape {batch['advantages'].shape}, expected {(B,)}")
    return B, T
