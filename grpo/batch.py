"""The training batch: trajectories flattened into padded ``[B, T]`` tensors, and row operations on it.

Alignment is the math contract's: per-token tensors are ``[B, T]`` (a conversation's tokens right-padded
to ``T``); position ``t`` of a logprob tensor holds the logprob of token ``t`` given the tokens before it;
``token_mask_bt`` is 1 exactly on the tokens the policy generated in this rollout (every assistant turn),
0 on prompt, prompt-history and environment tokens.

    >>> from grpo.trajectory import Message, Trajectory
    >>> t = Trajectory(0, 0, "arithmetic", "1+4=", "5", [Message("user", "1+4=", [1, 4]),
    ...                Message("assistant", "x", [7, 2], [-0.5, -0.25])], {})
    >>> b = build_batch([t], pad_id=0)
    >>> b.input_ids_bt.tolist(), b.token_mask_bt.tolist(), b.generation_logprobs_bt.tolist()
    ([[1, 4, 7, 2]], [[0.0, 0.0, 1.0, 1.0]], [[0.0, 0.0, -0.5, -0.25]])

Every rank holds the whole batch of a step (filtering, baselines and advantages are computed identically
everywhere); `TrainBatch.shard` hands each rank its contiguous slice to train on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

import torch

from grpo.advantages import prompt_group_ids
from grpo.trajectory import filled_components, filled_rewards


def rank_slice(n: int, rank: int, world_size: int) -> slice:
    """Contiguous share of ``n`` items for ``rank`` (sizes differ by at most one).

        >>> [rank_slice(5, r, 2) for r in range(2)]
        [slice(0, 3, None), slice(3, 5, None)]
    """
    per, extra = divmod(n, world_size)
    start = rank * per + min(rank, extra)
    return slice(start, start + per + (1 if rank < extra else 0))



# A message span: positions [start, end) of the [B, T] layout and the flags raised on that message.
MessageSpan = tuple[int, int, tuple[str, ...]]


@dataclass
class TrainBatch:
    """One step's samples. Per-sample fields end in ``_b`` (``[B]``), per-token fields in ``_bt``
    (``[B, T]``), ``reward_components_bk`` is ``[B, K]`` (names in ``component_names``). Optional parts
    are None until the phase that makes them has run (or when the run does not need them)."""

    input_ids_bt: torch.Tensor
    attention_mask_bt: torch.Tensor
    token_mask_bt: torch.Tensor
    generation_logprobs_bt: torch.Tensor
    group_ids_b: torch.Tensor             # its prompt's slot in the step (Trajectory.group_id; renumbered by dynamic
    #                                       sampling): counts the prompts a step consumed. NOT the group of the
    #                                       statistics: that is prompt_groups() (by prompt tokens)
    raw_rewards_b: torch.Tensor           # the environments' rewards, before penalties / scaling / shaping (a row
    #                                       not scored holds trajectory.UNSCORED_REWARD: read them under scored_b)
    rewards_b: torch.Tensor               # after them (the rewards phase)
    task_rewards_b: torch.Tensor          # after penalties and scaling, before shaping: dynamic sampling's
    response_lengths_b: torch.Tensor      # generated tokens
    truncated_b: torch.Tensor             # bool: a turn hit its length cap or the conversation ran out of room
    mask_sample_b: torch.Tensor           # bool: the environment flagged the sample (mask_sample)
    scored_b: torch.Tensor                # bool: it has a reward (Trajectory.scored: no environment or reward call
    #                                       failed for it); the one "is it scored" of the step, built once here
    valid_b: torch.Tensor                 # bool: counts in its group's statistics and may be trained (scored,
    #                                       not flagged, its group not dropped): the estimators' valid_mask
    sample_mask_b: torch.Tensor           # float: 1 = trained (the sample-mask and advantages phases set zeros)
    branch_b: torch.Tensor                # long: 0 on a sample's first row, k on the row of its branch k
    #                                       (Trajectory.branches: an agent that rewrote its history); every per-sample
    #                                       statistic reads first rows only (first_rows, spread_to_rows)
    message_spans: list[list[MessageSpan]]  # per sample, its generated assistant messages
    task_names: list[str]
    trajectories: list                    # per sample, its grpo.trajectory.Trajectory (rows follow every selection)
    reward_components_bk: Optional[torch.Tensor] = None   # shaped like rewards_b (GDPO reads them)
    task_components_bk: Optional[torch.Tensor] = None     # unshaped like task_rewards_b
    component_names: tuple[str, ...] = ()
    prev_logprobs_bt: Optional[torch.Tensor] = None
    ref_logprobs_bt: Optional[torch.Tensor] = None
    teacher_logprobs_bt: Optional[torch.Tensor] = None
    advantages_bt: Optional[torch.Tensor] = None
    unfiltered_logprobs_bt: Optional[torch.Tensor] = None  # set on micro-batches by grpo.system.training.train_on_batch
    media: Optional[list] = None          # per sample, its images' tensors or None (a VLM's; None: no sample has
    #                                       any): a list, so every row operation keeps each sample's own

    def __len__(self) -> int:
        return self.input_ids_bt.shape[0]

    def replace(self, **changes) -> TrainBatch:
        return dataclasses.replace(self, **changes)

    def select(self, index: Union[torch.Tensor, Sequence[int], slice]) -> TrainBatch:
        """Rows ``index`` (a slice, int indices in that order, or a bool mask ``[B]``) of every per-row field."""
        return select_rows(self, index)

    def trim(self) -> TrainBatch:
        return trim_padding(self)

    def shard(self, rank: int, world_size: int) -> TrainBatch:
        """This rank's contiguous slice, with shared padding trimmed."""
        return trim_padding(self.select(rank_slice(len(self), rank, world_size)))

    def micro_batches(self, size: int) -> list[TrainBatch]:
        return micro_batches(self, size)

    def prompt_groups(self) -> torch.Tensor:
        """Group ids ``[B]`` of the rows by prompt tokens (`grpo.advantages.prompt_group_ids`, the one definition of
        a group: a prompt that came twice in the batch is one group; a sample that failed before generating is in
        its prompt's group)."""
        first = self.first_rows()
        if bool(first.all()):
            return prompt_group_ids(self.input_ids_bt, self.token_mask_bt, self.attention_mask_bt)
        return spread_to_rows(self, prompt_group_ids(self.input_ids_bt[first], self.token_mask_bt[first],
                                                     self.attention_mask_bt[first]))

    def first_rows(self) -> torch.Tensor:
        """bool ``[B]``: the rows that are a sample's first branch, one per sample: the rows every per-sample
        statistic reads (a sample's further branches are not more members of its group)."""
        return self.branch_b == 0

    def samples(self) -> list:
        """The trajectories of the batch, each sample once (its first row's)."""
        return [t for t, k in zip(self.trajectories, self.branch_b.tolist()) if k == 0]

    def scored_samples(self) -> torch.Tensor:
        """bool ``[S]``: ``scored_b`` of each sample once (its first row's): what the rollout budget counts."""
        return self.scored_b[self.first_rows()]


