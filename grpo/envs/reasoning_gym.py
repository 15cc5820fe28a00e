"""Reward of a reasoning-gym task: the task's own scorer on the answer extracted from the completion.

Rows from ``data.dataset_name="reasoning_gym:<task>"`` carry ``meta = {"entry": entry, "task": task}``.
The answer is the content of the last ``<answer>...</answer>`` in the completion (reasoning-gym's
prompt format), or the whole stripped completion when there is no such tag.
"""

from __future__ import annotations

import functools

import reasoning_gym
from reasoning_gym.utils import extract_answer


@functools.cache
def _score_fn(task: str):
    """The task's ``score_answer(answer, entry) -> float`` (built once per task and process)."""
    return reasoning_gym.get_score_answer_fn(task)


def reasoning_gym_reward(question: str, completion: str, answer: str, meta: dict) -> float:
    """``score_answer(extracted answer, entry)`` of the row's task, a float in [0, 1]."""
    if "entry" not in meta or "task" not in meta:
        raise ValueError("reasoning_gym reward needs meta={'entry': ..., 'task': ...} (rows of reasoning_gym:<task>)")
    extracted = extract_answer(completion)
    return float(_score_fn(meta["task"])(extracted if extracted is not None else completion.strip(), meta["entry"]))
