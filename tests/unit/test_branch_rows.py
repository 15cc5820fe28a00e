"""A sample trained as several rows (``Trajectory.branches``: an agent that rewrote its history): its reward and
advantage on every row, the sample counted once in its group's statistics (baseline, std, thin groups, dynamic
sampling, optimizer steps), and a sample without branches exactly the row it always was."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo.batch import build_batch, sample_chunks
from grpo.config.load import build_config
from grpo.dynamic_sampling import DynamicSamplingCache
from grpo.step import compose_advantages, group_std_for_dynamic_sampling, initial_sample_mask, mask_invalid_samples
from grpo.trajectory import Message, Trajectory
from grpo.wings.agents.branches import branch_messages, grow_branches
from grpo.wings.agents.endpoint import CallRecord
from grpo.wings.agents.environment import AgentOutcome
from grpo.wings.agents.player import Played, fill_trajectory, trajectory_messages


def _calls(*pairs):
    return [CallRecord(list(p), list(g), [-0.25 * (i + 1) for i in range(len(g))], "stop", 3) for p, g in pairs]


CONTIGUOUS = _calls(([1, 5], [7, 7]), ([1, 5, 7, 7, 4], [8]))
COMPACTED = _calls(([1, 5], [7, 7]), ([1, 5, 7, 7, 4], [8]), ([1, 5, 9], [6, 6, 6]))  # call 3: a summary


def _sample(records, reward: float, group: int = 0) -> Trajectory:
    t = Trajectory(group, group, "agent", "q", "a", [Message("user", "q", [1, 5])], {})
    fill_trajectory(t, Played(AgentOutcome(reward=reward), records), decode=str)
    return t


def _todays(records, reward: float, group: int = 0) -> Trajectory:
    """The sample as the player built it before branches: NeMo-RL's contiguous messages."""
    messages, ok = trajectory_messages(records, decode=str)
    assert ok
    return Trajectory(group, group, "agent", "q", "a", messages, {}, reward=reward, turns=len(records),
                      num_prompt_messages=1, done=True, terminated=True, generation_version=3)


def test_a_sample_without_a_rewrite_is_exactly_today_s_contiguous_row():
    new, old = _sample(CONTIGUOUS, 1.0), _todays(CONTIGUOUS, 1.0)
    assert new.branches == [] and new.messages == old.messages and not new.mask_sample
    a, b = build_batch([new, _sample(CONTIGUOUS, 0.0)], pad_id=0), build_batch([old, _todays(CONTIGUOUS, 0.0)], 0)
    for name, value in vars(a).items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, getattr(b, name)), name
    assert a.branch_b.tolist() == [0, 0] and a.message_spans == b.message_spans and len(a) == 2


def test_a_compacted_sample_is_two_rows_each_generated_token_trained_once():
    t = _sample(COMPACTED, 1.0)
    assert len(t.branches) == 1 and not t.mask_sample and t.metadata["agent_branches"] == 2
    b = build_batch([t], pad_id=0)
    assert b.branch_b.tolist() == [0, 1] and b.raw_rewards_b.tolist() == [1.0, 1.0]
    assert b.input_ids_bt[0].tolist() == [1, 5, 7, 7, 4, 8] and b.input_ids_bt[1, :6].tolist() == [1, 5, 9, 6, 6, 6]
    assert b.token_mask_bt[0].tolist() == [0, 0, 1, 1, 0, 1] and b.token_mask_bt[1].tolist() == [0, 0, 0, 1, 1, 1]
    assert int(b.token_mask_bt.sum()) == t.num_generated_tokens == 6  # 2 + 1 + 3 generated, each once
    assert b.generation_logprobs_bt[1, 3:6].tolist() == [-0.25, -0.5, -0.75]
    assert b.response_lengths_b.tolist() == [6, 6]  # the sample's, on each of its rows


