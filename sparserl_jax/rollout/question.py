"""Owns the question's eviction statistics: how much of each response's prompt the sparse cache
had evicted by the response's end, whether the numbers of the question were among what it lost,
and the reward of the responses that lost one against those that kept them all.

Why: a sparse sampler whose cache compresses the prompt (kv.compress_prompt) can evict the very
tokens a task's answer needs (an arithmetic question's operands). The logged KV saving alone
cannot show that, and it falls as answers shorten (the dense cache shrinks with them); these
metrics read the question itself. Host-side functions of a finished rollout
(Rollout.prompt_kept, sampler.record_prompt_kept) and its rewards; they touch no device.

A number token is a prompt token whose text holds a digit (`number_token_ids`). A response's
question "lost a number" when some number token has at most half of its (layer, KV head) entries
left (`LOST_AT`): per-head selection keeps a token in some heads and not others, and a token
evicted from most of them is mostly gone from what the response attends to.
"""

from __future__ import annotations

import numpy as np

LOST_AT = 0.5  # a number token held in at most this fraction of its entries counts as lost


def number_token_ids(tokenizer, vocab_size: int) -> np.ndarray:
    """[V] bool: token ids whose decoded text contains a digit (the question's numbers)."""
    is_number = np.zeros(vocab_size, bool)
    for i in range(vocab_size):
        try:
            text = tokenizer.decode([i])
        except Exception:  # ids past the tokenizer's own vocabulary (a padded embedding)
            continue
        is_number[i] = any(c.isdigit() for c in text)
    return is_number


def question_metrics(
    prompt_kept_BxP: np.ndarray,
    prompt_tokens_BxP: np.ndarray,
    prompt_lengths_B: np.ndarray,
    is_number_V: np.ndarray,
    rewards_B: np.ndarray,
) -> dict:
    """question/* of one rollout batch: the mean fraction of the question's entries evicted at
    each response's end (`evicted`) and of its number tokens' entries (`numbers_evicted`), the
    fraction of responses whose question lost a number (`number_lost`), and the mean reward of
    those (`reward_number_lost`) and of the rest (`reward_numbers_kept`), each logged only when
    its group is not empty."""
    kept = np.asarray(prompt_kept_BxP, np.float64)
    tokens = np.asarray(prompt_tokens_BxP)
    B, P = kept.shape
    real_BxP = np.arange(P)[None, :] < np.asarray(prompt_lengths_B)[:, None]
    number_BxP = real_BxP & is_number_V[np.clip(tokens, 0, is_number_V.size - 1)]
    evicted_B = 1.0 - np.sum(kept * real_BxP, axis=1) / np.maximum(real_BxP.sum(axis=1), 1)
    n_numbers_B = number_BxP.sum(axis=1)
    numbers_evicted_B = 1.0 - np.sum(kept * number_BxP, axis=1) / np.maximum(n_numbers_B, 1)
    lost_B = np.any(number_BxP & (kept <= LOST_AT), axis=1)
    rewards_B = np.asarray(rewards_B, np.float64)
    metrics = {
        "question/evicted": float(evicted_B.mean()),
        "question/numbers_evicted": float(numbers_evicted_B[n_numbers_B > 0].mean()) if n_numbers_B.any() else 0.0,
        "question/number_lost": float(lost_B.mean()),
    }
    if lost_B.any():
        metrics["question/reward_number_lost"] = float(rewards_B[lost_B].mean())
    if not lost_B.all():
        metrics["question/reward_numbers_kept"] = float(rewards_B[~lost_B].mean())
    return metrics
