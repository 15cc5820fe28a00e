"""grpo.rollout_metrics: NeMo-RL's reward/advantage summaries against direct per-group / per-token loops."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.metrics import aggregate_rollout_metrics
from grpo.rollout_metrics import (
    advantage_summary, group_reward_shares, reward_component_means, sample_token_means,
)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from([0.0, 1.0, 0.5])), min_size=1, max_size=30))
def test_group_shares_match_a_loop_over_groups(pairs):
    group_ids_b = torch.tensor([g for g, _ in pairs])
    rewards_b = torch.tensor([r for _, r in pairs])
    groups = sorted(set(group_ids_b.tolist()))
    members = [[r for g2, r in pairs if g2 == g] for g in groups]
    out = group_reward_shares(rewards_b, group_ids_b)
    assert out["baseline_reward/pct_0"] == pytest.approx(100 * sum(all(r == 0 for r in m) for m in members) / len(groups))
    assert out["baseline_reward/pct_1"] == pytest.approx(100 * sum(all(r == 1 for r in m) for m in members) / len(groups))
    assert out["baseline_reward/pct_0"] + out["baseline_reward/pct_1"] + out["baseline_reward/pct_mixed"] \
        == pytest.approx(100.0)
    assert out["baseline_reward/histogram"] == pytest.approx([sum(m) / len(m) for m in members])


def test_group_shares_of_nothing_is_empty():
    assert group_reward_shares(torch.tensor([]), torch.tensor([], dtype=torch.long)) == {}


def test_advantage_summary_counts_only_trained_tokens_of_unmasked_samples():
    advantages_bt = torch.tensor([[7.0, 2.0, 2.0, 2.0], [7.0, -1.0, 7.0, 7.0], [7.0, 3.0, 3.0, 7.0]])
    token_mask_bt = torch.tensor([[0, 1, 1, 1], [0, 1, 0, 0], [0, 1, 1, 0]])
    sample_mask_b = torch.tensor([1, 1, 0])
    out = advantage_summary(advantages_bt, token_mask_bt, sample_mask_b)
    assert out["advantages/sum"] == pytest.approx(2 + 2 + 2 - 1)
    assert out["advantages/mean"] == pytest.approx(5 / 4)
    assert out["advantages/histogram"] == pytest.approx([2.0, -1.0])


def test_advantage_summary_without_trained_tokens_is_zero():
    out = advantage_summary(torch.ones(2, 3), torch.zeros(2, 3), torch.ones(2))
    assert out == {"advantages/mean": 0.0, "advantages/sum": 0.0, "advantages/histogram": []}


def test_sample_token_means_is_nan_only_without_tokens():
    means_b = sample_token_means(torch.tensor([[1.0, 3.0], [4.0, 4.0]]), torch.tensor([[1, 1], [0, 0]]))
    assert means_b[0].item() == 2.0 and math.isnan(means_b[1].item())


def test_outputs_aggregate_across_rollouts_like_other_metrics():
    """The async loop merges per-rollout dicts with aggregate_rollout_metrics: histograms concatenate."""
    a = advantage_summary(torch.ones(2, 2), torch.ones(2, 2), torch.ones(2))
    b = advantage_summary(-torch.ones(1, 2), torch.ones(1, 2), torch.ones(1))
    merged = aggregate_rollout_metrics([a, b])
    assert merged["advantages/histogram"] == [1.0, 1.0, -1.0] and merged["advantages/mean"] == 0.0


def test_group_shares_of_a_step_read_the_scored_samples():
    """A failed sample has no reward: the group of a right answer and a failed sample is all 1, not mixed."""
    from grpo.batch import build_batch
    from grpo.rollout_metrics import step_summary
    from grpo.trajectory import Failure, Message, Trajectory

    def sample(slot, prompt, reward):
        return Trajectory(slot, slot, "t", "q", "a", [Message("user", "q", [1, prompt]),
                                                      Message("assistant", "x", [7], [-0.5])], {}, reward=reward)

    failed = sample(0, 5, 0.0)
    failed.fail(Failure.of("env_timeout"))
    batch = build_batch([sample(0, 5, 1.0), failed, sample(1, 6, 0.0), sample(1, 6, 0.0), sample(2, 6, 1.0),
                         sample(2, 6, 1.0)], pad_id=0)
    batch = batch.replace(advantages_bt=torch.zeros(6, 3))
    out = step_summary(batch)
    assert out["baseline_reward/pct_1"] == pytest.approx(200 / 3)
    assert out["baseline_reward/pct_mixed"] == pytest.approx(0.0, abs=1e-9)
    assert out["baseline_reward/histogram"] == [1.0, 0.0, 1.0]