def test_a_failed_sample_keeps_no_branch_row():
    t = Trajectory(0, 0, "agent", "q", "a", [], {})
    from grpo.trajectory import Failure
    fill_trajectory(t, Played(AgentOutcome(failure=Failure.of("env_timeout")), COMPACTED), decode=str)
    assert t.branches == [] and not t.scored and len(build_batch([t], pad_id=0)) == 1


def _group():
    """One prompt, three samples: a branched one (reward 1), two plain ones (0 and 0.5); and another prompt's two."""
    return [_sample(COMPACTED, 1.0), _sample(CONTIGUOUS, 0.0), _sample(CONTIGUOUS, 0.5),
            _sample(_calls(([1, 6], [7])), 1.0, group=1), _sample(_calls(([1, 6], [8])), 0.0, group=1)]


@pytest.mark.parametrize("estimator", ["grpo", "gdpo", "reinforce_plus_plus"])
def test_the_sample_is_counted_once_and_its_advantage_is_on_every_row(estimator):
    cfg = build_config({"grpo": {"adv_estimator": {"name": estimator}}})
    trajs = _group()
    for k, t in enumerate(trajs):  # GDPO reads two components
        t.reward_components = {"x": t.reward, "y": float(k % 2)}
    flat = copy.deepcopy(trajs)
    flat[0].branches = []  # the same samples, one row each: the statistics must not see the branch row
    adv, ref = [], []
    for ts, out in ((trajs, adv), (flat, ref)):
        b, counts = mask_invalid_samples(build_batch(ts, pad_id=0))
        a_bt, _, _ = compose_advantages(cfg, b.replace(sample_mask_b=initial_sample_mask(cfg, b)))
        out.append((b, counts, a_bt))
    (b, counts, a_bt), (fb, fcounts, f_bt) = adv[0], ref[0]
    assert b.branch_b.tolist() == [0, 1, 0, 0, 0, 0] and counts == fcounts
    assert b.prompt_groups().tolist() == [0, 0, 0, 0, 1, 1]  # the branch row is in its sample's group
    first = b.first_rows()
    mask = b.token_mask_bt[first].bool()
    assert torch.equal(a_bt[first][mask], f_bt[:, :a_bt.shape[1]][mask])  # the same advantages as one row each
    sample_adv = a_bt[0][b.token_mask_bt[0].bool()]
    assert sample_adv.abs().sum() > 0 and torch.equal(a_bt[1][b.token_mask_bt[1].bool()],
                                                      sample_adv[:1].expand(3))  # its advantage on its branch


def test_dynamic_sampling_counts_samples_and_keeps_a_sample_s_rows_together():
    b, _ = mask_invalid_samples(build_batch(_group()[:2] + [_sample(_calls(([1, 6], [7])), 1.0, group=1),
                                                            _sample(_calls(([1, 6], [8])), 1.0, group=1)], pad_id=0))
    std = group_std_for_dynamic_sampling(b)
    assert std.tolist()[:3] == [pytest.approx(0.7071, abs=1e-4)] * 3 and std.tolist()[3:] == [0.0, 0.0]
    kept, metrics = DynamicSamplingCache(1, 2, 1).add(b, b.prompt_groups(), std)
    assert kept.branch_b.tolist() == [0, 1, 0] and kept.group_ids_b.tolist() == [0, 0, 0]
    assert metrics["dynamic_sampling_num_discarded_zero_std_samples"] == 2


def test_an_optimizer_step_takes_whole_samples_with_their_branch_rows():
    b = build_batch(_group(), pad_id=0)
    chunks = [b.branch_b[rows].tolist() for rows in sample_chunks(b, 2)]
    assert chunks == [[0, 1, 0], [0, 0], [0]]
    plain = build_batch(_group()[1:], pad_id=0)
    assert sample_chunks(plain, 2) == [slice(0, 2), slice(2, 4)]


