"""Verifiable rewards: R = 1 if the response's final answer matches the label, else 0 (Sparse-RL 1.4).

The final answer is the content of the last \\boxed{...} (or \\fbox{...}) of the response, or
a GSM8K-style "#### answer" line. Equivalence is checked first on normalised strings and then
symbolically with math-verify, under a wall-clock limit per check. Model text only ever reaches
math-verify's LaTeX parser (an ANTLR grammar); sympy's string parser, which evals, sees only the
number tokens that grammar matched. (math-verify's plain-expression extractor hands raw text to
sympy.parse_expr, so it is not used.)

REWARDS maps a name to fn(response_text, label) -> float; tasks and configs pick rewards by name.
SOURCE_REWARDS maps a row's data_source (verl's column: "openai/gsm8k", "lighteval/MATH", ...) to
the reward that checks it: math (boxed, symbolic), gsm8k (the number after "####") or
multiple_choice (a letter A-E); data/reward_pool.py picks each row's reward from it.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import re
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from fractions import Fraction

RewardFn = Callable[[str, str], float]

DEFAULT_TIMEOUT_S: float = 5.0

# --------------------------------------------------------------------------- answer extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_GSM8K_RE = re.compile(r"####\s*([^\n]*)")


def _balanced(text: str, start: int) -> str | None:
    """Content of the brace group opening at text[start] == "{", or None if it never closes.

    Escaped characters (\\{, \\}, \\\\) are skipped, so set braces do not count."""
    depth, i = 0, start
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[start + 1 : i]
        i += 1
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} or \\fbox{...} (nested braces allowed; also the brace-less
    "\\boxed 5"). None when there is none or the last one never closes (a truncated response)."""
    matches = list(_BOX_RE.finditer(text))
    if not matches:
        return None
    rest = matches[-1].end()
    while text[rest : rest + 1] == " " and text[rest + 1 : rest + 2] in (" ", "{"):
        rest += 1
    if text[rest : rest + 1] == "{":
        content = _balanced(text, rest)
        return None if content is None else content.strip()
    word = re.match(r" +([^\s$]+)", text[rest:])  # "\\boxed 5": up to whitespace or "$"
    return word.group(1) if word else None


def extract_gsm8k(text: str) -> str | None:
    """Answer after the last "#### " (GSM8K reference format), without thousands separators."""
    found = _GSM8K_RE.findall(text)
    if not found:
        return None
    answer = found[-1].strip().rstrip(".").strip()
    return answer.replace(",", "") if re.fullmatch(r"-?[\d,]*\.?\d+", answer) else answer or None


def extract_answer(text: str) -> str | None:
    """The final answer of a response: last \\boxed{}, else GSM8K "####", else None."""
    boxed = extract_boxed(text)
    return boxed if boxed is not None else extract_gsm8k(text)


def label_answer(label: str) -> str:
    """The answer part of a label: labels may be bare answers or full GSM8K/MATH solutions."""
    found = extract_answer(label)
    return (found if found is not None else label).strip()


# --------------------------------------------------------------------------- string fast path

_STRIP_RE = re.compile(r"\\(?:left|right|displaystyle)(?![A-Za-z])|\\[!,;:]|\$")


def normalize_answer(answer: str) -> str:
    """A conservative canonical string: equal strings are certainly equal answers."""
    s = _STRIP_RE.sub("", answer.strip())
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\text\{\s*([^{}]*?)\s*\}", r"\1", s)
    s = re.sub(r"\s+", "", s).rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    if re.fullmatch(r"-?\d+\.0*", s):  # "72.0" -> "72"
        s = s.split(".")[0]
    return s


# --------------------------------------------------------------------------- symbolic check


class _CheckTimeout(BaseException):
    """Raised by SIGALRM inside a check; BaseException so math-verify's `except Exception` lets it through."""


class _DropTimeoutWarning(logging.Filter):
    # We run math-verify with its own (integer-second, signal based) timeouts off and enforce ours.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutWarning())


@functools.cache
def _math_verify():
    """math-verify's parse and verify, imported and warmed up once (sympy and the LaTeX grammar take
    seconds to load; that time must not count against the first check's limit)."""
    from math_verify import LatexExtractionConfig, parse, verify

    cfg = [LatexExtractionConfig()]
    verify(
        parse("\\boxed{1/2}", cfg, parsing_timeout=None),
        parse("\\boxed{0.5}", cfg, parsing_timeout=None),
        timeout_seconds=None,
    )
    return cfg, parse, verify


@functools.lru_cache(maxsize=4096)
def _symbolic_equal(pred: str, gold: str) -> bool:
    """math-verify parse + verify of two answers (LaTeX extraction only), no time limit."""
    cfg, parse, verify = _math_verify()
    gold_parsed = parse("\\boxed{" + gold + "}", extraction_config=cfg, parsing_timeout=None)
    pred_parsed = parse("\\boxed{" + pred + "}", extraction_config=cfg, parsing_timeout=None)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=None))


