"""pass@k, maj@k and avg@k (sparserl_jax/eval_metrics.py) on hand-computed cases: the unbiased
estimator against its binomial form, its edges, and the vote's tie rule. No JAX: milliseconds."""

from math import comb

import pytest

from sparserl_jax.eval_metrics import avg_at_k, majority_vote, pass_at_k


def test_pass_at_k_hand_case():
    # n=5 samples, c=2 correct, k=2: 1 - C(3, 2) / C(5, 2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-12)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-12)  # pass@1 = c / n


@pytest.mark.parametrize("n", [1, 2, 5, 16, 40])
def test_pass_at_k_is_the_binomial_form(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            exact = 1.0 - comb(n - c, k) / comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)


def test_pass_at_k_edges():
    assert pass_at_k(8, 0, 1) == 0.0 and pass_at_k(8, 0, 8) == 0.0  # nothing correct
    assert pass_at_k(5, 4, 2) == 1.0  # n - c = 1 < k: every draw of 2 holds a correct one
    assert pass_at_k(5, 1, 5) == 1.0  # k = n: any correct sample is drawn
    assert pass_at_k(3, 3, 1) == 1.0
    big = pass_at_k(2000, 3, 100)  # no overflow, no lost precision
    assert big == pytest.approx(1.0 - comb(1997, 100) / comb(2000, 100), rel=1e-9)


@pytest.mark.parametrize(
    "n,c,k,match",
    [(5, 2, 0, r"k=0 must be in \[1, n=5\]"), (5, 2, 6, "k=6"), (5, 6, 1, "c=6"), (5, -1, 1, "c=-1")],
)
def test_pass_at_k_refuses_impossible_counts(n, c, k, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(n, c, k)


def test_majority_vote_most_common_answer_wins():
    assert majority_vote(["3", "4", "4", None, "3", "4"]) == 1  # "4": 3 votes; its first sample
    assert majority_vote([None, "7"]) == 1  # no answer casts no vote
    assert majority_vote([None, None]) is None and majority_vote([]) is None


def test_majority_vote_tie_goes_to_the_answer_seen_first():
    # "5" and "2" both have 2 votes: "5" appears first (sample 1), so it wins
    assert majority_vote([None, "5", "2", "2", "5"]) == 1
    assert majority_vote(["2", "5", "5", "2"]) == 0
    assert majority_vote(["a", "b", "c"]) == 0  # all tied at one vote


def test_avg_at_k():
    assert avg_at_k([1.0, 0.0, 1.0, 0.0]) == 0.5
    with pytest.raises(ValueError, match="avg@k"):
        avg_at_k([])
