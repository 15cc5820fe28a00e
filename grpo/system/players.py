"""Who plays a sample (a seam): the in-process conversation loop (`grpo.system.rollout.run_conversations`) plays
every sample by default; a wing that plays some tasks' samples its own way (agents and NeMo-Gym's agent servers
over the OpenAI-compatible endpoint: `grpo.wings.agents`) registers a starter (`register_player`), which the run
calls once its generation backend exists (`start_player`).

A starter returns a `Player`, or None when the run has nothing for it to play or serve. A player names the tasks
whose samples it plays (``tasks(envs)``), opens a generation window while the in-process loop generates the other
samples (``sharing``: outside requests are answered between the rollout's batches), plays its own (``play``,
returning its seconds), changes the weights it serves when the async loop loads new ones (``load_weights``) and
keeps the batch in flight on the version it started with (``hold_version``); once the run's ``stop_requested()``
is true it stops retrying failed samples.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol


class Player(Protocol):
    stop_requested: Callable[[], bool]

    def tasks(self, envs) -> set[str]: ...

    def sharing(self, generator, weight_version: int | None = None) -> AbstractContextManager: ...

    def play(self, trajs: list, seed_keys: list[tuple], envs, weight_version: int | None = None) -> float: ...

    def load_weights(self, load: Callable[[], int]) -> int: ...

    def hold_version(self, version: int) -> None: ...


class PlayerError(RuntimeError):
    """A player that cannot start (a port taken, servers that do not answer): the run stops with this line."""


# name -> start(cfg, generator, tokenizer, envs_list, closables, logger, rank, asynchronous, vocab_size): a Player or None
_STARTERS: dict[str, Callable[..., Player | None]] = {}


def register_player(name: str, start: Callable[..., Player | None]) -> None:
    """Make ``start`` the starter called ``name`` (replacing one of that name); a wing calls it when imported."""
    _STARTERS[name] = start


# wrap(cfg, backend, layout) -> backend: what a wing puts around the trainers' backend of the generation ranks, in
# registration order (register_backend_wrapper; the agents wing's lockstep rounds when several trainers serve).
_BACKEND_WRAPPERS: list[Callable] = []


def register_backend_wrapper(wrap: Callable) -> None:
    """Have ``wrap(cfg, backend, layout)`` return the backend the trainers use instead of ``backend`` (the generation
    ranks' `grpo.system.generation.remote.RemoteGeneration`; ``layout``: `grpo.system.dist.Layout`), or ``backend``
    itself when the run needs nothing around it (a wing calls it when imported)."""
    _BACKEND_WRAPPERS.append(wrap)


def wrap_backend(cfg, backend, layout):
    """The generation ranks' backend with every registered wrapper around it, in order."""
    for wrap in _BACKEND_WRAPPERS:
        backend = wrap(cfg, backend, layout)
    return backend


def start_player(cfg, generator, tokenizer, envs_list: list, closables: list, logger, rank: int, asynchronous: bool,
                 vocab_size: int) -> Player | None:
    """The run's player, from the first registered starter that returns one (None: the in-process loop plays every
    sample). ``envs_list``: the run's environments (training, validation); ``closables``: what the run closes at its
    end (a starter adds what it opened); ``asynchronous`` without a ``generator``: the async loop, whose own backend
    comes later (`grpo.run.serving.start_async_player`). Raises `PlayerError`."""
    for start in _STARTERS.values():
        player = start(cfg, generator, tokenizer, envs_list, closables, logger, rank, asynchronous, vocab_size)
        if player is not None:
            return player
    return None
