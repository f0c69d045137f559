"""Tests of sparserl_jax/data/rewards.py: answer extraction, equivalence, time limits, registry."""

import re
import signal
import threading
import time

import pytest

from sparserl_jax.data import rewards as R

# ---------------------------------------------------------------- extraction


@pytest.mark.parametrize(
    "text, expected",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{\\frac{\\sqrt{a^{2}}}{2}} done", "\\frac{\\sqrt{a^{2}}}{2}"),
        ("first \\boxed{1}, then \\boxed{2}", "2"),
        ("x \\fbox{7} y", "7"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed {3}", "3"),
        ("$\\boxed 5$", "5"),
        ("\\boxed{ 12 }", "12"),
        ("no answer here", None),
        ("\\boxed{1} and then \\boxed{2", None),  # the last box never closes: truncated response
        ("\\boxedfoo{3}", None),
    ],
)
def test_extract_boxed(text, expected):
    assert R.extract_boxed(text) == expected


def test_extract_gsm8k_and_answer_priority():
    assert R.extract_gsm8k("48/2 = 24\n#### 72") == "72"
    assert R.extract_gsm8k("#### 1,234.\n") == "1234"
    assert R.extract_gsm8k("#### 3\nmore\n#### -5") == "-5"
    assert R.extract_gsm8k("no marker") is None
    # \boxed wins over ####; #### is the fallback
    assert R.extract_answer("#### 3 \\boxed{4}") == "4"
    assert R.extract_answer("#### 3") == "3"
    assert R.label_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert R.label_answer("so $x=\\boxed{\\frac{3}{4}}$") == "\\frac{3}{4}"
    assert R.label_answer(" 18 ") == "18"


def test_normalize_answer():
    assert R.normalize_answer("\\dfrac{1}{2}") == R.normalize_answer("\\frac{1}{2}")
    assert R.normalize_answer("1,234") == "1234"
    assert R.normalize_answer("72.00") == "72"
    assert R.normalize_answer("\\left( 1, 2 \\right)") == "(1,2)"
    assert R.normalize_answer("\\text{ cat }") == "cat"
    assert R.normalize_answer("3") != R.normalize_answer("4")
    assert R.normalize_answer("\\rightarrow") != R.normalize_answer("arrow")


# ---------------------------------------------------------------- equivalence


@pytest.mark.parametrize(
    "pred, label",
    [
        ("1/2", "0.5"),
        ("0.5", "\\frac{1}{2}"),
        ("\\frac12", "\\dfrac{1}{2}"),
        ("x*2", "2x"),
        ("2 \\cdot x", "2x"),
        ("1234", "1,234"),
        ("72.0", "72"),
        ("\\frac{\\sqrt{2}}{2}", "\\sqrt{2}/2"),
        ("\\{2, 1\\}", "\\{1, 2\\}"),
    ],
)
def test_math_equal_true(pred, label):
    assert R.math_equal(pred, label)
    assert R.math_reward(f"Work... so \\boxed{{{pred}}}.", label) == 1.0


@pytest.mark.parametrize("pred, label", [("3", "4"), ("1/3", "0.5"), ("2x", "2y"), ("x^2", "2x"), ("", "1")])
def test_math_equal_false(pred, label):
    assert not R.math_equal(pred, label)
    assert R.math_reward(f"\\boxed{{{pred}}}", label) == 0.0


def test_math_reward_gsm8k_and_missing_answer():
    assert R.math_reward("She sold 72 clips.\n#### 72", "Natalia ... \n#### 72") == 1.0
    assert R.math_reward("#### 71", "72") == 0.0
    assert R.math_reward("The answer is 72.", "72") == 0.0  # no \boxed and no ####: no answer
    assert R.math_reward("\\boxed{72", "72") == 0.0


def test_fast_path_skips_symbolic_check(monkeypatch):
    def boom(pred, gold):
        raise AssertionError("symbolic check called")

    monkeypatch.setattr(R, "_symbolic_equal", boom)
    assert R.math_equal(" 72.0 ", "72")
    assert R.math_equal("\\dfrac{3}{4}", "\\frac{3}{4}")
    assert R.math_equal("1,000", "1000")


