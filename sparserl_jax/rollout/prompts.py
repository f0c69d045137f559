"""Owns the prompt batches the samplers get: token ids right-padded into one [B, P] array, and
the check that a run's prompts fit data.max_prompt_len. Touches nothing: host-side numpy.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

PROMPT_BUCKET = 16  # prompts are right-padded to a multiple of this (fewer recompilations)


def pad_prompt_batch(
    prompt_ids: Sequence[Sequence[int]], pad_id: int, max_prompt_len: int, *, fixed: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad to a multiple of PROMPT_BUCKET, or to max_prompt_len itself with `fixed` (one
    shape for every batch): ([B, P] tokens, [B] lengths)."""
    longest = max(len(p) for p in prompt_ids)
    if longest > max_prompt_len:
        raise ValueError(f"a prompt has {longest} tokens, more than data.max_prompt_len={max_prompt_len}")
    P = max_prompt_len if fixed else min(-(-longest // PROMPT_BUCKET) * PROMPT_BUCKET, max_prompt_len)
    tokens = np.full((len(prompt_ids), P), pad_id, np.int32)
    for i, p in enumerate(prompt_ids):
        tokens[i, : len(p)] = p
    return tokens, np.array([len(p) for p in prompt_ids], np.int32)


def check_prompt_lengths(prompts, held_out: Sequence, max_prompt_len: int) -> None:
    """Draw the first training batch (then rewind) and check it and the held-out prompts against
    data.max_prompt_len, so that a long prompt stops the run before the warm start, not after."""
    state = prompts.state_dict()
    batches = [prompts.next_batch(), held_out]
    prompts.load_state_dict(state)
    for batch in batches:
        if batch:
            pad_prompt_batch([e.prompt_ids for e in batch], 0, max_prompt_len)
