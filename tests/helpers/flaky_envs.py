"""Reward functions that fail on purpose, for the rollout-failure tests (issue 31). Each scores like the arithmetic
task (1.0 when the first integer of the completion is the answer) when it does not fail.

Failures are controlled per call and survive the reward worker processes (state in files):

    sometimes_broken   fails for good (raises ValueError) on the samples whose answer is a multiple of 5
    fail_once          each distinct (question, completion) fails its first call (ConnectionError), then scores
    random_failures    about 30% of calls fail, chosen by a deterministic hash of (question, completion, call number):
                       a raise, a hang past env.timeout_s, or a malformed (non-number) return
    down_while_flagged raises ConnectionError on every call while the file $FLAKY_DOWN_FILE exists

``$FLAKY_STATE_DIR`` holds the per-call counters of fail_once and random_failures (a fresh directory per run).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import time
from pathlib import Path


def arithmetic(completion: str, answer: str) -> float:
    m = re.search(r"-?\d+", completion)
    return float(m is not None and m.group() == answer)


def _key(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()


def _next_call(question: str, completion: str) -> int:
    """This call's number (0, 1, ...) for (question, completion), counted in $FLAKY_STATE_DIR.

    Equal completions are common with a tiny model and are scored in parallel worker processes: the count is read and
    written under an exclusive lock, so that no reader sees a half-written file (an int("") ValueError would be a data
    failure of the helper itself) and no two calls get the same number."""
    d = Path(os.environ["FLAKY_STATE_DIR"])
    d.mkdir(parents=True, exist_ok=True)
    with open(d / _key(question, completion), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        n = int(f.read() or 0)
        f.seek(0)
        f.truncate()
        f.write(str(n + 1))
        return n


def sometimes_broken(question: str, completion: str, answer: str, meta: dict) -> float:
    if int(answer) % 5 == 0:
        raise ValueError(f"sometimes_broken cannot score answer {answer}")
    return arithmetic(completion, answer)


def fail_once(question: str, completion: str, answer: str, meta: dict) -> float:
    if _next_call(question, completion) == 0:
        raise ConnectionError("fail_once: the scoring service dropped the first call")
    return arithmetic(completion, answer)


def random_failures(question: str, completion: str, answer: str, meta: dict):
    call = _next_call(question, completion)
    h = int(_key(question, completion, str(call))[:8], 16) % 100
    if h < 10:
        raise ConnectionResetError("random_failures: connection reset")
    if h < 20:
        time.sleep(float(os.environ.get("FLAKY_HANG_S", "3")))  # past env.timeout_s
    if 20 <= h < 30:
        return "not a number"  # malformed: the reward environment refuses it
    return arithmetic(completion, answer)


def down_while_flagged(question: str, completion: str, answer: str, meta: dict) -> float:
    flag = os.environ.get("FLAKY_DOWN_FILE")
    if flag and os.path.exists(flag):
        raise ConnectionRefusedError(f"the scoring service is down ({flag} exists)")
    return arithmetic(completion, answer)
