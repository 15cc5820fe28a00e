"""grpo/trajectory.py: a failed sample carries its typed `Failure` and no reward; its serialized form (checkpoints'
replay state) loads without pickle, the form before the `Failure` was kept whole included; the batch reads one
scored mask."""

import io

import pytest
import torch

from grpo.batch import build_batch
from grpo.system.replay import ReplayBuffer, groups_from_trajectories, trajectories_from_groups
from grpo.trajectory import UNSCORED_REWARD, Failure, Message, Trajectory


def sample(group: int, reward: float = 1.0) -> Trajectory:
    return Trajectory(group, 10 + group, "t", "q", "a", [Message("user", "q", [1, 2 + group]),
                                                         Message("assistant", "x", [7], [-0.5])], {},
                      reward=reward, num_prompt_messages=1)


def failed(group: int, reason: str = "http_5xx", detail: str = "Traceback ...\n503") -> Trajectory:
    t = sample(group, reward=0.75)  # a reward the earlier turns had: the failure takes it away
    t.reward_components = {"a": 0.75}
    t.fail(Failure.of(reason, detail))
    return t


def test_a_failed_sample_carries_its_failure_and_no_reward():
    t = failed(0)
    assert t.failure == Failure("http_5xx", "infra", "Traceback ...\n503")
    assert (t.reward, t.reward_components, t.scored, t.done) == (None, None, False, True)
    assert sample(0).scored and sample(0).failure is None


def test_a_failed_sample_survives_a_checkpoint_of_the_replay_deque_without_pickle():
    trajs = [sample(0), failed(0, "env_timeout", "no answer in 5 s")]
    buf = ReplayBuffer(max_age_steps=2)
    groups = groups_from_trajectories(trajs)
    buf.put(groups, [g.version for g in groups], target_version=1)
    f = io.BytesIO()
    torch.save(buf.state_dict(), f)
    f.seek(0)
    other = ReplayBuffer(max_age_steps=2)
    other.load_state_dict(torch.load(f, weights_only=True))
    (entry,), _ = other.take(step=1, n=1)
    back = trajectories_from_groups([entry.group])
    assert back == trajs and back[1].failure == Failure("env_timeout", "infra", "no answer in 5 s")
    assert back[1].reward is None


def test_a_trajectory_saved_with_flat_error_fields_loads_as_its_failure():
    """Checkpoints written before the Failure was kept whole hold ``error`` / ``failure_kind`` / ``error_detail``
    and a failed sample's reward 0.0."""
    old = sample(0).to_dict()
    del old["failure"]
    ok = {**old, "error": None, "error_detail": None, "failure_kind": None}
    bad = {**old, "reward": 0.0, "error": "reward_error", "error_detail": "ValueError: down", "failure_kind": "data"}
    no_kind = {**bad, "failure_kind": None, "error": "env_timeout"}
    assert Trajectory.from_dict(ok) == sample(0)
    t = Trajectory.from_dict(bad)
    assert (t.failure, t.reward, t.scored) == (Failure("reward_error", "data", "ValueError: down"), None, False)
    assert Trajectory.from_dict(no_kind).failure.kind == "infra"  # the reason's own class


def test_the_batch_reads_one_scored_mask_and_fills_a_missing_reward_once():
    batch = build_batch([sample(0, 1.0), failed(0), sample(1, 0.0)], pad_id=0)
    assert batch.scored_b.tolist() == [True, False, True]
    assert batch.valid_b.tolist() == [True, False, True]
    assert batch.raw_rewards_b.tolist() == [1.0, UNSCORED_REWARD, 0.0]
    assert batch.select([1, 2]).scored_b.tolist() == [False, True]  # rows follow every selection


def test_no_reward_exactly_when_failed():
    built = Trajectory(0, 0, "t", "q", "a", [], {}, reward=0.5, reward_components={"a": 0.5},
                       failure=Failure.of("env_error", "boom"))
    assert (built.reward, built.reward_components) == (None, None)
    with pytest.raises(ValueError, match="reward None without a failure"):
        Trajectory(0, 7, "t", "q", "a", [], {}, reward=None)
