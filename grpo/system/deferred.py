"""The deferred scoring point (a seam): scorers that score the samples of a rollout together, on every rank, once
its conversations end, instead of in the environments' steps.

A wing that scores this way (reward models: `grpo.wings.reward_model`) registers a factory of its scorer by name
(`register_deferred_scorer`). A run builds one of each (`DeferredScorers`) before its environments, whose builders
take theirs by name (``deferred[name]``, `grpo.tasks.factory.register_environment`); `place` builds what they asked
for once the engines hold their memory; the rollout calls `score_pending` once per rollout on every rank, with this
rank's samples (or none when its conversations failed), because a scorer's forwards may be collectives. An
environment that defers leaves `grpo.tasks.pending.PendingScore` in a sample's metadata for its scorer.

A scorer (`DeferredScorer`) counts what it was asked to score (``len``: 0, nothing to score, no scoring point),
says whether the async loop must run it in the trainer thread (``on_trainer_thread``), and closes with the run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class DeferredScorer(Protocol):
    on_trainer_thread: bool

    def __len__(self) -> int: ...

    def place(self, log: Callable[[str], None] | None = None) -> None: ...

    def score_pending(self, trajectories: list) -> float: ...

    def close(self) -> None: ...


# name -> factory(device, policy config, world size) -> DeferredScorer
_FACTORIES: dict[str, Callable[..., DeferredScorer]] = {}


def register_deferred_scorer(name: str, factory: Callable[..., DeferredScorer]) -> None:
    """Make ``factory(device, policy_cfg, world_size)`` the scorer a run builds under ``name`` (replacing one of that
    name); a wing calls it when it is imported."""
    _FACTORIES[name] = factory


class DeferredScorers:
    """One scorer of every registered kind for a run (``device``, ``policy``: the policy config, ``world_size``),
    in registration order, which is the same on every rank; ``scorers[name]`` is the one an environment takes."""

    def __init__(self, device, policy=None, world_size: int = 1):
        self.by_name = {name: factory(device, policy, world_size) for name, factory in _FACTORIES.items()}

    def __getitem__(self, name: str) -> DeferredScorer:
        return self.by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def __len__(self) -> int:
        """How much the scorers were asked to score (0: no scoring point)."""
        return sum(len(s) for s in self.by_name.values())

    @property
    def on_trainer_thread(self) -> bool:
        """Whether the async loop's producer hands `score_pending` to the trainer thread (`grpo.run.producer`)."""
        return any(s.on_trainer_thread for s in self.by_name.values())

    def place(self, log: Callable[[str], None] | None = None) -> None:
        for scorer in self.by_name.values():
            scorer.place(log)

    def score_pending(self, trajectories: list) -> float:
        """Every scorer's pending scores of these trajectories (this rank's) folded into them; the seconds it took.
        Every rank calls it once per rollout, in step (a scorer's forwards may be collectives)."""
        return sum(scorer.score_pending(trajectories) for scorer in self.by_name.values() if len(scorer))

    def close(self) -> None:
        for scorer in self.by_name.values():
            scorer.close()
