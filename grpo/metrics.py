"""Metric aggregation, validation early stop, and the global loss normalisers."""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

_NAME_TOKENS = re.compile(r"[/_.\-@]")


def _reduction(key: str) -> str:
    """How a key aggregates, by name: "min" / "max" when that word is one of its tokens
    (``probs_ratio_min``, ``seq/max``, ``min_len``), "sum" for ``total_turns``, else "mean"."""
    tokens = _NAME_TOKENS.split(key)
    if "min" in tokens:
        return "min"
    if "max" in tokens:
        return "max"
    if key == "total_turns" or key.endswith("/total_turns"):
        return "sum"
    return "mean"


def _as_python(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.flatten().tolist()
    return value


def _flatten(values: Sequence[Any]) -> list:
    out: list = []
    for v in values:
        v = _as_python(v)
        if isinstance(v, (list, tuple)):
            out.extend(_flatten(v))
        else:
            out.append(v)
    return out


def aggregate_rollout_metrics(metric_dicts: Sequence[dict]) -> dict:
    """Merge per-rollout (or per-micro-batch) metric dicts into one.

    Per key, over the dicts that have it (None values skipped):
      - list / multi-element tensor values (histograms): concatenated into one flat list;
      - names with a "min" / "max" token (``x_min``, ``x/max``, ``min_x``): min / max;
      - ``total_turns``: sum;  - everything else: mean.

        >>> aggregate_rollout_metrics([{"r": 1.0, "r_max": 1, "lens": [3]}, {"r": 0.0, "r_max": 5, "lens": [4, 5]}])
        {'r': 0.5, 'r_max': 5, 'lens': [3, 4, 5]}
    """
    keys: list[str] = []
    for d in metric_dicts:
        keys.extend(k for k in d if k not in keys)
    out: dict = {}
    for key in keys:
        raw = [_as_python(d[key]) for d in metric_dicts if key in d and d[key] is not None]
        if not raw:
            continue
        if any(isinstance(v, (list, tuple)) for v in raw):
            out[key] = _flatten(raw)
            continue
        if not all(isinstance(v, (int, float, bool)) for v in raw):
            out[key] = raw
            continue
        how = _reduction(key)
        if how == "min":
            out[key] = min(raw)
        elif how == "max":
            out[key] = max(raw)
        elif how == "sum":
            out[key] = sum(raw)
        else:
            out[key] = sum(raw) / len(raw)
    return out


def validation_early_stop(
    val_metrics: dict, metric_name: Optional[str], threshold: Optional[float]
) -> tuple[bool, Optional[float], str]:
    """(stop, value, message): stop once ``val_metrics[metric_name] >= threshold``.

    ``grpo.stop_at_validation_metric`` / ``grpo.stop_at_validation_threshold``; None disables it.
    A metric missing from ``val_metrics`` raises KeyError naming the ones there are.
    """
    if metric_name is None or threshold is None:
        return False, None, ""
    if metric_name not in val_metrics:
        raise KeyError(
            f"grpo.stop_at_validation_metric={metric_name!r} is not among the validation metrics "
            f"{sorted(val_metrics)}"
        )
    value = float(_as_python(val_metrics[metric_name]))
    if math.isnan(value) or value < threshold:
        return False, value, f"validation {metric_name}={value:.4f} < {threshold}: continuing"
    return True, value, (
        f"validation {metric_name}={value:.4f} >= {threshold} (grpo.stop_at_validation_threshold): stopping"
    )


def global_valid_counts(
    token_mask_bt: torch.Tensor, sample_mask_b: torch.Tensor, group: Optional[dist.ProcessGroup] = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """THE loss normalisers of a step: (global_valid_tokens, global_valid_seqs), float 0-d tensors.

        tokens = Σ_ranks Σ_{b,t} token_mask_bt · sample_mask_b        seqs = Σ_ranks Σ_b sample_mask_b

    Pass the masks of the whole step held by this rank (all its micro-batches); the sums are
    all-reduced (SUM) over ``group`` when torch.distributed is initialised and the group has more
    than one rank. Every rank must call it (it is a collective).
    """
    sample_mask = sample_mask_b.to(torch.float32)
    tokens = (token_mask_bt.to(torch.float32) * sample_mask[:, None]).sum()
    counts = torch.stack([tokens, sample_mask.sum()])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        if dist.get_backend(group) == "nccl" and counts.device.type != "cuda":
            counts = counts.cuda()
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    counts = counts.to(token_mask_bt.device)
    return counts[0], counts[1]


def pass_at_k(rewards_b: torch.Tensor, group_ids_b: torch.Tensor) -> float:
    """Fraction of prompts with at least one of their k samples rewarded (reward > 0).

        >>> pass_at_k(torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]))
        0.5
    """
    groups = torch.unique(group_ids_b)
    hits = [(rewards_b[group_ids_b == g] > 0).any().item() for g in groups]
    return float(sum(hits)) / max(len(hits), 1)


def rollout_counts(trajectories: Sequence) -> dict:
    """What a rollout's trajectories (`grpo.system.rollout.Trajectory`) count: scoring failures (reward_errors,
    reward_timeouts, reward_error_rate, env_errors), turns (turns_mean, turns_max), tokens per sample
    (assistant_tokens_mean, env_tokens_mean), mask_sample_count, and the reward mean of each task
    (``reward_mean/<task>``, when the run has several)."""
    n = max(len(trajectories), 1)
    errors = [t.error for t in trajectories]
    out = {
        "reward_errors": sum(e == "reward_error" for e in errors),
        "reward_timeouts": sum(e == "reward_timeout" for e in errors),
        "env_errors": sum(e in ("env_error", "env_timeout") for e in errors),
        "turns_mean": sum(t.turns for t in trajectories) / n,
        "turns_max": max((t.turns for t in trajectories), default=0),
        "assistant_tokens_mean": sum(t.num_generated_tokens for t in trajectories) / n,
        "env_tokens_mean": sum(t.observation_tokens for t in trajectories) / n,
        "mask_sample_count": sum(t.mask_sample for t in trajectories),
    }
    out["reward_error_rate"] = (out["reward_errors"] + out["reward_timeouts"]) / n
    tasks = sorted({t.task_name for t in trajectories})
    if len(tasks) > 1:
        for task in tasks:
            rewards = [t.reward for t in trajectories if t.task_name == task]
            out[f"reward_mean/{task}"] = sum(rewards) / len(rewards)
    return out
