"""Rollouts: prompts -> completions -> one flat, padded training batch.

The batch is a dict of tensors with the math contract's alignment: per-token tensors are ``[B, T]``
(prompt and completion right-padded to ``T``); position ``t`` of a logprob tensor holds the logprob
of token ``t`` given the tokens before it; ``token_mask`` is 1 exactly on generated tokens.

    >>> o = GenerationOutput(prompt_ids=[1, 4], completion_ids=[7, 2], logprobs=[-0.5, -0.25],
    ...                      finish_reason="stop", text="x")
    >>> b = build_batch([o], pad_id=0)
    >>> b["input_ids"].tolist(), b["token_mask"].tolist(), b["generation_logprobs"].tolist()
    ([[1, 4, 7, 2]], [[0.0, 0.0, 1.0, 1.0]], [[0.0, 0.0, -0.5, -0.25]])

Data parallelism: every rank generates its contiguous share of the global sample list, then
``all_gather_objects`` gives every rank the whole rollout, so filtering, baselines and advantages are
computed identically everywhere; ``shard_batch`` finally hands each rank its slice to train on.
"""

from __future__ import annotations

import hashlib

import torch

from grpo.generation.base import GenerationOutput
from grpo.sampling import select_rows


def sample_seed(base_seed: int, step: int, sample_index: int, stream: str = "train") -> int:
    """A 63-bit seed for one sample: hash(base_seed, stream, step, sample_index).

    Generation randomness keyed per sample makes a completion independent of batch composition,
    world size and resume: the same (seed, step, index) always samples the same tokens.
    """
    key = f"{base_seed}:{stream}:{step}:{sample_index}".encode()
    return int.from_bytes(hashlib.sha256(key).digest()[:8], "little") & ((1 << 63) - 1)


def repeat_prompts(rows: list[dict], n: int) -> list[dict]:
    """Each prompt row repeated ``n`` times, consecutively, tagged with its group id ``prompt_idx``."""
    return [dict(row, prompt_idx=i) for i, row in enumerate(rows) for _ in range(n)]


def rank_slice(n: int, rank: int, world_size: int) -> slice:
    """Contiguous share of ``n`` items for ``rank`` (sizes differ by at most one)."""
    per, extra = divmod(n, world_size)
    start = rank * per + min(rank, extra)
    return slice(start, start + per + (1 if rank < extra else 0))


def all_gather_objects(local: list, group=None) -> list:
    """Concatenate every rank's list, in rank order (identity without torch.distributed).

    ``group``: the process group (None: the default one). A second thread that needs collectives
    (async GRPO's generation thread) passes its own: the default group belongs to the main thread.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return list(local)
    gathered: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return [x for part in gathered for x in part]


def build_batch(outputs: list[GenerationOutput], pad_id: int) -> dict[str, torch.Tensor]:
    """Pad prompt + completion of each sample into ``[B, T]`` tensors (right padding).

    Returns input_ids, attention_mask, token_mask (generated tokens), generation_logprobs (aligned
    with the tokens they score, 0 elsewhere), response_lengths ``[B]`` and truncated ``[B]`` (the
    sample hit the length cap instead of stopping).
    """
    B = len(outputs)
    T = max(len(o.prompt_ids) + len(o.completion_ids) for o in outputs)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((B, T), dtype=torch.long)
    token_mask = torch.zeros((B, T), dtype=torch.float32)
    gen_lp = torch.zeros((B, T), dtype=torch.float32)
    for i, o in enumerate(outputs):
        p, c = len(o.prompt_ids), len(o.completion_ids)
        input_ids[i, : p + c] = torch.tensor(list(o.prompt_ids) + list(o.completion_ids), dtype=torch.long)
        attention_mask[i, : p + c] = 1
        token_mask[i, p: p + c] = 1.0
        gen_lp[i, p: p + c] = torch.tensor(o.logprobs, dtype=torch.float32)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "token_mask": token_mask,
        "generation_logprobs": gen_lp,
        "response_lengths": torch.tensor([len(o.completion_ids) for o in outputs], dtype=torch.long),
        "truncated": torch.tensor([o.finish_reason == "length" for o in outputs], dtype=torch.bool),
    }


def completion_spans(token_mask_bt: torch.Tensor, flags: dict[str, torch.Tensor]) -> list[list[tuple]]:
    """Per sample, the single assistant message of a single-turn rollout as ``[(start, end, names)]``:
    the span of its generated tokens and the names of the flags raised on it (the format of
    ``grpo.advantages.apply_message_advantage_penalties``)."""
    spans = []
    for b in range(token_mask_bt.shape[0]):
        pos = token_mask_bt[b].nonzero().flatten()
        names = [name for name, flag_b in flags.items() if bool(flag_b[b])]
        spans.append([(int(pos[0]), int(pos[-1]) + 1, names)] if len(pos) else [])
    return spans


def trim_padding(batch: dict) -> dict:
    """Drop trailing columns that are padding in every row (after sharding / filtering)."""
    T = int(batch["attention_mask"].sum(dim=1).max().item())
    return {k: (v[:, :T] if isinstance(v, torch.Tensor) and v.dim() == 2 else v) for k, v in batch.items()}


def shard_batch(batch: dict, rank: int, world_size: int) -> dict:
    """This rank's contiguous slice of the global batch, with shared padding trimmed."""
    n = len(batch["input_ids"])
    return trim_padding(select_rows(batch, rank_slice(n, rank, world_size)))


def micro_batches(batch: dict, size: int) -> list[dict]:
    """Consecutive micro-batches of ``size`` rows, each trimmed to its own longest row."""
    n = len(batch["input_ids"])
    return [trim_padding(select_rows(batch, slice(i, min(i + size, n)))) for i in range(0, n, size)]
