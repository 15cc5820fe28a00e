"""A `grpo.batch.TrainBatch` of just the fields a test cares about, for tests of the row operations and the
training step that need no rollout: every other per-row field is filled with a neutral value."""

from __future__ import annotations

import torch

from grpo.batch import TrainBatch


def train_batch(**fields) -> TrainBatch:
    """A TrainBatch with ``fields`` (any of its own, B rows each) and the rest neutral: ``[B, T]`` ids 0, attention
    and token masks 1 (T from a given ``_bt`` field, else 1), rewards 0, every sample trained, group ids 0..B-1,
    task ``"t"``.

        >>> b = train_batch(rewards_b=torch.tensor([1.0, 0.0]))
        >>> len(b), b.input_ids_bt.shape, b.task_names
        (2, torch.Size([2, 1]), ['t', 't'])
    """
    first = next(iter(fields.values()))
    B = first.shape[0] if isinstance(first, torch.Tensor) else len(first)
    T = next((v.shape[1] for k, v in fields.items() if k.endswith("_bt")), 1)
    neutral = dict(
        input_ids_bt=torch.zeros(B, T, dtype=torch.long), attention_mask_bt=torch.ones(B, T, dtype=torch.long),
        token_mask_bt=torch.ones(B, T), generation_logprobs_bt=torch.zeros(B, T),
        group_ids_b=torch.arange(B), raw_rewards_b=torch.zeros(B), rewards_b=torch.zeros(B),
        task_rewards_b=torch.zeros(B), response_lengths_b=torch.zeros(B, dtype=torch.long),
        truncated_b=torch.zeros(B, dtype=torch.bool), mask_sample_b=torch.zeros(B, dtype=torch.bool),
        scored_b=torch.ones(B, dtype=torch.bool), valid_b=torch.ones(B, dtype=torch.bool),
        sample_mask_b=torch.ones(B), branch_b=torch.zeros(B, dtype=torch.long), message_spans=[[] for _ in range(B)],
        task_names=["t"] * B,
        trajectories=[None] * B)
    return TrainBatch(**{**neutral, **fields})
