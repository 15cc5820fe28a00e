"""The async producer stops at once when the generation ranks are gone (`RemoteGeneration.broken`), whatever
``grpo.async_grpo.max_generation_failures`` allows: a retry on the next prompts would fail the same way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from grpo.run.producer import RolloutProducer
from grpo.system.data import LoaderMark
from grpo.system.generation.base import GenerationBackend
from grpo.system.replay import ReplayBuffer, ReplayClosed, StopKind, WeightStage
from grpo.system.rollout import RolloutError


class _Generator(GenerationBackend):
    """A remote backend whose rollout fails; ``broken`` says whether the bridge is gone."""

    loads_staged_weights = True

    def __init__(self, broken: str | None):
        self.broken = broken
        self.stats = {}

    def load_staged(self, stage, mid_request: bool = False) -> int:
        return 0


class _Prompts:
    def next(self):
        return [object()]

    def mark(self):
        return LoaderMark(0)


def _producer(monkeypatch, broken: str | None, max_failures: int):
    calls = []

    def failing_rollout(*args, **kwargs):
        calls.append(1)
        raise RolloutError("rank 0: BridgeError: bridge waiting for generation rank 0: it is gone")

    monkeypatch.setattr("grpo.run.run.run_rollout", failing_rollout)
    async_cfg = SimpleNamespace(max_trajectory_age_steps=1, max_generation_failures=max_failures,
                                in_flight_weight_updates=False)
    run = SimpleNamespace(cfg=SimpleNamespace(grpo=SimpleNamespace(async_grpo=async_cfg)), total_steps=10,
                          logger=SimpleNamespace(write=lambda text: None), deferred=None, player=None)
    stage, buffer = WeightStage(), ReplayBuffer(max_age_steps=1)
    stage.publish([], version=0)
    producer = RolloutProducer(run, stage, buffer, _Generator(broken), envs=None, prompts=_Prompts(),
                               first_target=1)
    return producer, buffer, calls


def test_a_broken_bridge_stops_the_producer_at_the_first_failure(monkeypatch):
    producer, buffer, calls = _producer(monkeypatch, broken="bridge waiting for generation rank 0: it is gone",
                                        max_failures=5)
    producer._loop()
    assert len(calls) == 1  # no retry
    with pytest.raises(ReplayClosed) as err:
        buffer.take(1, 1, timeout=1)
    assert err.value.kind is StopKind.FAILURES and "generation rank 0" in str(err.value)


def test_an_ordinary_rollout_failure_is_still_retried_up_to_the_limit(monkeypatch):
    producer, buffer, calls = _producer(monkeypatch, broken=None, max_failures=2)
    producer._loop()
    assert len(calls) == 3  # two tolerated, the third stops the run
    with pytest.raises(ReplayClosed) as err:
        buffer.take(1, 1, timeout=1)
    assert err.value.kind is StopKind.FAILURES and "3 consecutive failures" in str(err.value)
