"""Reward post-processing: penalties (reward zeroing), linear scaling, DAPO overlong shaping.

Order in the loop: ``apply_reward_penalties`` -> ``scale_rewards`` -> ``shape_overlong_rewards``.
Rewards are ``[B]`` float tensors; inputs are never modified.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Optional, Sequence

import torch

from grpo.config import RewardPenaltyConfig, RewardScalingConfig, RewardShapingConfig


# --------------------------------------------------------------------------------------------------
# Scaling and shaping
# --------------------------------------------------------------------------------------------------
def scale_rewards(rewards: torch.Tensor, cfg: RewardScalingConfig) -> torch.Tensor:
    """Clamp to [source_min, source_max], then map linearly onto [target_min, target_max].

        r' = target_min + (clamp(r) − source_min) / (source_max − source_min) · (target_max − target_min)

    Identity when ``cfg.enabled`` is false.
    """
    if not cfg.enabled:
        return rewards
    r = rewards.clamp(min=cfg.source_min, max=cfg.source_max)
    return cfg.target_min + (r - cfg.source_min) / (cfg.source_max - cfg.source_min) * (cfg.target_max - cfg.target_min)


def shape_overlong_rewards(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor | Sequence[int],
    truncated: Optional[torch.Tensor | Sequence[bool]],
    cfg: RewardShapingConfig,
) -> torch.Tensor:
    """DAPO overlong shaping or the stop-properly penalty (NeMo-RL's ``apply_reward_shaping``).

    With ``stop_properly_penalty_coef = c`` set:  r' = c · r for truncated responses, r otherwise.
    Otherwise, with L_max = max_response_length, L_buf = overlong_buffer_length, P = overlong_buffer_penalty:

        r' = r + min(0, (L_max − L_buf − len) / L_buf · P)

    (0 up to L_max − L_buf tokens, −P at L_max, not capped beyond). As in NeMo-RL the two are
    exclusive: when c is set the overlong buffer is ignored (a warning says so). Identity when
    ``cfg.enabled`` is false.
    """
    if not cfg.enabled:
        return rewards
    if cfg.stop_properly_penalty_coef is not None:  # the config forbids it together with the buffer
        if truncated is None:
            raise ValueError("grpo.reward_shaping.stop_properly_penalty_coef needs the per-sample `truncated` flags")
        trunc_b = torch.as_tensor(truncated, dtype=torch.bool, device=rewards.device)
        return torch.where(trunc_b, rewards * cfg.stop_properly_penalty_coef, rewards)
    lengths_b = torch.as_tensor(response_lengths, device=rewards.device).to(rewards.dtype)
    expected = cfg.max_response_length - cfg.overlong_buffer_length
    penalty_b = ((expected - lengths_b) / cfg.overlong_buffer_length * cfg.overlong_buffer_penalty).clamp(max=0)
    return rewards + penalty_b


# --------------------------------------------------------------------------------------------------
# Penalty detectors: one completion in, one bool out
# --------------------------------------------------------------------------------------------------
_SEGMENT_SPLIT = re.compile(r"\n+|(?<=[.!?])\s+")


def has_duplicated_reasoning(text: str, min_chars: int, min_repeats: int) -> bool:
    """True when some line or sentence (stripped, >= min_chars characters) occurs >= min_repeats times.

        >>> has_duplicated_reasoning("Let me check this again.\\n" * 3, min_chars=10, min_repeats=3)
        True
    """
    segments = (s.strip() for s in _SEGMENT_SPLIT.split(text))
    counts = Counter(s for s in segments if len(s) >= min_chars)
    return any(c >= min_repeats for c in counts.values())


def _tag_events(text: str, open_tag: str, close_tag: str) -> list[str]:
    """The think tags of ``text`` in order, as "open" / "close"."""
    pattern = re.compile("|".join(re.escape(t) for t in sorted({open_tag, close_tag}, key=len, reverse=True)))
    return ["open" if m.group(0) == open_tag else "close" for m in pattern.finditer(text)]


def _well_formed(events: list, starts_in_think: bool) -> bool:
    """Exactly zero tags, or exactly one open followed by one close (the open may be in the prompt)."""
    events = (["open"] if starts_in_think else []) + list(events)
    return events == [] or events == ["open", "close"]


def has_malformed_think_tags(text: str, open_tag: str, close_tag: str, starts_in_think: bool = False) -> bool:
    """True unless the completion has no think tags or exactly one ``open … close`` pair.

    Catches unbalanced, nested, close-before-open and repeated blocks. ``starts_in_think``: the
    prompt already ends with the open tag (chat templates that open the thinking block), so the
    completion must hold exactly one close tag and no open tag.
    """
    return not _well_formed(_tag_events(text, open_tag, close_tag), starts_in_think)


def has_malformed_think_token_ids(
    token_ids: Sequence[int], open_id: int, close_id: int, starts_in_think: bool = False
) -> bool:
    """:func:`has_malformed_think_tags` on token ids (the tags as single special tokens)."""
    events = ["open" if t == open_id else "close" for t in token_ids if t in (open_id, close_id)]
    return not _well_formed(events, starts_in_think)


def has_empty_final_answer(text: str, open_tag: str, close_tag: str, starts_in_think: bool = False) -> bool:
    """True when there is no non-whitespace final answer.

    Final answer = the text after the last close tag; without a close tag it is the whole completion,
    unless a thinking block was opened (in the completion or, ``starts_in_think``, in the prompt) and
    never closed: then it is empty.
    """
    if close_tag in text:
        answer = text.rsplit(close_tag, 1)[1]
    elif starts_in_think or open_tag in text:
        answer = ""
    else:
        answer = text
    return answer.strip() == ""


def has_unwanted_tokens(token_ids: Sequence[int] | torch.Tensor, unwanted: Sequence[int]) -> bool:
    """True when any completion token id is in ``unwanted``."""
    ids = token_ids.tolist() if isinstance(token_ids, torch.Tensor) else token_ids
    return not set(unwanted).isdisjoint(ids)


def apply_reward_penalties(
    rewards: torch.Tensor,
    texts: Sequence[str],
    token_ids: Sequence[Sequence[int] | torch.Tensor],
    cfg: RewardPenaltyConfig,
    tokenizer_think_ids: Optional[tuple[int, int]] = None,
    starts_in_think: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Set the reward to 0 where any enabled detector fires.

    ``texts[b]`` / ``token_ids[b]``: the completion of sample b (no prompt, no padding).
    Detectors (``reward_penalties.penalize_*``): duplicated_reasoning (think tags count as line
    breaks), empty_final_answer,
    unwanted_tokens (``token_ids.unwanted``), malformed_think_tag (on the text with
    ``think_open_tag`` / ``think_close_tag``, and also on the ids when ``tokenizer_think_ids`` =
    (open_id, close_id) or ``cfg.token_ids.think_open`` / ``think_close`` are given).

    Returns (rewards', flags, metrics): ``flags[name]`` is a BoolTensor[B] per enabled detector;
    metrics ``reward_penalty/<name>`` is the fraction flagged and ``reward_penalty/any`` the
    fraction zeroed.
    """
    batch = rewards.shape[0]
    if len(texts) != batch or len(token_ids) != batch:
        raise ValueError(f"apply_reward_penalties: {batch} rewards but {len(texts)} texts, {len(token_ids)} token_ids")
    think_ids = tokenizer_think_ids
    ids_cfg = cfg.token_ids
    if think_ids is None and ids_cfg is not None and None not in (ids_cfg.think_open, ids_cfg.think_close):
        think_ids = (ids_cfg.think_open, ids_cfg.think_close)
    open_tag, close_tag = cfg.think_open_tag, cfg.think_close_tag

    def malformed(text: str, ids) -> bool:
        bad = has_malformed_think_tags(text, open_tag, close_tag, starts_in_think)
        if think_ids is not None:
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
            bad = bad or has_malformed_think_token_ids(ids, *think_ids, starts_in_think)
        return bad

    detectors = {
        "duplicated_reasoning": (cfg.penalize_duplicated_reasoning, lambda t, i: has_duplicated_reasoning(
            t.replace(open_tag, "\n").replace(close_tag, "\n"), cfg.duplicate_min_chars, cfg.duplicate_min_repeats)),
        "empty_final_answer": (cfg.penalize_empty_final_answer, lambda t, i: has_empty_final_answer(
            t, open_tag, close_tag, starts_in_think)),
        "unwanted_tokens": (cfg.penalize_unwanted_tokens, lambda t, i: has_unwanted_tokens(
            i, cfg.token_ids.unwanted)),
        "malformed_think_tag": (cfg.penalize_malformed_think_tag, malformed),
    }
    flags: dict[str, torch.Tensor] = {}
    for name, (enabled, detect) in detectors.items():
        if enabled:
            flags[name] = torch.tensor([detect(t, i) for t, i in zip(texts, token_ids, strict=True)], dtype=torch.bool)
    any_b = torch.zeros(batch, dtype=torch.bool)
    for flag_b in flags.values():
        any_b |= flag_b
    metrics = {f"reward_penalty/{name}": flag_b.float().mean().item() if batch else 0.0
               for name, flag_b in flags.items()}
    metrics["reward_penalty/any"] = any_b.float().mean().item() if batch else 0.0
    any_b = any_b.to(rewards.device)
    return torch.where(any_b, torch.zeros_like(rewards), rewards), flags, metrics
