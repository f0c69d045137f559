"""Argument checks shared by every config class and public constructor: each raises a one-line
ValueError that names the setting, its value and what is accepted (imports nothing of the package,
so any module may use it)."""

from __future__ import annotations

import numbers
from collections.abc import Iterable
from typing import Any


def _is_number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_integer(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_in(name: str, value: Any, accepted: Iterable) -> None:
    """`value` is one of `accepted` (a tuple, or a registry dict whose keys are accepted)."""
    accepted = tuple(accepted)
    if not _hashable_in(value, accepted):
        raise ValueError(f"{name}={value!r}: accepted values are {accepted}")


def _hashable_in(value: Any, accepted: tuple) -> bool:
    try:
        return value in accepted
    except TypeError:  # e.g. a list compared with a tuple of strings
        return False


def check_number(name: str, value: Any, *, integer: bool = False) -> None:
    """`value` is a real number, not NaN (an integer when `integer`); booleans are neither."""
    if integer and not _is_integer(value):
        raise ValueError(f"{name}={value!r} must be an integer")
    if not _is_number(value) or value != value:
        raise ValueError(f"{name}={value!r} must be a number")


def check_at_least(name: str, value: Any, low: float, *, integer: bool = True) -> None:
    """`value` >= `low`: a count, a size or a period (an integer unless `integer=False`)."""
    check_number(name, value, integer=integer)
    if value < low:
        raise ValueError(f"{name}={value!r} must be >= {low}")


def check_positive(name: str, value: Any, *, integer: bool = False) -> None:
    """`value` > 0: a scale, a rate, a threshold (any real number unless `integer`)."""
    check_number(name, value, integer=integer)
    if not value > 0:
        raise ValueError(f"{name}={value!r} must be > 0")


def check_between(name: str, value: Any, lo: float, hi: float, *, lo_open: bool = False, hi_open: bool = False) -> None:
    """`value` in the interval from `lo` to `hi`, each end closed unless `lo_open` / `hi_open`."""
    check_number(name, value)
    above = value > lo if lo_open else value >= lo
    below = value < hi if hi_open else value <= hi
    if not (above and below):
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        raise ValueError(f"{name}={value!r} must be in {interval}")


def check_bool(name: str, value: Any) -> None:
    """`value` is True or False (not 1, "yes" or None)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be true or false")


def check_multiple(name: str, value: int, of: str, divisor: int, why: str = "") -> None:
    """`value` is a multiple of `divisor` (the setting or quantity named `of`); `why` says what
    needs it. Both are checked to be integers >= 1 first."""
    check_at_least(name, value, 1)
    check_at_least(of, divisor, 1)
    if value % divisor:
        raise ValueError(f"{name}={value} must be a multiple of {of}={divisor}{': ' + why if why else ''}")