def first_row_index(batch: TrainBatch) -> torch.Tensor:
    """long ``[B]``: for each row, the index of its sample's first row (a first row: itself). A branch row's sample
    is its trajectory (the same object on each of its rows); its first row must be in the batch (rows are selected
    by whole groups, and a sample's rows share its group: `TrainBatch.prompt_groups`)."""
    kinds = batch.branch_b.tolist()
    first = {id(t): i for i, (t, k) in enumerate(zip(batch.trajectories, kinds)) if k == 0}
    try:
        return torch.tensor([i if k == 0 else first[id(t)] for i, (t, k) in enumerate(zip(batch.trajectories, kinds))],
                            dtype=torch.long)
    except KeyError:
        raise ValueError("a branch row without its sample's first row in the batch (select a sample's rows "
                         "together)") from None


def spread_to_rows(batch: TrainBatch, values_s: torch.Tensor) -> torch.Tensor:
    """Per-sample ``values_s`` (one per first row, in row order: what a statistic computed on
    ``batch.first_rows()`` returns) as per-row values: each branch row gets its sample's. Rows of samples
    ``t, u`` as ``t, u, t`` (``branch_b`` 0, 0, 1) and values ``[5, 7]`` give ``[5, 7, 5]``.
    """
    first = batch.first_rows()
    if bool(first.all()):
        return values_s
    rank = torch.cumsum(first.to(torch.long), 0) - 1  # a first row's position among the first rows
    return values_s[rank[first_row_index(batch).to(rank.device)].to(values_s.device)]


def sample_chunks(batch: TrainBatch, size: int) -> list:
    """The rows of consecutive chunks of ``size`` samples (an optimizer step's: ``policy.train_global_batch_size``),
    each sample with its branch rows: slices where the batch has no branch row (a row per sample), else bool masks.
    Rows are in sample order (`build_batch` puts a sample's branch rows right after its first row; row selections keep
    the order).
    """
    first = batch.first_rows()
    if bool(first.all()):
        return [slice(start, start + size) for start in range(0, first.numel(), size)]
    sample_b = torch.cumsum(first.to(torch.long), 0) - 1
    return [(sample_b >= start) & (sample_b < start + size) for start in range(0, int(first.sum()), size)]


