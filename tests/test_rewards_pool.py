"""Rewards at the speed of the rollout (sparserl_jax/data/reward_pool.py): the pool's rewards are
the serial ones, a hung check costs at most its time limit, each row's data_source picks its
reward, and the processes' shares of a batch (distributed.process_rows) cover every row once."""

import time

import numpy as np
import pytest
from hanging_rewards import crashing_reward, deaf_reward, sleepy_reward

from sparserl_jax import distributed
from sparserl_jax.config import load_config
from sparserl_jax.data import rewards as R
from sparserl_jax.data.reward_pool import GRACE_S, RewardChecker, RewardPoolConfig, chunks

LIMIT_S = 1.0

# (response, label, data_source): boxed answers, fractions, intervals, LaTeX, equivalent forms,
# GSM8K's "####", multiple choice, wrong and missing answers
MIX = [
    ("so \\boxed{\\frac{1}{2}}", "1/2", None),
    ("\\boxed{0.5}", "\\frac{1}{2}", "lighteval/MATH"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}", None),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", "math"),
    ("\\boxed{(0,1]}", "(0, 1]", None),
    ("\\boxed{[0,1)}", "(0,1]", None),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", None),
    ("\\boxed{\\pi/2}", "\\frac{\\pi}{2}", None),
    ("\\boxed{3}", "4", None),
    ("no final answer", "4", None),
    ("48/2 = 24 clips\n#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", "openai/gsm8k"),
    ("#### 1,234", "1234", "gsm8k"),
    ("\\boxed{72}", "72", "openai/gsm8k"),
    ("#### 71", "72", "openai/gsm8k"),
    ("The answer is (C).", "C", "multiple_choice"),
    ("\\boxed{B}", "C", "multiple_choice"),
    ("\\boxed{\\text{D}}", "(D)", "cais/mmlu"),
    ("\\boxed{10}", "10", "a source nobody registered"),
]
EXPECTED = [1, 1, 1, 1, 1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1, 0, 1, 1]


def _check(checker, rows):
    responses, labels, sources = zip(*rows)
    return checker.check(list(responses), list(labels), list(sources))


@pytest.fixture
def registered():
    """The hanging rewards registered for the test; the pool's workers receive the functions
    themselves, by reference to tests/hanging_rewards.py (light to import)."""
    R.register_reward("_test_sleepy", sleepy_reward)
    R.register_reward("_test_deaf", deaf_reward)
    yield
    del R.REWARDS["_test_sleepy"], R.REWARDS["_test_deaf"]


def test_pool_equals_serial():
    math = R.get_timed_reward("math", 5.0)
    serial, serial_late = _check(RewardChecker(math), MIX)
    assert serial.tolist() == EXPECTED and not serial_late.any()
    with RewardChecker(math, RewardPoolConfig(workers=2)) as pooled:
        for rows in (MIX, MIX[::-1] * 3, MIX[:1], []):
            rewards, late = _check(pooled, rows) if rows else pooled.check([], [], [])
            np.testing.assert_array_equal(rewards, _check(RewardChecker(math), rows)[0] if rows else [])
            assert rewards.dtype == np.float32 and not late.any()


def test_a_hung_check_costs_at_most_the_time_limit(registered):
    rows = [("a", "a", None), ("hang", "a", None), ("b", "a", None), ("a", "a", None)]
    with RewardChecker(R.get_reward("_test_sleepy"), RewardPoolConfig(workers=2, timeout_s=LIMIT_S)) as pool:
        pool.wait_ready()  # the workers are up (they load sympy first)
        start = time.monotonic()
        rewards, late = _check(pool, rows)
        elapsed = time.monotonic() - start
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0] and late.tolist() == [False, True, False, False]
    assert LIMIT_S <= elapsed < 3 * LIMIT_S


def test_a_check_deaf_to_the_alarm_is_killed(registered):
    """A check that SIGALRM cannot stop has the pool's workers killed GRACE_S (or the limit) past
    its limit; a fresh pool checks the rows left and the next batch."""
    rows = [("a", "a", None), ("b", "a", None), ("a", "a", None), ("hang", "a", None)]
    with RewardChecker(R.get_reward("_test_deaf"), RewardPoolConfig(workers=2, timeout_s=LIMIT_S)) as pool:
        pool.wait_ready()
        start = time.monotonic()
        rewards, late = _check(pool, rows)
        elapsed = time.monotonic() - start
        assert rewards.tolist() == [1.0, 0.0, 1.0, 0.0] and late.tolist() == [False, False, False, True]
        assert elapsed < LIMIT_S + max(GRACE_S, LIMIT_S) + 2 * LIMIT_S
        assert _check(pool, rows[:3] * 4)[0].tolist() == [1.0, 0.0, 1.0] * 4  # a fresh pool


