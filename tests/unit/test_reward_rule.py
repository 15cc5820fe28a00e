"""One rule for what a reward is (grpo.tasks.failures.reward_problem): a number that stays finite in float32, the dtype
rewards train in. Issue 43 (9): 1e300 (finite in float64, inf in float32) from an agent, a NeMo-Gym server, a reward
model or an environment's return dropped the whole step as non-finite, or failed the whole call, where a NaN failed
only its sample: every source now fails that sample alone, at the place it catches NaN. The judge's share of it is
tests/unit/test_judge.py (a real HTTP server)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.tasks.failures import RetryPolicy
from grpo.tasks.interface import Environment, EnvironmentReturn
from grpo.tasks.router import Environments

NAN, HUGE = float("nan"), 1e300


@given(st.floats(allow_nan=True, allow_infinity=True, width=64))
def test_a_reward_is_what_float32_holds_finite(x):
    """The rule is float32's own: exactly the values torch converts to a finite float32 (the boundary included:
    halfway past the largest float32 rounds to inf)."""
    from grpo.tasks.failures import reward_problem

    assert (reward_problem(x) is None) == math.isfinite(torch.tensor(x, dtype=torch.float64).float().item())


@pytest.mark.parametrize("x", [3.4028234663852886e38, 3.4028235677973366e38, -3.4028235677973366e38,
                               3.4028235677973362e38, 1e39, True, "1"])
def test_the_float32_boundary_and_what_is_not_a_number(x):
    from grpo.tasks.failures import reward_problem

    if isinstance(x, float):
        assert (reward_problem(x) is None) == math.isfinite(torch.tensor(x, dtype=torch.float64).float().item())
    else:
        assert reward_problem(x) == f"the reward is {x if isinstance(x, bool) else repr(x)}: expected a finite number"


class Returns(Environment):
    """One turn: sample i (its message says i) gets ``rewards[i]``, in a float64 tensor as a NeMo-RL environment may
    return it (``rewards`` a dict of lists: a dict of such tensors)."""

    def __init__(self, rewards):
        self.rewards = rewards

    def step(self, message_logs, metadata):
        n, ids = len(message_logs), [int(log[-1]["content"]) for log in message_logs]

        def pick(values):
            return torch.tensor([values[i] for i in ids], dtype=torch.float64)

        rewards = {k: pick(v) for k, v in self.rewards.items()} if isinstance(self.rewards, dict) else pick(self.rewards)
        return EnvironmentReturn([{"role": "user", "content": ""}] * n, metadata, None, rewards, [True] * n, None)


def _step(rewards, n: int):
    envs = Environments({"t": Returns(rewards)}, 10.0, retry=RetryPolicy(3, 2, 0.0, 0.0))
    return envs.step("t", [[{"role": "assistant", "content": str(i)}] for i in range(n)], [{} for _ in range(n)])


def test_an_environment_s_reward_float32_cannot_hold_fails_its_sample_alone_as_nan_does():
    """A NeMo-RL environment returns a float64 tensor: 1e300 in it failed every sample of the call (check_return
    raised for the whole return); now it and NaN fail their own samples (env_malformed, retried as data), the
    others keep their rewards."""
    result = _step([1.0, NAN, HUGE, -math.inf, 2.0], 5)
    ret = result.ret
    assert [f and (f.reason, f.kind) for f in ret.failures] == [
        None, ("env_malformed", "data"), ("env_malformed", "data"), ("env_malformed", "data"), None]
    assert ret.rewards.dtype == torch.float32 and ret.rewards[[0, 4]].tolist() == [1.0, 2.0]
    assert "] is nan: expected a finite number" in ret.failures[1].detail  # (its index in the retried call)
    assert "] is 1e+300: inf as float32" in ret.failures[2].detail
    assert result.retries == [0, 1, 1, 1, 0]


def test_a_component_float32_cannot_hold_fails_its_sample_alone():
    result = _step({"a": [1.0, 2.0], "b": [HUGE, 0.5]}, 2)
    assert result.ret.failures[0].reason == "env_malformed" and result.ret.failures[1] is None
    assert "EnvironmentReturn.rewards['b'][0] is 1e+300: inf as float32" in result.ret.failures[0].detail
    assert result.ret.rewards["a"][1].item() == 2.0 and result.ret.rewards["b"][1].item() == 0.5


@pytest.mark.parametrize("bad", [NAN, HUGE])
def test_an_agent_s_reward_fails_its_sample_the_same_for_nan_and_1e300(bad):
    from grpo.wings.agents.environment import parse_result

    for value in (bad, {"reward": bad}, {"reward": 1.0, "reward_components": {"x": bad}}):
        outcome = parse_result(value)
        assert outcome.failure is not None and outcome.failure.reason == "env_malformed", value


@pytest.mark.parametrize("bad", [NAN, HUGE])
def test_a_nemo_gym_result_s_reward_is_refused_the_same_for_nan_and_1e300(bad):
    from grpo.tasks.nemo_gym import check_result

    assert "finite 'reward'" in check_result({"response": {"output": []}, "reward": bad})
    assert "finite numbers" in check_result({"response": {"output": []}, "reward": 1.0,
                                             "reward_components": {"x": bad}})


@pytest.mark.parametrize("bad", [NAN, HUGE])
def test_a_reward_function_s_value_is_refused_the_same_for_nan_and_1e300(bad):
    """(Reward functions had the float32 rule already; they now share it.)"""
    from grpo.tasks.function import to_reward

    with pytest.raises(ValueError, match="finite"):
        to_reward(bad)


@pytest.mark.parametrize("bad", [NAN, math.inf])
def test_a_reward_model_score_that_is_no_reward_fails_its_sample_at_the_scoring_point(bad):
    """A reward model in 16 bits can overflow: its NaN or inf went into the sample's reward and the health check
    skipped the whole step. The sample fails (env_malformed) and the others keep their scores."""
    from grpo.tasks.pending import PendingScore, add_score
    from grpo.trajectory import Trajectory

    good, broken = (Trajectory(i, i, "rm", "q", "a", [], {}, reward=0.5) for i in range(2))
    assert add_score(good, PendingScore(0, [1]), 1.5) is None and good.reward == 2.0
    assert add_score(broken, PendingScore(0, [1]), bad) is not None
    assert (broken.failure.reason, broken.failure.kind, broken.reward) == ("env_malformed", "data", None)
    assert "the reward model's score is" in broken.failure.detail
