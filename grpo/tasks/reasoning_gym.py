"""reasoning-gym's tasks: rows of ``data.dataset_name="reasoning_gym:<task>"``, and the reward, the task's own
scorer on the answer extracted from the completion.

Rows from ``data.dataset_name="reasoning_gym:<task>"`` carry ``meta = {"entry": entry, "task": task}``.
The answer is the content of the last ``<answer>...</answer>`` in the completion (reasoning-gym's
prompt format), or the whole stripped completion when there is no such tag.
"""

from __future__ import annotations

import functools

import reasoning_gym
from reasoning_gym.utils import extract_answer

from grpo.tasks.rows import DataError, Row, split_seed


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


def reasoning_gym_rows(task: str, n: int, seed: int, split: str) -> list[Row]:
    """``n`` entries of reasoning-gym's ``task``; the entry rides along in meta for the task's scorer."""
    try:
        ds = reasoning_gym.create_dataset(task, size=n, seed=split_seed(seed, split))
    except Exception as err:  # reasoning-gym raises a bare error for unknown task names
        raise DataError(f"data.dataset_name='reasoning_gym:{task}': {type(err).__name__}: {err}") from err
    return [
        {
            "question": entry["question"],
            "answer": str(entry["answer"]),
            "source": f"reasoning_gym:{task}/{split}:{i}",
            "meta": {"entry": entry, "task": task},
        }
        for i, entry in enumerate(ds)
    ]


def rows(name: str, data_cfg, n: int, seed: int, split: str) -> list[Row]:
    """The rows of ``data.dataset_name="reasoning_gym:<task>"`` (`grpo.tasks.catalogue`)."""
    return reasoning_gym_rows(name.split(":", 1)[1], n, seed, split)
