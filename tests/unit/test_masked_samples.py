"""Issue 31: a failed (or flagged) sample is masked, never scored: per estimator, the advantages of a group with
invalid members equal those of the same batch with those members removed, bit for bit, and an invalid sample's
loss contribution is zero."""

from __future__ import annotations

import pytest
import torch

from grpo.advantages import (
    drop_thin_groups, gdpo_advantages, grpo_advantages, reinforce_plus_plus_advantages,
)
from grpo.batch import build_batch
from grpo.config.load import build_config
from grpo.dynamic_sampling import group_reward_std
from grpo.loss import clipped_pg_loss
from grpo.step import compose_advantages, failure_counts, initial_sample_mask, mask_invalid_samples
from grpo.trajectory import Failure, Message, Trajectory

# Three groups of four; samples 1, 6 and 7 failed (their "rewards" are what a failed call leaves: anything).
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
REWARDS = torch.tensor([0.3, 0.0, 1.0, 0.7, 1.0, 0.2, float("nan"), 1e30, 0.5, 0.5, 0.1, 0.9])
VALID = torch.tensor([1, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=torch.bool)
KEEP = VALID.nonzero().flatten()


def _assert_masked_equals_removed(full: torch.Tensor, removed: torch.Tensor) -> None:
    assert torch.equal(full[KEEP], removed), (full[KEEP], removed)  # exactly, not approximately
    assert (full[~VALID] == 0).all()


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_grpo_advantages_of_a_group_with_failed_members_equal_those_without_them(leave_one_out, normalize):
    full = grpo_advantages(GROUPS, REWARDS, VALID.float(), leave_one_out, normalize)
    removed = grpo_advantages(GROUPS[KEEP], REWARDS[KEEP], torch.ones(len(KEEP)), leave_one_out, normalize)
    _assert_masked_equals_removed(full, removed)
    assert torch.isfinite(full).all()


@pytest.mark.parametrize("leave_one_out", [True, False])
def test_gdpo_per_component_normalisation_reads_only_valid_members(leave_one_out):
    comps = torch.stack([REWARDS, torch.tensor([1.0, -5.0, 0.0, 1.0, 0.0, 1.0, float("inf"), 3.0, 1.0, 0.0, 0.0,
                                                1.0])], dim=1)
    full = gdpo_advantages(GROUPS, comps, VALID.float(), weights=[1.0, 0.5], leave_one_out=leave_one_out)
    removed = gdpo_advantages(GROUPS[KEEP], comps[KEEP], torch.ones(len(KEEP)), weights=[1.0, 0.5],
                              leave_one_out=leave_one_out)
    _assert_masked_equals_removed(full, removed)


@pytest.mark.parametrize("minus_baseline", [True, False])
@pytest.mark.parametrize("with_kl", [True, False])
def test_reinforce_plus_plus_baseline_and_whitening_read_only_valid_members(minus_baseline, with_kl):
    g = torch.Generator().manual_seed(3)
    token_mask = (torch.rand(12, 5, generator=g) > 0.3).float()
    token_mask[:, 0] = 1.0
    kl = torch.rand(12, 5, generator=g)
    kl[~VALID] = float("nan")  # whatever the failed rows hold
    sample_mask = torch.ones(12)
    sample_mask[2] = 0.0  # masked out of the loss for another reason (overlong): still in its baseline
    full = reinforce_plus_plus_advantages(GROUPS, REWARDS, VALID.float(), token_mask, minus_baseline,
                                          kl if with_kl else None, 0.1, sample_mask=sample_mask)
    removed = reinforce_plus_plus_advantages(GROUPS[KEEP], REWARDS[KEEP], torch.ones(len(KEEP)), token_mask[KEEP],
                                             minus_baseline, kl[KEEP] if with_kl else None, 0.1,
                                             sample_mask=sample_mask[KEEP])
    _assert_masked_equals_removed(full, removed)


def test_a_group_left_with_fewer_than_two_valid_members_is_dropped_and_counted():
    valid = torch.tensor([1, 0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 1], dtype=torch.bool)
    kept, dropped = drop_thin_groups(GROUPS, valid)
    assert dropped == 1 and not kept[:4].any() and torch.equal(kept[4:], valid[4:])
    # A group that lost nobody stays, one member or many (one generation per prompt is a valid setup).
    kept, dropped = drop_thin_groups(torch.tensor([0, 1, 2]), torch.ones(3))
    assert kept.all() and dropped == 0
    assert drop_thin_groups(torch.tensor([0, 1]), torch.tensor([1.0, 0.0]))[1] == 1  # a lone failed sample


def test_dynamic_sampling_reads_the_std_of_the_valid_members():
    # Group 0: the valid members agree (1, 1), the failed one scored 0: no variance, no signal.
    std = group_reward_std(torch.tensor([0, 0, 0, 1, 1]), torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0]),
                           torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0]))
    assert (std[:3] == 0).all() and (std[3:] > 0).all()


