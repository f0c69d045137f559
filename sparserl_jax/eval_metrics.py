"""The scores the field reports for k sampled responses per prompt: pass@k, maj@k and avg@k.

pass@k is Chen et al. (2021)'s unbiased estimator from n samples of which c are correct,
1 - C(n-c, k) / C(n, k), computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i): no binomial is formed, so
n in the thousands neither overflows nor loses precision. maj@k takes the answer most of the k
samples give (majority vote) and scores it; avg@k is the mean reward over the k samples. Each is
averaged over a benchmark's prompts. Pure functions of numbers and strings: no model, no JAX.
"""

from __future__ import annotations

from collections.abc import Sequence


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n, c of them
    correct, is correct: 1 - C(n-c, k) / C(n, k) (1.0 when n - c < k, 0.0 when c = 0)."""
    if not 1 <= k <= n:
        raise ValueError(f"pass@k: k={k} must be in [1, n={n}] (the samples drawn per prompt)")
    if not 0 <= c <= n:
        raise ValueError(f"pass@k: c={c} correct samples must be in [0, n={n}]")
    if n - c < k:
        return 1.0
    miss = 1.0  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (i - k) / i
    for i in range(n - c + 1, n + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_vote(answers: Sequence[str | None]) -> int | None:
    """The index of the sample whose answer the vote picks, None when no sample has an answer.

    `answers` are the samples' normalised final answers in sampling order (None: no answer, no
    vote). The answer given most often wins; a tie goes to the tied answer that appears first in
    sampling order (the request order, fixed by the seed), and the index returned is that
    answer's first sample."""
    count: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        count[answer] = count.get(answer, 0) + 1
        first.setdefault(answer, i)
    if not count:
        return None
    winner = max(count, key=lambda a: (count[a], -first[a]))
    return first[winner]


def avg_at_k(rewards: Sequence[float]) -> float:
    """The mean reward over a prompt's samples."""
    if not rewards:
        raise ValueError("avg@k: no rewards (k must be >= 1)")
    return sum(rewards) / len(rewards)