def batch_rows(trajectories: list) -> list[tuple]:
    """The rows of ``trajectories``: ``(trajectory, k, messages)``, a sample's first branch (``messages``, k = 0)
    then its further ones (``branches``, k = 1, 2, ...)."""
    return [(t, k, msgs) for t in trajectories for k, msgs in enumerate([t.messages, *t.branches])]


def build_batch(trajectories: list, pad_id: int, mask_flagged: bool = True) -> TrainBatch:
    """Flatten trajectories (`grpo.trajectory.Trajectory`) into a right-padded `TrainBatch`, a row per branch
    (`batch_rows`: one per sample unless an agent rewrote its history, ``Trajectory.branches``); a sample's
    per-sample fields (rewards, validity, group, lengths) are repeated on each of its rows.

    Rewards start as the environments' rewards (``rewards_b = task_rewards_b = raw_rewards_b``); reward components
    become ``[B, K]`` with names sorted (a missing one is 0). Validity (`grpo.tasks.failures`):

        scored_b = Trajectory.scored (failure is None)      valid_b = scored_b ∧ ¬(mask_flagged ∧ mask_sample_b)
        sample_mask_b = valid_b

    ``mask_flagged``: ``env.should_mask_flagged_samples`` (NeMo-RL's key; false: a flagged sample is trained like
    any other). A sample that is not scored has no reward (None); its row of the reward tensors holds
    `grpo.trajectory.UNSCORED_REWARD` (`grpo.trajectory.filled_rewards`), a number only because a tensor needs
    one: ``scored_b`` masks it out of every statistic, so it never reaches a valid sample.
    """
    table = batch_rows(trajectories)
    trajectories = [t for t, _, _ in table]
    B = len(table)
    rows = [[tok for m in msgs for tok in m.token_ids] for _, _, msgs in table]
    T = max(len(r) for r in rows)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    token_mask = torch.zeros((B, T), dtype=torch.float32)
    gen_lp = torch.zeros((B, T), dtype=torch.float32)
    spans: list[list[MessageSpan]] = []
    for b, ((_, _, messages), ids) in enumerate(zip(table, rows)):
        input_ids[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[b, :len(ids)] = 1
        pos, sample_spans = 0, []
        for m in messages:
            end = pos + len(m.token_ids)
            if m.trained:
                token_mask[b, pos:end] = 1.0
                gen_lp[b, pos:end] = torch.tensor(m.generation_logprobs, dtype=torch.float32)
                sample_spans.append((pos, end, tuple(m.flags)))
            pos = end
        spans.append(sample_spans)
    scored_b = torch.tensor([t.scored for t in trajectories], dtype=torch.bool)
    raw = torch.tensor(filled_rewards(trajectories), dtype=torch.float32)
    flagged_b = torch.tensor([bool(t.mask_sample) for t in trajectories], dtype=torch.bool)
    valid_b = scored_b & ~(flagged_b & mask_flagged)
    names = tuple(sorted({k for t in trajectories for k in (t.reward_components or {})}))
    comps = torch.tensor(filled_components(trajectories, names), dtype=torch.float32) if names else None
    return TrainBatch(
        input_ids_bt=input_ids, attention_mask_bt=attention_mask, token_mask_bt=token_mask,
        generation_logprobs_bt=gen_lp,
        group_ids_b=torch.tensor([t.group_id for t in trajectories], dtype=torch.long),
        raw_rewards_b=raw, rewards_b=raw.clone(), task_rewards_b=raw.clone(),
        response_lengths_b=torch.tensor([t.num_generated_tokens for t in trajectories], dtype=torch.long),
        truncated_b=torch.tensor([t.truncated for t in trajectories], dtype=torch.bool),
        mask_sample_b=flagged_b, scored_b=scored_b, valid_b=valid_b,
        sample_mask_b=valid_b.float(), branch_b=torch.tensor([k for _, k, _ in table], dtype=torch.long),
        message_spans=spans, task_names=[t.task_name for t in trajectories],
        trajectories=list(trajectories),
        reward_components_bk=comps, task_components_bk=comps, component_names=names,
        media=[t.media for t in trajectories] if any(t.media is not None for t in trajectories) else None,
    )


# --------------------------------------------------------------------------------------------------
# Row operations on a TrainBatch: its per-row fields are its tensors and lists (its tuples and Nones are per
# batch); per-token tensors end in "_bt"
# --------------------------------------------------------------------------------------------------
def trim_padding(batch: TrainBatch) -> TrainBatch:
    """Drop trailing columns that are padding in every row (after sharding / filtering)."""
    mask_bt = batch.attention_mask_bt
    T = max(int(mask_bt.sum(dim=1).max().item()), 1) if mask_bt.shape[0] else 1
    return batch.replace(**{k: v[:, :T] for k, v in _row_fields(batch).items() if k.endswith("_bt")})


def micro_batches(batch: TrainBatch, size: int) -> list[TrainBatch]:
    """Consecutive micro-batches of ``size`` rows, each trimmed to its own longest row."""
    n = batch_size(batch)
    return [trim_padding(select_rows(batch, slice(i, min(i + size, n)))) for i in range(0, n, size)]


def pad_columns(batch: TrainBatch, width: int) -> TrainBatch:
    """Per-token fields right-padded with 0 to ``width`` columns (ids 0 under attention 0: padding the model never
    attends to, and no trained token); a batch already that wide or wider is returned as it is."""
    T = batch.input_ids_bt.shape[1]
    if width <= T:
        return batch
    return batch.replace(**{k: torch.nn.functional.pad(v, (0, width - T)) for k, v in _row_fields(batch).items()
                            if k.endswith("_bt")})


def with_fields(batch: TrainBatch, **values) -> TrainBatch:
    """A copy with these fields set."""
    return batch.replace(**values)


def to_device(batch: TrainBatch, device) -> TrainBatch:
    """Every tensor moved to ``device``."""
    return batch.replace(**{k: v.to(device) for k, v in _row_fields(batch).items() if isinstance(v, torch.Tensor)})


def _row_fields(batch: TrainBatch) -> dict:
    """The per-row values of a batch: its tensors and lists (its tuples and Nones are per batch)."""
    items = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    return {k: v for k, v in items.items() if isinstance(v, (torch.Tensor, list))}


def batch_size(batch: TrainBatch) -> int:
    """The common leading length of the batch's per-row values (ValueError if they disagree)."""
    sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) else len(v)) for k, v in _row_fields(batch).items()}
    if len(set(sizes.values())) > 1:
        raise ValueError(f"batch values have different leading sizes: {sizes}")
    return next(iter(sizes.values()), 0)


