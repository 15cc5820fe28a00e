"""Wings: features that plug into the core's seams and that the core never imports (`tests/unit/test_layers.py`).

Each wing is a folder that registers what it provides when imported:

    reward_model   env.name=reward_model: a sequence classifier's score (an environment, `grpo.tasks.factory`'s
                   catalogue) computed at the rollout's deferred scoring point (`grpo.system.deferred`)

A run loads every wing (`load`) before it builds its environments; a test or a script that uses one wing imports it.
"""

from __future__ import annotations

import importlib

WINGS = ("grpo.wings.reward_model",)


def load() -> None:
    """Import every wing, so each registers its environments and scorers (idempotent)."""
    for name in WINGS:
        importlib.import_module(name)
