"""Reward functions for the end-to-end tests (env.reward_fn="tests.helpers.e2e_reward_fns:<name>")."""

import re
import time


def flaky_reward(question: str, completion: str, answer: str, meta: dict) -> float:
    """Arithmetic reward that raises when the answer is a multiple of 3 and hangs when it is 7 or 14."""
    a = int(answer)
    if a % 3 == 0:
        raise ValueError(f"flaky_reward refuses {answer}")
    if a % 7 == 0:
        time.sleep(60)
    m = re.search(r"-?\d+", completion)
    return float(m is not None and m.group() == answer)


def two_component_reward(question: str, completion: str, answer: str, meta: dict) -> dict:
    """GDPO test reward: correctness plus a format component (the completion is a bare integer)."""
    m = re.search(r"-?\d+", completion)
    return {"correct": float(m is not None and m.group() == answer),
            "format": float(completion.strip().lstrip("-").isdigit())}


def huge_reward(question: str, completion: str, answer: str, meta: dict) -> float:
    """1e39: finite in float64, inf in float32 (what rewards are trained in): a failing reward on every sample."""
    return 1e39


def slow_arithmetic(question: str, completion: str, answer: str, meta: dict) -> float:
    """The arithmetic reward, a little slow: a run with it has reward workers alive most of the time."""
    time.sleep(0.02)
    m = re.search(r"-?\d+", completion)
    return float(m is not None and m.group() == answer)


def completion_length(question: str, completion: str, answer: str, meta: dict) -> float:
    """The completion's length in characters: a reward that varies within a group, so every step has a gradient."""
    return float(len(completion))