# ---- through the step: build_batch -> mask_invalid_samples -> compose_advantages -> loss --------------------
def traj(group: int, reward: float, completion: list[int], error: str | None = None, mask_sample=False,
         retries=0) -> Trajectory:
    messages = [Message("user", "p", [1, 10 + group]), Message("assistant", "a", completion, [-0.5] * len(completion))]
    return Trajectory(group, group, "t", "q", "a", messages, {}, reward=reward, turns=1,
                      failure=None if error is None else Failure.of(error, "boom", "infra"),
                      retries=retries, mask_sample=mask_sample, num_prompt_messages=1)


def _trajectories():
    out = []
    for b in range(12):
        error = {1: "reward_error", 6: "env_timeout", 7: "env_timeout"}.get(b)
        out.append(traj(b // 4, float(REWARDS[b]) if error is None else None, [7, 8, 2 + b % 3][: 2 + b % 2],
                        error=error, retries=2 if error else b % 2))
    return out


@pytest.mark.parametrize("estimator", ["grpo", "gdpo", "reinforce_plus_plus"])
def test_a_failed_sample_leaves_the_step_exactly_and_adds_nothing_to_the_loss(estimator):
    trajs = _trajectories()
    if estimator == "gdpo":
        for t in trajs:
            t.reward_components = {"a": t.reward, "b": float(t.group_id == 1)} if t.scored else None
    cfg = build_config({"grpo": {"adv_estimator": {"name": estimator}}, "loss_fn": {"reference_policy_kl_penalty": 0.0}})

    def advantages(ts):
        batch, counts = mask_invalid_samples(build_batch(ts, pad_id=0))
        batch = batch.replace(sample_mask_b=initial_sample_mask(cfg, batch))
        adv_bt, mask_b, _ = compose_advantages(cfg, batch)
        return batch, adv_bt, mask_b, counts

    full, adv, mask, counts = advantages(trajs)
    clean, adv_clean, mask_clean, _ = advantages([t for t in trajs if t.scored])
    assert counts == {"rollout/failed_samples": 3, "rollout/retries": 6 + 4, "rollout/failed_samples/env_timeout": 2,
                      "rollout/failed_samples/reward_error": 1, "rollout/masked_samples": 3, "rollout/dropped_groups": 0}
    assert torch.equal(full.valid_b, VALID) and torch.equal(mask, VALID.float())
    T = adv_clean.shape[1]
    assert torch.equal((adv * full.token_mask_bt)[KEEP][:, :T], adv_clean * clean.token_mask_bt)
    assert (adv[~VALID] * full.token_mask_bt[~VALID] == 0).all()

    # The loss: the same value with or without the failed rows, and no gradient reaches them.
    loss_cfg = cfg.loss_fn
    logprobs = (-torch.rand(full.token_mask_bt.shape, generator=torch.Generator().manual_seed(1))).requires_grad_()
    loss, _ = clipped_pg_loss(logprobs, full.generation_logprobs_bt, adv, full.token_mask_bt, mask, loss_cfg)
    loss_clean, _ = clipped_pg_loss(logprobs[KEEP][:, :T], clean.generation_logprobs_bt, adv_clean,
                                    clean.token_mask_bt, mask_clean, loss_cfg)
    assert torch.allclose(loss, loss_clean, rtol=0, atol=1e-7)
    loss.backward()
    assert (logprobs.grad[~VALID] == 0).all() and logprobs.grad[KEEP].abs().sum() > 0


def test_flagged_samples_leave_the_baseline_unless_should_mask_flagged_samples_is_false():
    trajs = [traj(0, r, [7, 2], mask_sample=(b == 0)) for b, r in enumerate([1.0, 0.0, 1.0, 0.5])]
    cfg = build_config({})
    assert cfg.env.should_mask_flagged_samples is True
    masked, _ = mask_invalid_samples(build_batch(trajs, pad_id=0))
    adv, mask, _ = compose_advantages(cfg, masked.replace(sample_mask_b=initial_sample_mask(cfg, masked)))
    without, _ = mask_invalid_samples(build_batch(trajs[1:], pad_id=0))
    adv_without, _, _ = compose_advantages(cfg, without)
    assert mask.tolist() == [0.0, 1.0, 1.0, 1.0] and torch.equal(adv[1:], adv_without)

    kept = build_batch(trajs, pad_id=0, mask_flagged=False)  # NeMo-RL's false: the flag is not honoured
    assert kept.valid_b.all() and initial_sample_mask(cfg, kept).tolist() == [1.0] * 4


def test_failure_counts_name_each_reason():
    counts = failure_counts(_trajectories())
    assert counts["rollout/failed_samples/env_timeout"] == 2 and counts["rollout/failed_samples/reward_error"] == 1
