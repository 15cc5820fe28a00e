"""Reward of the built-in arithmetic task: the first integer of the completion equals the answer.

Pure and fast (a regex), so it runs in the trainer process, with no worker pool.
"""

from __future__ import annotations

import re

FIRST_INTEGER = re.compile(r"-?\d+")


def arithmetic_reward(question: str, completion: str, answer: str, meta: dict) -> float:
    """1.0 if the first integer in ``completion`` equals ``int(answer)``, else 0.0.

    >>> arithmetic_reward("3+4=", "7 and then 8", "7", {})
    1.0
    >>> arithmetic_reward("3+4=", "it is 8, no 7", "7", {})
    0.0
    """
    match = FIRST_INTEGER.search(completion)
    return float(match is not None and int(match.group()) == int(answer))
