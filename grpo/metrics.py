"""Metric aggregation, grpo-ds's former metric names (`FORMER_NAMES`, to read what older runs wrote), validation
early stop, checkpoint ranking metrics, and the global loss normalisers."""

from __future__ import annotations

import math
import re
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

_NAME_TOKENS = re.compile(r"[/_.\-@]")


def _reduction(key: str) -> str:
    """How a key aggregates, by name: "min" / "max" when that word is one of its tokens
    (``probs_ratio_min``, ``seq/max``, ``min_len``) and the name is not a rate (``max_turns_reached_rate`` is a
    share of samples: its mean over the parts is the whole's, as NeMo-RL's aggregate_rollout_metrics keeps
    ``_rate`` names out of min / max), "sum" for ``total_turns``, else "mean"."""
    if key.endswith("_rate"):
        return "mean"
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
      - names with a "min" / "max" token (``x_min``, ``x/max``, ``min_x``) that do not end in ``_rate``: min / max;
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


# ---- grpo-ds's former metric names ------------------------------------------------------------------
# The phases log NeMo-RL's names as they compute them; these tables only read what grpo-ds wrote before it took
# them: an older metrics.jsonl (`grpo.tools.plot`), an older checkpoint's train_state.json
# (`checkpoint_metric_keys`), a former name in checkpointing.metric_name (`checkpoint_metric`).
def _validation_names() -> dict[str, str]:
    from grpo.config import VALIDATION_METRIC_ALIASES

    return {f"val/{old}": f"validation/{new}" for old, new in VALIDATION_METRIC_ALIASES.items()}


FORMER_NAMES: dict[str, str] = {
    # grpo-ds's former key -> NeMo-RL's key, where the producer now logs it.
    # Rollout: nemo_rl/experience/rollouts.py, run_multi_turn_rollout's rollout_metrics (logged under "train/" by
    # grpo_train in nemo_rl/algorithms/grpo.py): grpo.rollout_metrics.rollout_summary.
    "train/reward_mean": "train/mean_total_reward",
    "train/turns_mean": "train/avg_turns_per_sample",
    "train/turns_max": "train/max_turns_per_sample",
    "train/assistant_tokens_mean": "train/mean_gen_tokens_per_sample",
    "train/response_length_mean": "train/mean_gen_tokens_per_sample",
    "train/response_length_max": "train/max_gen_tokens_per_sample",
    "train/env_tokens_mean": "train/mean_env_tokens_per_sample",
    "train/truncated_frac": "train/truncation_rate",
    # Train: grpo_train's `metrics` dict (grpo.step.step_metrics; num_mask_sample_filtered: rollout_counts).
    "train/shaped_reward_mean": "train/reward",
    "train/kl": "train/kl_penalty",
    "train/mask_sample_count": "train/num_mask_sample_filtered",
    # Sequence logprob error: grpo.logprobs.mask_by_seq_logprob_error.
    "train/num_masked_seqs": "train/num_masked_seqs_by_logprob_error",
    **{f"train/seq_logprob_error{after}_{stat}": f"train/{stat}_seq_mult_prob_error{'_after_mask' if after else ''}"
       for after in ("", "_after") for stat in ("min", "mean", "max")},
    # Timing: grpo_train's Timer labels under "timing/train/" (grpo.system.tracking.PHASE_TIMERS, the loops).
    "timing/step_s": "timing/train/total_step_time",
    "timing/rollout_s": "timing/train/generation",
    "timing/logprobs_s": "timing/train/policy_and_reference_logprobs",
    "timing/train_s": "timing/train/policy_training",
    "timing/refit_s": "timing/train/prepare_for_generation/total",
    # Validation: grpo.run.validation.validate (grpo.config.VALIDATION_METRIC_ALIASES has the metric part).
    **_validation_names(),
    "val/num_samples": "validation/num_samples",
    "val/generate_s": "timing/validation/generate_s",
    "val/env_step_s": "timing/validation/env_step_s",
    "val/validation_s": "timing/validation/total_validation_time",
}


def nemo_rl_name(key: str) -> str:
    """NeMo-RL's name of a key an older run logged: `FORMER_NAMES`, then ``val/pass@<k>`` -> ``validation/pass_k``,
    any other ``val/<x>`` -> ``validation/<x>`` and ``timing/<x>`` -> ``timing/train/<x>``; other keys (and
    NeMo-RL's own names) as they are.

        >>> [nemo_rl_name(k) for k in ("train/reward_mean", "val/pass@4", "timing/generate_s", "train/loss")]
        ['train/mean_total_reward', 'validation/pass_k', 'timing/train/generate_s', 'train/loss']
    """
    if key in FORMER_NAMES:
        return FORMER_NAMES[key]
    if key.startswith("val/pass@"):
        return "validation/pass_k"
    if key.startswith("val/"):
        return "validation/" + key[len("val/"):]
    if key.startswith("timing/") and not key.startswith(("timing/train/", "timing/validation/", "timing/setup/")):
        return "timing/train/" + key[len("timing/"):]
    return key