_TIMEOUTS = [0]  # checks of this process that ran past their limit


def timeouts() -> int:
    """How many symbolic checks of this process have run past their limit (scored 0) so far."""
    return _TIMEOUTS[0]


def _timed_out(how: str, timeout_s: float) -> bool:
    _TIMEOUTS[0] += 1
    logging.getLogger(__name__).warning("math check timed out after %.1fs%s", timeout_s, how)
    return False


def _alarm(signum, frame):
    raise _CheckTimeout()


def _equal_with_alarm(pred: str, gold: str, timeout_s: float) -> bool:
    """Main thread: interrupt the check with SIGALRM after timeout_s. The caller's SIGALRM handler
    and any timer it had armed are restored afterwards (an outer timer due sooner fires right after)."""
    _math_verify()  # load outside the timed region
    outer_delay, outer_interval = signal.getitimer(signal.ITIMER_REAL)
    previous = signal.signal(signal.SIGALRM, _alarm)
    start = time.monotonic()
    signal.setitimer(signal.ITIMER_REAL, min(timeout_s, outer_delay) if outer_delay > 0 else timeout_s)
    try:
        return _symbolic_equal(pred, gold)
    except _CheckTimeout:
        return _timed_out("", timeout_s)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_delay > 0:
            remaining = max(outer_delay - (time.monotonic() - start), 1e-3)
            signal.setitimer(signal.ITIMER_REAL, remaining, outer_interval)


def _serve() -> None:
    """Loop of the checker subprocess: one JSON [pred, gold] per stdin line, one JSON bool per stdout line."""
    _math_verify()
    for line in sys.stdin:
        pred, gold = json.loads(line)
        try:
            ok = _symbolic_equal(pred, gold)
        except Exception:
            ok = False
        sys.stdout.write(json.dumps(ok) + "\n")
        sys.stdout.flush()


class _Checker:
    """Checker subprocess for threads other than the main one (signals only reach the main thread).

    A check that runs past its limit gets the process killed; the next check starts a fresh one.
    It is a plain `python -m sparserl_jax.data.rewards` child, so the caller's script is not re-imported.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "sparserl_jax.data.rewards"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def _stop(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdin.close()
            self._proc.stdout.close()
        self._proc = None

    def check(self, pred: str, gold: str, timeout_s: float, startup_s: float = 60.0) -> bool:
        with self._lock:
            fresh = self._proc is None or self._proc.poll() is not None
            if fresh:
                self._stop()
                self._start()
            try:
                self._proc.stdin.write(json.dumps([pred, gold]) + "\n")
                self._proc.stdin.flush()
            except BrokenPipeError:
                self._stop()
                return False
            # A fresh process first imports sympy and math-verify: that time does not count.
            ready, _, _ = select.select([self._proc.stdout], [], [], timeout_s + (startup_s if fresh else 0.0))
            if ready:
                line = self._proc.stdout.readline()
                if line:
                    return bool(json.loads(line))
                self._stop()  # the checker died (e.g. out of memory): the answer counts as wrong
                return False
            self._stop()
            return _timed_out(" (checker process)", timeout_s)


_CHECKER = _Checker()


def math_equal(pred: str, label: str, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """Whether the answer `pred` equals `label` (bare answer or a full solution), within timeout_s.

    timeout_s=None checks without a limit (only for trusted inputs). A check past its limit is False.
    """
    gold = label_answer(label)
    pred = pred.strip()
    if not pred or not gold:
        return False
    if normalize_answer(pred) == normalize_answer(gold):
        return True
    if timeout_s is None:
        return _symbolic_equal(pred, gold)
    if timeout_s <= 0:
        raise ValueError(f"reward timeout_s={timeout_s} must be > 0 (or None for no limit)")
    if threading.current_thread() is threading.main_thread() and hasattr(signal, "setitimer"):
        return _equal_with_alarm(pred, gold, timeout_s)
    return _CHECKER.check(pred, gold, timeout_s)


# --------------------------------------------------------------------------- rewards and registry


def math_reward(response: str, label: str, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if the final answer of `response` (last \\boxed{}, else "####") is equivalent to `label`."""
    answer = extract_answer(response)
    return float(answer is not None and math_equal(answer, label, timeout_s))


def boxed_exact_reward(response: str, label: str) -> float:
    """1.0 if the content of the last \\boxed{} is exactly `label` (spaces ignored): synthetic tasks."""
    answer = extract_boxed(response)
    return float(answer is not None and re.sub(r"\s+", "", answer) == re.sub(r"\s+", "", label))


