"""grpo.batch: trajectories -> padded [B, T] tensors; row selection, sharding, micro-batches."""

import pytest
import torch

from grpo.batch import batch_size, build_batch, concat_batches, micro_batches, rank_slice, select_rows
from grpo.trajectory import Message, Trajectory
from tests.helpers.batches import train_batch


def traj(group_id, prompt, completion, reward=0.0, **kw):
    return Trajectory(group_id, group_id, "t", "q", "a",
                      [Message("user", "q", list(prompt)), Message("assistant", "c", list(completion),
                                                                   [-0.5] * len(completion))], {}, reward=reward, **kw)


def test_concat_batches_pads_trailing_dims():
    a = train_batch(input_ids_bt=torch.ones(1, 2, dtype=torch.long), task_names=["x"])
    b = train_batch(input_ids_bt=torch.full((2, 3), 2), task_names=["y", "z"])
    out = concat_batches([a, b], pad_values={"input_ids_bt": -1})
    assert out.input_ids_bt.tolist() == [[1, 1, -1], [2, 2, 2], [2, 2, 2]]
    assert out.attention_mask_bt.tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 1]]
    assert out.task_names == ["x", "y", "z"]
    with pytest.raises(ValueError, match="different fields"):  # a field set in one batch and None in another
        concat_batches([a, b.replace(advantages_bt=torch.zeros(2, 3))])


def test_select_rows_and_batch_size():
    batch = train_batch(raw_rewards_b=torch.tensor([10.0, 11.0, 12.0]), task_names=["a", "b", "c"])
    assert batch_size(batch) == 3
    out = select_rows(batch, [2, 0])
    assert out.raw_rewards_b.tolist() == [12, 10] and out.task_names == ["c", "a"]
    out = select_rows(batch, torch.tensor([False, True, True]))
    assert out.raw_rewards_b.tolist() == [11, 12] and out.task_names == ["b", "c"]
    assert select_rows(batch, []).raw_rewards_b.shape == (0,)
    with pytest.raises(ValueError, match="leading sizes"):
        batch_size(batch.replace(task_names=["a"]))


def test_build_batch_right_pads_and_carries_per_sample_fields():
    b = build_batch([traj(0, [1, 4], [7, 2], 1.0, truncated=True), traj(1, [1], [9, 9, 9], 0.0,
                                                                         reward_components={"fmt": 0.5})], pad_id=0)
    assert b.input_ids_bt.tolist() == [[1, 4, 7, 2], [1, 9, 9, 9]]
    assert b.attention_mask_bt.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    assert b.token_mask_bt.tolist() == [[0, 0, 1, 1], [0, 1, 1, 1]]
    assert b.group_ids_b.tolist() == [0, 1] and b.raw_rewards_b.tolist() == [1.0, 0.0]
    assert b.response_lengths_b.tolist() == [2, 3] and b.truncated_b.tolist() == [True, False]
    assert b.component_names == ("fmt",) and b.reward_components_bk.tolist() == [[0.0], [0.5]]


def test_sharding_and_micro_batches_trim_to_their_own_longest_row():
    trajs = [traj(i, [1], [5] * (i + 1)) for i in range(5)]
    b = build_batch(trajs, pad_id=0)
    assert b.input_ids_bt.shape == (5, 6)
    shards = [b.shard(r, 2) for r in range(2)]
    assert [len(s) for s in shards] == [3, 2] and [s.input_ids_bt.shape[1] for s in shards] == [4, 6]
    assert [rank_slice(5, r, 2) for r in range(2)] == [slice(0, 3), slice(3, 5)]
    mbs = b.micro_batches(2)
    assert [len(m) for m in mbs] == [2, 2, 1] and [m.input_ids_bt.shape[1] for m in mbs] == [3, 5, 6]
    assert mbs[1].message_spans == b.message_spans[2:4] and mbs[2].task_names == ["t"]
    assert [m.input_ids_bt.shape[1] for m in micro_batches(b, 2)] == [3, 5, 6]


def test_select_and_concat_work_on_train_batches():
    b = build_batch([traj(i, [1], [5] * (i + 1), float(i)) for i in range(3)], pad_id=0)
    picked = select_rows(b, torch.tensor([True, False, True]))
    assert picked.raw_rewards_b.tolist() == [0.0, 2.0] and picked.message_spans == [b.message_spans[0],
                                                                                      b.message_spans[2]]
    both = concat_batches([picked.trim(), b.select([1])])
    assert len(both) == 3 and both.input_ids_bt.shape == (3, 4) and both.raw_rewards_b.tolist() == [0.0, 2.0, 1.0]