def former_names(name: str) -> list[str]:
    """The former keys that `nemo_rl_name` maps to ``name`` (to read a checkpoint written before the rename).

        >>> former_names("train/mean_gen_tokens_per_sample")
        ['train/assistant_tokens_mean', 'train/response_length_mean']
    """
    return [old for old, new in FORMER_NAMES.items() if new == name]


def checkpoint_metric_keys(metric_name: str) -> list[str]:
    """Where a checkpoint's ``train_state.json`` may hold ``checkpointing.metric_name`` (NeMo-RL's ``val:<name>``
    / ``train:<name>``): under that name (`save_metrics` puts it there), then under the keys a checkpoint saved
    before NeMo-RL's names would have.

        >>> checkpoint_metric_keys("val:accuracy")
        ['val:accuracy', 'validation/accuracy', 'val/reward_mean']
    """
    prefix, _, name = metric_name.partition(":")
    logged = f"validation/{name}" if prefix == "val" else f"train/{name}"
    return [metric_name, logged, *former_names(logged)]


def checkpoint_metric(metric_name: str, train_metrics: dict, val_metrics: Optional[dict]) -> Optional[float]:
    """The value ``checkpointing.metric_name`` ranks a checkpoint by, as NeMo-RL's grpo_train takes it:
    ``val:<name>`` from the validation metrics of this step (NeMo-RL's names, unprefixed), ``train:<name>`` from
    the step's metrics (keys ``train/<name>``; a former name is read as NeMo-RL's). None when that side has no
    metrics this step (no validation: the checkpoint ranks lowest). KeyError naming the metrics there are when
    ``name`` is not among them.

        >>> checkpoint_metric("train:loss", {"train/loss": 0.5}, None), checkpoint_metric("val:accuracy", {}, None)
        (0.5, None)
    """
    prefix, _, name = metric_name.partition(":")
    if prefix == "val":
        source = dict(val_metrics or {})
    else:
        source = {k[len("train/"):]: v for k, v in train_metrics.items() if k.startswith("train/")}
        name = nemo_rl_name(f"train/{name}")[len("train/"):]
    if not source:
        return None
    if name not in source:
        available = sorted(k for k, v in source.items() if isinstance(_as_python(v), (int, float)))
        side = "validation" if prefix == "val" else "train"
        raise KeyError(f"checkpointing.metric_name={metric_name!r}: the {side} metrics have no {name!r}; available: "
                       + ", ".join(f"{prefix}:{k}" for k in available))
    return float(_as_python(source[name]))


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
    """Fraction of prompts with at least one of their k samples rewarded (reward > 0); ``group_ids_b``: the prompt
    groups (`grpo.batch.TrainBatch.prompt_groups`, by prompt tokens as NeMo-RL's ``calculate_pass_rate_per_prompt``).

        >>> pass_at_k(torch.tensor([0.0, 1.0, 0.0, 0.0]), torch.tensor([0, 0, 1, 1]))
        0.5
    """
    groups = torch.unique(group_ids_b)
    hits = [(rewards_b[group_ids_b == g] > 0).any().item() for g in groups]
    return float(sum(hits)) / max(len(hits), 1)


def rollout_counts(trajectories: Sequence) -> dict:
    """What a rollout's trajectories (`grpo.trajectory.Trajectory`) count: NeMo-RL's rollout metrics
    (`grpo.rollout_metrics.rollout_summary`: turns, termination rates, tokens and rewards per sample), the samples
    the environments flagged (num_mask_sample_filtered, NeMo-RL's name), and the reward mean of each task
    (``reward_mean/<task>``, when the run has several) over its samples that did not fail. Failed samples are
    counted by `grpo.step.failure_counts` (``rollout/failed_samples/<reason>``)."""
    from grpo.rollout_metrics import rollout_summary

    out = {
        **rollout_summary(trajectories),
        "num_mask_sample_filtered": sum(t.mask_sample for t in trajectories),
    }
    tasks = sorted({t.task_name for t in trajectories})
    if len(tasks) > 1:
        for task in tasks:
            rewards = [t.reward for t in trajectories if t.task_name == task and t.scored]
            out[f"reward_mean/{task}"] = sum(rewards) / len(rewards) if rewards else 0.0
    return out