def test_branches_survive_the_replay_deque_s_round_trip():
    t = _sample(COMPACTED, 1.0)
    back = Trajectory.from_dict(t.to_dict())
    assert back.branches == t.branches and back.messages == t.messages
    assert branch_messages(grow_branches(COMPACTED)[1], decode=str) == back.branches[0]


def test_the_step_s_metrics_and_dumps_count_each_sample_once():
    from grpo.step import step_metrics
    from grpo.system.dumps import rollout_records

    trajs = _group()
    b = build_batch(trajs, pad_id=0)
    b = b.replace(advantages_bt=torch.ones_like(b.token_mask_bt))
    m = step_metrics(b, [{"loss": 0.0}], 1.0)
    assert m["train/num_samples"] == 5.0 and m["train/num_valid_samples"] == 5.0
    assert m["train/num_completion_tokens"] == sum(t.num_generated_tokens for t in trajs) == 6 + 3 + 3 + 1 + 1
    assert m["train/reward"] == pytest.approx(sum(t.reward for t in trajs) / 5)
    records = rollout_records(b.trajectories, "train", 1, b)
    assert [r["reward"] for r in records] == [t.reward for t in trajs]  # a record per sample, its first row's


def test_an_image_sample_whose_calls_part_is_still_its_contiguous_head_masked():
    """A branch row would need images of its own: such a sample is kept as before branches (masked, counted)."""
    records = _calls(([1, 5], [7, 7]), ([1, 5, 9], [6]))
    records[0].media = records[1].media = {"pixel_values": torch.zeros(1)}
    t = _sample(records, 1.0)
    assert t.branches == [] and t.mask_sample and t.metadata["agent_noncontiguous"]
    assert t.token_ids() == [1, 5, 7, 7] and t.media is records[0].media


def test_dynamic_sampling_cuts_a_full_batch_by_samples_with_their_branch_rows():
    trajs = [_sample(_calls(([1, 6], [7])), 1.0, group=1), _sample(_calls(([1, 6], [8])), 0.0, group=1),
             *_group()[:2]]  # the second prompt's group: a branched sample (2 rows) and a plain one
    b, _ = mask_invalid_samples(build_batch(trajs, pad_id=0))
    kept, metrics = DynamicSamplingCache(1, 2, 1).add(b, b.prompt_groups(), group_std_for_dynamic_sampling(b))
    assert kept.branch_b.tolist() == [0, 0] and metrics["dynamic_sampling_num_discarded_valid_samples"] == 2
    kept, _ = DynamicSamplingCache(1, 2, 1).add(b.select([2, 3, 4, 0, 1]), b.select([2, 3, 4, 0, 1]).prompt_groups(),
                                                group_std_for_dynamic_sampling(b.select([2, 3, 4, 0, 1])))
    assert kept.branch_b.tolist() == [0, 1, 0]  # the first two samples, the branched one with its branch row


def test_opd_scores_every_row_of_a_branched_sample_by_its_own_tokens():
    """NeMo-RL's `opd` advantage is per token of a row's own logprobs (teacher - previous policy): a branch row gets
    its own gap, not its sample's first row's spread onto it as the reward estimators' advantage is."""
    cfg = build_config({"grpo": {"adv_estimator": {"name": "opd"}},
                        "on_policy_distillation": {"enabled": True, "teacher_model_name": "toy:tiny"}})
    b, _ = mask_invalid_samples(build_batch(_group(), pad_id=0))
    g = torch.Generator().manual_seed(0)
    prev_bt, teacher_bt = (-torch.rand(b.input_ids_bt.shape, generator=g) for _ in range(2))
    b = b.replace(sample_mask_b=initial_sample_mask(cfg, b), prev_logprobs_bt=prev_bt, teacher_logprobs_bt=teacher_bt)
    a_bt, _, _ = compose_advantages(cfg, b)
    expected_bt = (teacher_bt - prev_bt) * b.token_mask_bt * b.sample_mask_b[:, None]
    assert b.branch_b.tolist()[1] == 1 and torch.equal(a_bt, expected_bt)
