"""rollout/question.py: the question's eviction statistics on hand-computed cases."""

import numpy as np
import pytest

from sparserl_jax.rollout import question


class _Digits:
    """A tokenizer whose ids 10-19 are the digits 0-9 and id 99 raises (past its vocabulary)."""

    def decode(self, ids):
        (i,) = ids
        if i == 99:
            raise IndexError(i)
        return str(i - 10) if 10 <= i < 20 else "x"


def test_number_token_ids_are_the_tokens_with_a_digit():
    is_number = question.number_token_ids(_Digits(), 100)
    assert np.flatnonzero(is_number).tolist() == list(range(10, 20))


def test_question_metrics_hand_case():
    """Three responses of prompts [x, 3, +, 5] (numbers at positions 1 and 3), the last prompt
    3 tokens long (its position 3 is padding). Row 0 keeps everything; row 1 holds the number at
    position 3 in half its entries (lost: <= 0.5); row 2 holds position 1 in 0.75 (kept)."""
    is_number = question.number_token_ids(_Digits(), 100)
    tokens = np.array([[1, 13, 2, 15], [1, 13, 2, 15], [1, 13, 2, 0]])
    lengths = np.array([4, 4, 3])
    kept = np.array([[1, 1, 1, 1], [1, 1, 0.25, 0.5], [0.5, 0.75, 1, 0]])
    rewards = np.array([1.0, 0.0, 1.0])
    m = question.question_metrics(kept, tokens, lengths, is_number, rewards)
    assert m["question/evicted"] == pytest.approx((0 + 1.25 / 4 + 0.75 / 3) / 3)
    assert m["question/numbers_evicted"] == pytest.approx((0 + 0.25 + 0.25) / 3)
    assert m["question/number_lost"] == pytest.approx(1 / 3)
    assert m["question/reward_number_lost"] == 0.0
    assert m["question/reward_numbers_kept"] == 1.0


def test_question_metrics_leave_out_an_empty_group():
    is_number = question.number_token_ids(_Digits(), 100)
    tokens, lengths = np.array([[13, 1]]), np.array([2])
    whole = question.question_metrics(np.ones((1, 2)), tokens, lengths, is_number, np.ones(1))
    assert "question/reward_number_lost" not in whole and whole["question/reward_numbers_kept"] == 1.0
    gone = question.question_metrics(np.zeros((1, 2)), tokens, lengths, is_number, np.zeros(1))
    assert "question/reward_numbers_kept" not in gone and gone["question/number_lost"] == 1.0
