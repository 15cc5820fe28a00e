"""Rows: what every prompt source yields, how a built-in task draws its procedural rows, and the `PromptRow`
the data hands to the rollout.

A row, as a source yields it (files, the hub, a task's ``rows``), is a plain, picklable dict::

    {"question": "3+4=", "answer": "7", "source": "arithmetic/train:0", "meta": {}}

Formatted and tokenised (`grpo.system.data.PromptDataset`), it becomes a `PromptRow`: what the rollout reads.

A built-in task draws train and val rows from different seeds (`split_seed`), so the two never share a
stream. Rows that cannot be used raise `DataError`, naming where they came from and what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

Row = dict[str, Any]

ROW_KEYS = ("question", "answer", "source", "meta")


@dataclass
class PromptRow:
    """One prompt as the rollout gets it (an item of `grpo.system.data.PromptDataset`).

    ``index``: the row's position among the loaded rows; ``question``: its text (a conversation's last user
    message); ``task_name``: the environment that scores it; ``prompt_messages``: the formatted prompt as
    ``{"role", "content", "token_ids"}`` messages, ``prompt_ids`` their ids end to end; ``source``: where the row
    came from (``"train.jsonl:3"``, ``"arithmetic/train:0"``); ``meta``: what a scorer needs besides the answer;
    ``extra``: any other keys of the source row, as they were; ``prompt_parts``: a row with images, each prompt
    message's content as the data gave it (text, or parts whose image parts hold the row's image values), what an
    agent is shown (`grpo.wings.agents.environment.agent_messages`); None for a text row.

        >>> PromptRow(0, "3+4=", "7", "arithmetic", [{"role": "user", "content": "3+4=", "token_ids": [5, 6]}],
        ...           [5, 6]).meta
        {}
    """

    index: int
    question: str
    answer: str
    task_name: str
    prompt_messages: list[dict[str, Any]]
    prompt_ids: list[int]
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    media: dict[str, Any] | None = None  # a VLM prompt's image tensors (grpo.system.vision), None without images
    prompt_parts: list[Any] | None = None  # a row with images: its prompt messages' content with the image values


class DataError(ValueError):
    """Data that cannot be used; the message names the file (and row) and the problem."""


def split_seed(seed: int, split: str) -> int:
    """Seed of a procedural split, so train and val never share a stream: 2*seed (train), 2*seed+1 (val).

    >>> split_seed(3, "train"), split_seed(3, "val")
    (6, 7)
    """
    return 2 * seed + (0 if split == "train" else 1)


def content_problem(content) -> str | None:
    """What is wrong with a message's content (None: a string, or a list of ``{"type": "text", "text": str}`` and
    ``{"type": "image", "image": <path | data: URL | datasets Image>}`` parts, NeMo-RL's row format)."""
    if isinstance(content, str):
        return None
    if not isinstance(content, list) or not content:
        return "expected a string or a non-empty list of content parts"
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind == "image" and part.get("image") is not None:
            continue
        return (f"content part {i} is {str(part)[:80]!r}: expected {{'type': 'text', 'text': str}} or "
                "{'type': 'image', 'image': <path, data: URL or image>}")
    return None
