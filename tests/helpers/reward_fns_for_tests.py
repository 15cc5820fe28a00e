"""Reward functions for tests/unit/test_environments.py, imported by name in the reward worker processes.

Behaviour is chosen per sample through the question, so one batch can mix good, raising, hanging and
crashing samples.
"""

from __future__ import annotations

import os
import time


def exact(question: str, completion: str, answer: str, meta: dict) -> float:
    """1.0 when the stripped completion equals the answer."""
    return float(completion.strip() == answer)


class HTTPStatusError(Exception):
    """An HTTP client's error: it carries the response's status (as httpx's and aiohttp's do)."""

    def __init__(self, status: int):
        super().__init__(f"the judge answered HTTP {status}")
        self.status_code = status


def by_question(question: str, completion: str, answer: str, meta: dict) -> float:
    """"raise" raises, "hang" sleeps 60 s, "crash" kills its process, "nan" returns NaN, "connection" raises
    ConnectionRefusedError, "http503" / "http404" an HTTP error with that status, "once" raises
    ConnectionRefusedError the first time (until the file ``meta["once"]`` exists); else `exact`."""
    if question == "raise":
        raise RuntimeError("boom from the reward function")
    if question == "connection":
        raise ConnectionRefusedError("the judge is down")
    if question.startswith("http"):
        raise HTTPStatusError(int(question[4:]))
    if question == "once" and not os.path.exists(meta["once"]):
        open(meta["once"], "w").close()
        raise ConnectionRefusedError("the judge is down, once")
    if question == "hang":
        time.sleep(60)
    if question == "crash":
        os._exit(3)
    if question == "nan":
        return float("nan")
    return exact(question, completion, answer, meta)


def components(question: str, completion: str, answer: str, meta: dict) -> dict:
    """GDPO components: format (completion is digits) and correct; "scalar" in meta adds a "reward" key."""
    out = {"format": 0.5 * completion.strip().isdigit(), "correct": float(completion.strip() == answer)}
    if meta.get("scalar") is not None:
        out["reward"] = meta["scalar"]
    return out


def sleepy(question: str, completion: str, answer: str, meta: dict) -> float:
    """Sleeps meta["sleep"] seconds, then returns 1.0."""
    time.sleep(meta.get("sleep", 0.0))
    return 1.0


def pid(question: str, completion: str, answer: str, meta: dict) -> float:
    """The worker's process id (after sleeping meta["sleep"] seconds), to see which process scored a sample."""
    time.sleep(meta.get("sleep", 0.0))
    return float(os.getpid())


NOT_A_FUNCTION = 3
