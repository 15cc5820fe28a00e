"""The core's seams (grpo/__init__.py, layer 7): what a wing registers is what the run finds, and a name whose
wing is not loaded fails with one line instead of a KeyError deep in the factory."""

from __future__ import annotations

import pytest

from grpo.config import EnvConfig
from grpo.system import deferred, players
from grpo.tasks import factory
from grpo.tasks.function import EnvError
from grpo.trajectory import Message, Trajectory


def test_every_wing_registers_what_the_config_names():
    """The wings the run loads (tests/conftest.py loads them as run_setup does) provide env.name agent,
    reward_model and nemo_gym, a player and a deferred scorer."""
    assert {"agent", "reward_model", "nemo_gym"} <= set(factory._WING_ENVIRONMENTS)
    assert "endpoint" in players._STARTERS and "reward_model" in deferred._FACTORIES


def test_a_wing_environment_whose_wing_is_not_loaded_fails_naming_the_key(monkeypatch):
    monkeypatch.setattr(factory, "_WING_ENVIRONMENTS", {})
    with pytest.raises(EnvError, match=r"env.name='agent': no environment is registered .*grpo.wings.load"):
        factory.build_environment(EnvConfig(name="agent", agent={"fn": "m:f"}))


def test_the_first_starter_that_returns_a_player_is_the_run_s(monkeypatch):
    calls = []

    def none(*args):
        calls.append("none")

    def mine(*args):
        calls.append("mine")
        return "player"

    monkeypatch.setattr(players, "_STARTERS", {})
    assert players.start_player(None, None, None, [], [], None, 0, False, 0) is None
    players.register_player("a", none)
    players.register_player("b", mine)
    assert players.start_player(None, None, None, [], [], None, 0, False, 0) == "player" and calls == ["none", "mine"]


class Counting:
    """A deferred scorer with ``n`` things to score that says it took ``s`` seconds."""

    on_trainer_thread = False

    def __init__(self, n: int, s: float):
        self.n, self.s, self.scored = n, s, 0

    def __len__(self) -> int:
        return self.n

    def place(self, log=None) -> None:
        pass

    def score_pending(self, trajectories) -> float:
        self.scored += 1
        return self.s

    def close(self) -> None:
        pass


def test_the_scoring_point_runs_only_the_scorers_with_something_to_score(monkeypatch):
    monkeypatch.setattr(deferred, "_FACTORIES", {})
    deferred.register_deferred_scorer("idle", lambda device, policy, world_size: Counting(0, 5.0))
    deferred.register_deferred_scorer("busy", lambda device, policy, world_size: Counting(2, 1.5))
    scorers = deferred.DeferredScorers("cpu")
    assert len(scorers) == 2 and scorers.score_pending([]) == 1.5
    assert scorers["idle"].scored == 0 and scorers["busy"].scored == 1
    monkeypatch.setattr(deferred, "_FACTORIES", {})
    assert not deferred.DeferredScorers("cpu")  # nothing registered: no scoring point (the run passes None)


def test_a_gym_batch_gets_the_gym_wing_s_reward_transform_and_others_the_built_in_penalties():
    from grpo.rewards import reward_transform
    from grpo.wings.gym.rewards import RESULT_KEY

    plain = Trajectory(0, 0, "t", "q", "", [Message("user", "q", [1])], {})
    gym = Trajectory(0, 1, "t", "q", "", [Message("user", "q", [1])], {RESULT_KEY: {}})
    assert reward_transform([plain]) is None
    assert reward_transform([plain, gym]) is not None