def test_a_check_that_kills_its_worker_scores_zero():
    """A worker that dies mid-check (out of memory, a crash in C) costs its row; the other rows are
    checked again on a fresh pool."""
    rows = [("a", "a", None), ("crash", "a", None), ("b", "a", None), ("a", "a", None)] * 2
    with RewardChecker(crashing_reward, RewardPoolConfig(workers=2, timeout_s=LIMIT_S)) as pool:
        rewards, late = _check(pool, rows)
    assert rewards.tolist() == [1.0, 0.0, 0.0, 1.0] * 2 and late.tolist() == [False, True, False, False] * 2


def test_serial_counts_the_rewards_own_time_limit(monkeypatch):
    def hang(pred, gold):
        time.sleep(600)

    monkeypatch.setattr(R, "_symbolic_equal", hang)
    checker = RewardChecker(R.get_timed_reward("math", 0.2))
    rewards, late = checker.check(["\\boxed{\\sin(x)}", "\\boxed{4}"], ["\\cos(x)", "4"])
    assert rewards.tolist() == [0.0, 1.0] and late.tolist() == [True, False]


def test_each_row_gets_the_reward_of_its_data_source():
    rows = [
        ("\\boxed{B}", "B", None),  # the default reward (here exact boxed match)
        ("The answer is B.", "B", "multiple_choice"),
        ("#### 1,000", "1000", "openai/gsm8k"),
        ("#### 1,000", "1000", "gsm8k"),
        ("\\boxed{\\frac{1}{2}}", "0.5", "HuggingFaceH4/MATH-500"),
        ("\\boxed{\\frac{1}{2}}", "0.5", "unregistered"),
    ]
    checker = RewardChecker(R.boxed_exact_reward)
    assert _check(checker, rows)[0].tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert checker.reward_for("openai/gsm8k") is R.gsm8k_reward
    by_default = RewardChecker(R.boxed_exact_reward, RewardPoolConfig(by_source=False))
    assert _check(by_default, rows)[0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    R.register_source_reward("_test_source", "multiple_choice")
    try:
        assert _check(checker, [("answer: C", "C", "_test_source")])[0].tolist() == [1.0]
        with pytest.raises(ValueError, match=r"data_source '_test_source' already has reward 'multiple_choice'"):
            R.register_source_reward("_test_source", "math")
    finally:
        del R.SOURCE_REWARDS["_test_source"]
    with pytest.raises(ValueError, match=r"reward='nope' \(for data_source 'x'\) is not registered; accepted: \["):
        R.register_source_reward("x", "nope")
    with pytest.raises(ValueError, match=r"3 responses, 2 labels and no data_sources must be as many"):
        checker.check(["a", "b", "c"], ["a", "b"])


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7])
def test_process_shares_cover_every_row_once(count):
    for n in (0, 1, 5, 16, 1024, 1027):
        shares = [distributed.process_rows(n, p, count) for p in range(count)]
        covered = [r for s in shares for r in range(n)[s]]
        assert covered == list(range(n))
        sizes = [len(range(n)[s]) for s in shares]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match=r"process index=3 must be in \[0, process count=3\)"):
        distributed.process_rows(10, 3, 3)


def test_processes_checking_their_shares_give_the_serial_rewards():
    """What Learner.score does on P processes, each checking its share and all gathered."""
    math = R.get_timed_reward("math", 5.0)
    responses, labels, sources = (list(c) for c in zip(*MIX))
    whole = RewardChecker(math).check(responses, labels, sources)[0]
    for count in (2, 3):
        parts = []
        for p in range(count):
            mine = distributed.process_rows(len(MIX), p, count)
            parts.append(RewardChecker(math).check(responses[mine], labels[mine], sources[mine])[0])
        np.testing.assert_array_equal(np.concatenate(parts), whole)
    assert distributed.allgather_rows(whole, len(whole)) is not None  # one process: its own rows


def test_chunks_cover_the_rows_in_order():
    for n, workers in ((0, 2), (1, 2), (7, 2), (1024, 2), (1024, 8), (5, 0)):
        parts = chunks(n, workers)
        assert [r for p in parts for r in p] == list(range(n))


@pytest.mark.parametrize(
    "override, match",
    [
        ("data.reward_pool.workers=-1", r"data\.reward_pool\.workers=-1 must be >= 0"),
        ("data.reward_pool.timeout_s=0", r"data\.reward_pool\.timeout_s=0\.0 must be > 0"),
        ("data.reward_pool.by_source=maybe", r"data\.reward_pool\.by_source='maybe': expected true or false"),
    ],
)
def test_pool_settings_are_checked(override, match):
    with pytest.raises(ValueError, match=match):
        load_config([], ["data.task=null", "data.dataset=x.parquet", override])
