"""Sample selection: DAPO dynamic sampling and overlong filtering.

A *batch* here is a `grpo.batch.TrainBatch`: rows are selected and concatenated with `grpo.batch.select_rows` /
`concat_batches`.
"""

from __future__ import annotations

from typing import Optional

import torch

from grpo.advantages import baseline_and_std_per_prompt, group_index
from grpo.batch import TrainBatch, batch_size, concat_batches, select_rows, spread_to_rows


def overlong_filter_mask(truncated_b: torch.Tensor, sample_mask_b: torch.Tensor) -> torch.Tensor:
    """DAPO overlong filtering: sample_mask' = sample_mask · (1 − truncated).

    Truncated samples leave the loss but stay in the baseline: compute advantages with the
    valid_mask you had before this call (not with the new sample_mask).
    """
    return sample_mask_b * (~torch.as_tensor(truncated_b, dtype=torch.bool, device=sample_mask_b.device)).to(
        sample_mask_b.dtype
    )


# --------------------------------------------------------------------------------------------------
# DAPO dynamic sampling
# --------------------------------------------------------------------------------------------------
def group_reward_std(prompt_ids: torch.Tensor, task_rewards: torch.Tensor,
                     valid_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Per-sample std of its prompt group's task reward over the group's valid members, for dynamic sampling's
    filter (``valid_mask`` ``[B]``, default all valid: a failed or flagged sample's reward is no evidence that
    the group varies; an invalid sample gets std 0, so a group with fewer than two valid members is dropped).

    ``task_rewards``: ``[B]`` rewards, or ``[B, K]`` GDPO components (one std per component, ``[B, K]``),
    after penalties and scaling but BEFORE reward shaping: DAPO filters on accuracy, and NeMo-RL
    ("run dynamic sampling on unshaped rewards") takes the std of ``unshaped_total_reward``, so a group
    of wrong answers whose overlong penalties differ is still dropped. Whole-group std
    (``leave_one_out=False``): every member of a group gets the same value.

        >>> group_reward_std(torch.tensor([0, 0, 1, 1]), torch.tensor([0.0, 0.0, 1.0, 0.0]))
        tensor([0.0000, 0.0000, 0.7071, 0.7071])
        >>> group_reward_std(torch.tensor([0, 0, 0]), torch.tensor([1.0, 1.0, 0.0]), torch.tensor([1.0, 1.0, 0.0]))
        tensor([0., 0., 0.])
    """
    valid_b = (torch.ones(task_rewards.shape[0], dtype=task_rewards.dtype, device=task_rewards.device)
               if valid_mask is None else valid_mask.to(task_rewards.dtype))
    if task_rewards.dim() == 1:
        return baseline_and_std_per_prompt(prompt_ids, task_rewards, valid_b, leave_one_out=False)[1]
    return torch.stack([baseline_and_std_per_prompt(prompt_ids, task_rewards[:, k], valid_b, leave_one_out=False)[1]
                        for k in range(task_rewards.shape[1])], dim=1)


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling gave up: the batch is still not full after ``dynamic_sampling_max_gen_batches``."""


class DynamicSamplingCache:
    """Accumulates prompt groups with non-zero reward std until one training batch is full.

        cache = DynamicSamplingCache(num_prompts, num_generations, max_gen_batches)
        while (train_batch := cache.add(batch, prompt_ids, std)[0]) is None:
            batch, prompt_ids, std = generate_more()      # a fresh generation batch

    ``add`` keeps the groups (rows sharing a prompt id *within that call*: `grpo.batch.TrainBatch.prompt_groups`,
    the estimators' groups, so a prompt drawn twice is one group of 2 · num_generations rows) where any
    ``std_b > 0`` (``std`` ``[B]``, or ``[B, K]`` per GDPO component: a group is kept when any component varies)
    and appends them to the cache. Once the cache holds ``num_prompts · num_generations`` rows it
    returns exactly that many (whole groups, in arrival order; the last may be cut as NeMo-RL cuts its rows) with
    ``group_ids_b`` the prompt slots 0..num_prompts−1 (each run of ``num_generations`` kept rows one slot, unique
    across the generation batches that fed it), discards the rest (as NeMo-RL does), and starts over for the
    next step. As NeMo-RL, it gives up (RuntimeError) when the
    batch is still not full after ``max_gen_batches + 1`` generation batches: NeMo-RL counts the batch
    before generating it and raises once the count exceeds ``dynamic_sampling_max_gen_batches``.

    Pass :func:`group_reward_std` of the unshaped task reward (GDPO: of the unshaped components).
    Differences from NeMo-RL: whole groups are kept or dropped (NeMo-RL keeps the rows whose own std is
    non-zero, and with its default leave-one-out std the only correct answer of a group, whose
    siblings all agree, gets std 0 and is dropped); GDPO filters per component (NeMo-RL on the total).

    Metrics of each call: dynamic_sampling_num_gen_batches (batches fed so far this step),
    dynamic_sampling_num_discarded_zero_std_samples (rows dropped for zero std so far this step),
    dynamic_sampling_num_discarded_valid_samples (overflow rows dropped when the batch completed),
    dynamic_sampling_num_cached_samples. ``pad_values``: per-field right-padding values when generation
    batches have different lengths (see :func:`concat_batches`; default 0).
    """

    def __init__(self, num_prompts_per_step: int, num_generations_per_prompt: int, max_gen_batches: int,
                 pad_values: Optional[dict[str, float]] = None):
        self.pad_values = pad_values
        self.num_generations = num_generations_per_prompt
        self.target = num_prompts_per_step * num_generations_per_prompt
        self.max_gen_batches = max_gen_batches
        self.reset()

    def reset(self) -> None:
        """Forget the cached groups and counters (start of a step)."""
        self.cached: list[TrainBatch] = []
        self.num_cached = 0
        self.num_gen_batches = 0
        self.num_zero_std = 0

    def add(self, batch: TrainBatch, prompt_ids: torch.Tensor, std_b: torch.Tensor
            ) -> tuple[Optional[TrainBatch], dict]:
        """Feed one generation batch; return (training batch or None, metrics). ``std_b``: ``[B]`` or
        ``[B, K]`` (see the class doc)."""
        size = batch_size(batch)
        if prompt_ids.shape[0] != size or std_b.shape[0] != size:
            raise ValueError(f"DynamicSamplingCache.add: batch has {size} rows, prompt_ids {prompt_ids.shape[0]}, "
                             f"std {std_b.shape[0]}")
        self.num_gen_batches += 1
        gid, num_groups = group_index(prompt_ids)
        gid = gid.cpu()
        first_b = batch.first_rows().cpu()  # samples are counted, not rows: a sample's branch rows go with it
        group_sizes = torch.bincount(gid[first_b], minlength=num_groups)
        if num_groups and (group_sizes % self.num_generations != 0).any():
            raise ValueError(
                f"DynamicSamplingCache.add: every prompt group must have a multiple of grpo.num_generations_per_prompt="
                f"{self.num_generations} rows (a prompt drawn k times is one group of k·n), got group sizes "
                f"{sorted(set(group_sizes.tolist()))}"
            )
        varies_b = (std_b.cpu() > 0).reshape(size, -1).any(dim=1)
        group_keep = torch.zeros(num_groups).index_add_(0, gid, varies_b.float()) > 0
        # Keep whole groups, in order of their first row.
        first_row = torch.full((num_groups,), size, dtype=torch.long).scatter_reduce(
            0, gid, torch.arange(size), reduce="amin")
        kept_groups = [g for g in torch.argsort(first_row).tolist() if group_keep[g]]
        rows = [i for g in kept_groups for i in (gid == g).nonzero().flatten().tolist()]
        kept_samples = int(first_b[rows].sum()) if rows else 0
        self.num_zero_std += int(first_b.sum()) - kept_samples
        if rows:
            kept = select_rows(batch, rows)
            sample_s = torch.arange(kept_samples)  # the kept samples in order; a branch row takes its sample's slot
            slots = spread_to_rows(kept, self.num_cached // self.num_generations + sample_s // self.num_generations)
            kept = kept.replace(group_ids_b=slots)
            self.cached.append(kept)
            self.num_cached += kept_samples

        metrics = {
            "dynamic_sampling_num_gen_batches": self.num_gen_batches,
            "dynamic_sampling_num_discarded_zero_std_samples": self.num_zero_std,
            "dynamic_sampling_num_discarded_valid_samples": 0,
            "dynamic_sampling_num_cached_samples": self.num_cached,
        }
        if self.num_cached < self.target:
            if self.num_gen_batches > self.max_gen_batches:
                raise DynamicSamplingExhausted(
                    f"dynamic sampling: only {self.num_cached} of {self.target} samples with non-zero reward std after "
                    f"{self.num_gen_batches} generation batches (grpo.dynamic_sampling_max_gen_batches="
                    f"{self.max_gen_batches}). Raise grpo.dynamic_sampling_max_gen_batches or grpo.batch_multiplier, "
                    "or use easier/more diverse prompts."
                )
            return None, metrics
        full = concat_batches(self.cached, self.pad_values)
        metrics["dynamic_sampling_num_discarded_valid_samples"] = self.num_cached - self.target
        sample_b = torch.cumsum(full.first_rows().to(torch.long), 0) - 1  # the sample of each row, in order
        out = select_rows(full, sample_b.cpu() < self.target)  # the first target samples, with their branch rows
        self.reset()
        return out, metrics
