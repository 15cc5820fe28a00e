"""Wings: features that plug into the core's seams and that the core never imports (`tests/unit/test_layers.py`).

Each wing is a folder that registers what it provides when imported:

    reward_model   env.name=reward_model: a sequence classifier's score (an environment, `grpo.tasks.factory`'s
                   catalogue) computed at the rollout's deferred scoring point (`grpo.system.deferred`)
    agents         env.name=agent and expose_http_server: the OpenAI-compatible endpoint over the run's generation
                   backend and the player of the samples played over it (`grpo.system.players`; NeMo-Gym's too)
    gym            env.name=nemo_gym: NeMo-Gym's agent servers over the agents wing's endpoint, and NeMo-RL's
                   effort levels and penalties on their results (a reward transform, `grpo.rewards`)

A run loads every wing (`load`) before it builds its environments; a test or a script that uses one wing imports it.
"""

from __future__ import annotations

import importlib

WINGS = ("grpo.wings.reward_model", "grpo.wings.agents", "grpo.wings.gym")


def load() -> None:
    """Import every wing, so each registers its environments and scorers (idempotent)."""
    for name in WINGS:
        importlib.import_module(name)