def select_rows(batch: TrainBatch, index: Union[torch.Tensor, Sequence[int], slice]) -> TrainBatch:
    """Rows ``index`` (a slice, int indices in that order, or a bool mask ``[B]``) of every per-row value."""
    fields = _row_fields(batch)
    if isinstance(index, slice):  # tensors and lists alike; tensor slices are views
        return batch.replace(**{k: v[index] for k, v in fields.items()})
    if isinstance(index, torch.Tensor) and index.dtype == torch.bool:
        index = index.nonzero().flatten()
    index = torch.as_tensor(index, dtype=torch.long)
    idx = index.tolist()
    return batch.replace(**{k: (v[index.to(v.device)] if isinstance(v, torch.Tensor) else [v[i] for i in idx])
                            for k, v in fields.items()})


def _pad_to(t: torch.Tensor, shape: Sequence[int], value: float) -> torch.Tensor:
    if tuple(t.shape[1:]) == tuple(shape):
        return t
    out = t.new_full((t.shape[0], *shape), value)
    out[(slice(None), *(slice(0, s) for s in t.shape[1:]))] = t
    return out


def concat_batches(batches: Sequence[TrainBatch], pad_values: Optional[dict[str, float]] = None) -> TrainBatch:
    """Concatenate batches along the rows.

    Tensors whose trailing dims differ (``[B, T]`` with different T) are right-padded to the largest size
    with ``pad_values.get(name, 0)``. Per-batch values (tuples) come from the first batch; a field that is None
    in some batches and set in others cannot be concatenated (ValueError), but ``media`` (None: no row has images).
    """
    if not batches:
        raise ValueError("concat_batches: no batches")
    if any(b.media is not None for b in batches):  # a batch without images holds none for each of its rows
        batches = [b if b.media is not None else b.replace(media=[None] * len(b)) for b in batches]
    keys = list(_row_fields(batches[0]))
    if any(list(_row_fields(b)) != keys for b in batches):
        raise ValueError(f"concat_batches: batches have different fields: {[sorted(_row_fields(b)) for b in batches]}")
    pad_values = pad_values or {}
    out = {}
    for k in keys:
        values = [_row_fields(b)[k] for b in batches]
        if isinstance(values[0], torch.Tensor):
            shape = [max(v.shape[d] for v in values) for d in range(1, values[0].dim())]
            out[k] = torch.cat([_pad_to(v, shape, pad_values.get(k, 0)) for v in values])
        else:
            out[k] = [x for v in values for x in v]
    return batches[0].replace(**out)
