"""The argument rules shared by every layer: integers, real numbers and choices.

Python checks arguments before any C call, because GGML answers a bad value
with ``abort()``. Each check returns the value in its canonical type or raises
the given error class with one message that names the input, the value and the
rule: ``"Graph: size must be an int >= 1, got 0"``. Bools are never numbers
here: ``n_threads=True`` is a mistake, not 1.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from typing import Any, TypeVar

from .errors import ArgumentError, ArgumentTypeError, GgmlHybridError

T = TypeVar("T")
ErrorClass = type[GgmlHybridError]


def _type_error(error: ErrorClass, type_error: ErrorClass | None) -> ErrorClass:
    if type_error is not None:
        return type_error
    return ArgumentTypeError if error is ArgumentError else error


def int_rule(lo: int | None = None, hi: int | None = None) -> str:
    """The text of an integer rule: 'an int', 'an int >= 1', 'an int in 1..512', 'an int <= 9'."""
    if lo is not None and hi is not None:
        return f"an int in {lo}..{hi}"
    if lo is not None:
        return f"an int >= {lo}"
    if hi is not None:
        return f"an int <= {hi}"
    return "an int"


def check_int(value: Any, what: str, lo: int | None = None, hi: int | None = None, *,
              error: ErrorClass = ArgumentError, type_error: ErrorClass | None = None) -> int:
    """``value`` as a plain int in ``[lo, hi]`` (numpy integers accepted, bools and floats not)."""
    rule = int_rule(lo, hi)
    if isinstance(value, bool):
        raise _type_error(error, type_error)(f"{what} must be {rule}, got the bool {value!r}")
    try:
        v = operator.index(value)
    except TypeError:
        raise _type_error(error, type_error)(
            f"{what} must be {rule}, got {value!r} of type {type(value).__name__}") from None
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise error(f"{what} must be {rule}, got {v}")
    return v


def real_rule(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"a finite number in {'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    if lo is not None:
        return f"a finite number {'>' if lo_open else '>='} {lo:g}"
    if hi is not None:
        return f"a finite number {'<' if hi_open else '<='} {hi:g}"
    return "a finite number"


def check_real(value: Any, what: str, lo: float | None = None, hi: float | None = None, *,
               lo_open: bool = False, hi_open: bool = False, error: ErrorClass = ArgumentError,
               type_error: ErrorClass | None = None) -> float:
    """``value`` as a finite float within the bounds (open or closed)."""
    rule = real_rule(lo, hi, lo_open, hi_open)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _type_error(error, type_error)(
            f"{what} must be {rule}, got {value!r} of type {type(value).__name__}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond float range
        raise error(f"{what} must be {rule}, got {value!r}") from None
    bad = not math.isfinite(v)
    bad = bad or (lo is not None and (v <= lo if lo_open else v < lo))
    bad = bad or (hi is not None and (v >= hi if hi_open else v > hi))
    if bad:
        raise error(f"{what} must be {rule}, got {value!r}")
    return v


def check_choice(value: T, what: str, choices: Iterable[T], *, error: ErrorClass = ArgumentError) -> T:
    """``value`` if it is one of ``choices``."""
    options = tuple(choices)
    if value not in options:
        raise error(f"{what} must be one of {', '.join(repr(c) for c in options)}, got {value!r}")
    return value


def check_type(value: T, what: str, *types: type, error: ErrorClass = ArgumentTypeError) -> T:
    """``value`` if it is an instance of one of ``types``."""
    if not isinstance(value, types):
        names = " or ".join(t.__name__ for t in types)
        raise error(f"{what} must be a {names}, got {value!r} of type {type(value).__name__}")
    return value


def check_callable(value: T, what: str, *, error: ErrorClass = ArgumentTypeError) -> T:
    """``value`` if it can be called (a callback checked when it is given, not when it is first called)."""
    if not callable(value):
        raise error(f"{what} must be callable, got {value!r} of type {type(value).__name__}")
    return value


__all__ = ["check_callable", "check_choice", "check_int", "check_real", "check_type", "int_rule", "real_rule"]