def test_model_text_is_never_evaluated(monkeypatch, tmp_path):
    """Model text reaches only the LaTeX grammar; sympy's string parser (which evals) sees only
    number tokens the grammar has already matched."""
    import latex2sympy2_extended.latex2sympy2 as l2s
    import math_verify.parser
    import sympy.parsing.sympy_parser as sp

    # imported here before the spy: text with letters makes latex2sympy import sympy's units on
    # first use, whose module sympifies its own prefix names ('yotta', 'Y', ...) through the parser
    import sympy.physics.units  # noqa: F401

    seen = []
    real = sp.parse_expr

    def spy(s, *args, **kwargs):
        seen.append(s)
        return real(s, *args, **kwargs)

    for module in (math_verify.parser, sp, l2s):
        monkeypatch.setattr(module, "parse_expr", spy)
    marker = tmp_path / "pwned"
    payload = f"__import__('os').system('touch {marker}')"
    assert R.math_reward(f"\\boxed{{{payload}}}", "1") == 0.0
    assert R.math_reward('\\boxed{eval("1")}', "1") == 0.0
    assert R.math_reward("\\boxed{3+4*5}", "23") == 1.0  # plain expressions still parse (as LaTeX)
    assert R.math_reward("\\boxed{(2+1)/6}", "1/2") == 1.0
    assert seen, "the spy saw no call: it no longer watches the string parser"
    assert all(re.fullmatch(r"[0-9.]+", s) for s in seen), seen
    assert not marker.exists()


# ---------------------------------------------------------------- time limit

SLOW = "9^{9^{9^{9}}}"  # sympy tries to evaluate a tower of powers: hangs without a limit


def test_time_limit_main_thread():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda s, f: fired.append(s))
    try:
        t0 = time.monotonic()
        assert R.math_reward(f"\\boxed{{{SLOW}}}", "1", timeout_s=0.3) == 0.0
        assert time.monotonic() - t0 < 3.0
        assert signal.getsignal(signal.SIGALRM) is not R._alarm  # caller's handler restored
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
        assert R.math_reward("\\boxed{1/4}", "0.25", timeout_s=0.3) == 1.0  # next check unaffected
    finally:
        signal.signal(signal.SIGALRM, previous)
    assert fired == []


def test_time_limit_keeps_an_outer_timer():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda s, f: fired.append(s))
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        assert R.math_reward("\\boxed{1/5}", "0.2", timeout_s=1.0) == 1.0
        remaining, _ = signal.getitimer(signal.ITIMER_REAL)
        assert 25.0 < remaining <= 30.0  # still armed, not reset by the check
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert fired == []


def test_time_limit_other_thread_uses_checker_process():
    results = {}

    def work():
        results["ok"] = R.math_reward("\\boxed{1/8}", "0.125", timeout_s=1.0)
        t0 = time.monotonic()
        results["slow"] = R.math_reward(f"\\boxed{{{SLOW}}}", "2", timeout_s=1.0)
        results["slow_s"] = time.monotonic() - t0
        results["after"] = R.math_reward("\\boxed{3x}", "x*3", timeout_s=1.0)  # fresh checker

    th = threading.Thread(target=work)
    th.start()
    th.join(timeout=120)
    assert not th.is_alive()
    assert results["ok"] == 1.0 and results["after"] == 1.0
    assert results["slow"] == 0.0 and results["slow_s"] < 5.0
    R._CHECKER._stop()


def test_timeout_setting_validated():
    with pytest.raises(ValueError, match="timeout_s"):
        R.math_equal("x+1", "1+x", timeout_s=0)


# ---------------------------------------------------------------- registry


def test_registry():
    assert R.get_reward("math") is R.math_reward
    fn = R.get_reward("math", timeout_s=2.0)
    assert fn("\\boxed{0.5}", "1/2") == 1.0 and fn("\\boxed{0.6}", "1/2") == 0.0
    assert R.get_reward("boxed_exact")("\\boxed{ 0042 }", "0042") == 1.0
    assert R.get_reward("boxed_exact")("\\boxed{42}", "0042") == 0.0
    with pytest.raises(ValueError, match=r"reward='nope'.*accepted: \['boxed_exact', 'gsm8k', 'math'"):
        R.get_reward("nope")
    with pytest.raises(ValueError, match="no option"):
        R.get_reward("math", timeout=1)
    with pytest.raises(ValueError, match="already registered"):
        R.register_reward("math", R.boxed_exact_reward)
    R.register_reward("_test_const", lambda response, label: 0.25)
    try:
        assert R.get_reward("_test_const")("x", "y") == 0.25
    finally:
        del R.REWARDS["_test_const"]
