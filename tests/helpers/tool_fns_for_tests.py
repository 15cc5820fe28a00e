"""Tools for tests/unit/test_tools.py, imported by name in the tool worker processes."""

from __future__ import annotations

import time
from typing import Optional


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first integer
        b: the second integer
    """
    return a + b


def scale(values: list[float], factor: float = 2.0, label: Optional[str] = None) -> dict:
    """Multiply every value by a factor.

    Args:
        values: the numbers
        factor: what to multiply them by
        label: an optional name for the result
    """
    return {"label": label, "values": [v * factor for v in values]}


def fail(message: str) -> str:
    """Raise an error with a message.

    Args:
        message: the error message
    """
    raise RuntimeError(message)


def nap(seconds: float) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return f"slept {seconds}"


def shout(text: str, times: int) -> str:
    """Repeat a text.

    Args:
        text: the text
        times: how many times
    """
    return text * times


def odd_result() -> set:
    """Return something that is not text."""
    return {1, 2}


def undocumented(a: int) -> int:
    return a


def untyped(a):
    """Return a.

    Args:
        a: anything
    """
    return a


def no_arg_doc(a: int) -> int:
    """Return a."""
    return a
