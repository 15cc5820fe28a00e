"""Rows: what every prompt source yields, and how a built-in task draws its procedural rows.

A row is a plain, picklable dict::

    {"question": "3+4=", "answer": "7", "source": "arithmetic/train:0", "meta": {}}

A built-in task draws train and val rows from different seeds (`split_seed`), so the two never share a
stream. Rows that cannot be used raise `DataError`, naming where they came from and what is wrong.
"""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]


class DataError(ValueError):
    """Data that cannot be used; the message names the file (and row) and the problem."""


def split_seed(seed: int, split: str) -> int:
    """Seed of a procedural split, so train and val never share a stream: 2*seed (train), 2*seed+1 (val).

    >>> split_seed(3, "train"), split_seed(3, "val")
    (6, 7)
    """
    return 2 * seed + (0 if split == "train" else 1)