_NUMBER_RE = re.compile(r"\$?\s*(-?[\d,]*\.?\d+)")


def _number(answer: str | None) -> Fraction | None:
    """The number an answer starts with ("$1,234.50 dollars" -> 1234.5), exactly; None without one."""
    found = _NUMBER_RE.match(answer.strip()) if answer is not None else None
    return Fraction(found.group(1).replace(",", "")) if found and found.group(1).replace(",", "") else None


def gsm8k_reward(response: str, label: str) -> float:
    """1.0 if the number after the response's last "####" (else in its last \\boxed{}) equals the
    label's (GSM8K: a number; commas, "$" and trailing words ignored). No symbolic check: exact."""
    answer = extract_gsm8k(response)
    got = _number(answer if answer is not None else extract_boxed(response))
    return float(got is not None and got == _number(label_answer(label)))


_CHOICE_RE = re.compile(r"^\(?([A-E])\)?(?:$|[\s.:)])")
_ANSWER_IS_RE = re.compile(r"(?i:answer\s*(?:is|:)\s*(?:option\s*)?)\(?([A-E])\b")


def extract_choice(text: str) -> str | None:
    """The letter A-E a response chose: its last \\boxed{} ("C", "(C)", "\\text{C. 42}"), else
    its last "answer is C" / "Answer: (C)"."""
    boxed = extract_boxed(text)
    if boxed is not None:
        found = _CHOICE_RE.match(normalize_answer(boxed))
        return found.group(1) if found else None
    found = _ANSWER_IS_RE.findall(text)
    return found[-1] if found else None


def choice_reward(response: str, label: str) -> float:
    """1.0 if the letter the response chose (extract_choice) is the label's ("C", "(C)", "C. 42")."""
    got = extract_choice(response)
    gold = _CHOICE_RE.match(normalize_answer(label_answer(label)))
    return float(got is not None and gold is not None and got == gold.group(1))


REWARDS: dict[str, RewardFn] = {
    "math": math_reward,
    "boxed_exact": boxed_exact_reward,
    "gsm8k": gsm8k_reward,
    "multiple_choice": choice_reward,
}

# a row's data_source -> the reward (a REWARDS name) that checks it; verl's names and plain ones
SOURCE_REWARDS: dict[str, str] = {
    "math": "math",
    "lighteval/MATH": "math",
    "DigitalLearningGmbH/MATH-lighteval": "math",
    "HuggingFaceH4/MATH-500": "math",
    "gsm8k": "gsm8k",
    "openai/gsm8k": "gsm8k",
    "multiple_choice": "multiple_choice",
    "cais/mmlu": "multiple_choice",
    "allenai/ai2_arc": "multiple_choice",
}


def register_reward(name: str, fn: RewardFn) -> None:
    """Adds a reward to REWARDS; names are unique."""
    if name in REWARDS:
        raise ValueError(f"reward {name!r} is already registered; registered: {sorted(REWARDS)}")
    REWARDS[name] = fn


def register_source_reward(data_source: str, reward: str) -> None:
    """Checks the rows of `data_source` with the registered reward `reward`; data_sources are unique."""
    if data_source in SOURCE_REWARDS:
        raise ValueError(
            f"data_source {data_source!r} already has reward {SOURCE_REWARDS[data_source]!r}; "
            f"registered: {sorted(SOURCE_REWARDS)}"
        )
    if reward not in REWARDS:
        raise ValueError(
            f"reward={reward!r} (for data_source {data_source!r}) is not registered; accepted: {sorted(REWARDS)}"
        )
    SOURCE_REWARDS[data_source] = reward


def get_reward(name: str, **options) -> RewardFn:
    """The reward `name` with its keyword options bound (e.g. get_reward("math", timeout_s=2.0))."""
    if name not in REWARDS:
        raise ValueError(f"reward={name!r} is not registered; accepted: {sorted(REWARDS)}")
    fn = REWARDS[name]
    if not options:
        return fn
    params = inspect.signature(fn).parameters
    unknown = sorted(set(options) - set(list(params)[2:]))
    if unknown:
        raise ValueError(f"reward {name!r} has no option(s) {unknown}; accepted: {list(params)[2:]}")
    return functools.partial(fn, **options)


def get_timed_reward(name: str, timeout_s: float) -> RewardFn:
    """The reward `name` with its own time limit (its `timeout_s` option, math's symbolic check)
    set to `timeout_s`; a reward without one as it is."""
    fn = get_reward(name)
    return get_reward(name, timeout_s=timeout_s) if "timeout_s" in inspect.signature(fn).parameters else fn


def warm_up() -> None:
    """Loads sympy and math-verify (seconds), so that no check's time limit counts it."""
    _math_verify()


if __name__ == "__main__":
    _serve()
