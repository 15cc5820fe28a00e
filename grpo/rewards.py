"""Reward post-processing: penalties (reward zeroing), linear scaling, DAPO overlong shaping.

Order in the loop: ``apply_reward_penalties`` -> ``scale_rewards`` -> ``shape_overlong_rewards``.
Rewards are ``[B]`` float tensors; GDPO's reward components ``[B, K]`` go through the same steps
(``penalize_components`` -> ``scale_rewards`` -> ``shape_overlong_components``). Inputs are never modified.
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

    Elementwise, so GDPO's components ``[B, K]`` are scaled with the same map, as NeMo-RL's
    ``scale_rewards`` scales ``total_reward`` and every ``reward/<name>`` component. Identity when
    ``cfg.enabled`` is false.
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


def shape_overlong_components(
    components_bk: torch.Tensor,
    response_lengths: torch.Tensor | Sequence[int],
    truncated: Optional[torch.Tensor | Sequence[bool]],
    cfg: RewardShapingConfig,
) -> torch.Tensor:
    """GDPO's reward components ``[B, K]`` under :func:`shape_overlong_rewards`'s shaping.

    stop-properly (``stop_properly_penalty_coef = c``): every component of a truncated response is
    multiplied by c (so Σ_k r'_ik = c · Σ_k r_ik, the shaped total). Overlong buffer: the length
    penalty becomes one more component, last (``[B, K + 1]``; its column is
    ``shape_overlong_rewards(0)``, Σ_k r'_ik = the shaped total), normalised within its group like
    the others, as GDPO treats a length reward. ``grpo.adv_estimator.reward_weights``, when set, then
    needs K + 1 entries. Identity when ``cfg.enabled`` is false.

    Differs from NeMo-RL, whose ``apply_reward_shaping`` changes only ``total_reward``: there GDPO
    (which reads only the components) silently ignores ``grpo.reward_shaping``.

        >>> cfg = RewardShapingConfig(enabled=True, overlong_buffer_length=20, overlong_buffer_penalty=1.0,
        ...                           max_response_length=100)
        >>> shape_overlong_components(torch.tensor([[1.0, 0.5], [0.0, 0.5]]), [50, 90], None, cfg)
        tensor([[ 1.0000,  0.5000,  0.0000],
                [ 0.0000,  0.5000, -0.5000]])
    """
    if components_bk.dim() != 2:
        raise ValueError(f"shape_overlong_components: components must be [B, K], got {tuple(components_bk.shape)}")
    if not cfg.enabled:
        return components_bk
    if cfg.stop_properly_penalty_coef is not None:
        return shape_overlong_rewards(components_bk.T, response_lengths, truncated, cfg).T
    zeros_b = torch.zeros(components_bk.shape[0], dtype=components_bk.dtype, device=components_bk.device)
    penalty_b = shape_overlong_rewards(zeros_b, response_lengths, truncated, cfg)
    return torch.cat([components_bk, penalty_b[:, None]], dim=1)


def process_reward_components(
    components_bk: torch.Tensor,
    penalty_flags: dict[str, torch.Tensor],
    response_lengths: torch.Tensor | Sequence[int],
    truncated: Optional[torch.Tensor | Sequence[bool]],
    scaling_cfg: RewardScalingConfig,
    shaping_cfg: RewardShapingConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO's components through the scalar reward's steps: (task ``[B, K]``, shaped ``[B, K']``).

        task   = scale_rewards(penalize_components(components, penalty_flags))
        shaped = shape_overlong_components(task, response_lengths, truncated)

    ``penalty_flags``: the flags of :func:`apply_reward_penalties`. ``task`` is what dynamic sampling
    filters on (per component: `grpo.dynamic_sampling.group_reward_std`); ``shaped`` is what GDPO's advantages
    read (``reward_components`` of `grpo.advantages.compute_advantages`).
    """
    task_bk = scale_rewards(penalize_components(components_bk, penalty_flags), scaling_cfg)
    return task_bk, shape_overlong_components(task_bk, response_lengths, truncated, shaping_cfg)


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


def prompt_starts_in_think(prompt_text: str, open_tag: str, close_tag: str) -> bool:
    """True when the prompt's last think tag is an open tag: the chat template opened the thinking
    block (Qwen3 with ``enable_thinking``) and the completion starts inside it.

    NeMo-RL reads the same from the prompt's token counts (open == close + 1). A template that closes
    an empty block (``<think>\\n\\n</think>``, thinking off) or earlier turns' closed blocks give False.

        >>> prompt_starts_in_think("<|im_start|>assistant\\n<think>\\n", "<think>", "</think>")
        True
        >>> prompt_starts_in_think("<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n", "<think>", "</think>")
        False
    """
    events = _tag_events(prompt_text, open_tag, close_tag)
    return bool(events) and events[-1] == "open"


def _starts_in_think(starts_in_think_b: Optional[Sequence[bool] | torch.Tensor], batch: int) -> list[bool]:
    if starts_in_think_b is None:
        return [False] * batch
    flags = [bool(x) for x in (starts_in_think_b.tolist() if isinstance(starts_in_think_b, torch.Tensor)
                               else starts_in_think_b)]
    if len(flags) != batch:
        raise ValueError(f"starts_in_think_b has {len(flags)} entries for {batch} completions")
    return flags


def _think_ids(cfg: RewardPenaltyConfig, tokenizer_think_ids: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:
    ids_cfg = cfg.token_ids
    if tokenizer_think_ids is None and ids_cfg is not None and None not in (ids_cfg.think_open, ids_cfg.think_close):
        return ids_cfg.think_open, ids_cfg.think_close
    return tokenizer_think_ids


def malformed_thinking_flags(
    texts: Sequence[str],
    token_ids: Sequence[Sequence[int] | torch.Tensor],
    cfg: RewardPenaltyConfig,
    starts_in_think_b: Optional[Sequence[bool] | torch.Tensor] = None,
    tokenizer_think_ids: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """BoolTensor[B]: completion b has malformed think tags (:func:`has_malformed_think_tags` on the text
    with ``cfg.think_open_tag`` / ``think_close_tag``, and :func:`has_malformed_think_token_ids` when
    think ids are known: ``tokenizer_think_ids`` or ``cfg.token_ids.think_open`` / ``think_close``).

    ``starts_in_think_b[b]``: the prompt of sample b opened the thinking block
    (:func:`prompt_starts_in_think`); default all False. Reads no ``penalize_*`` switch and changes no
    reward: usable on its own for ``grpo.malformed_thinking_advantage``.

        >>> cfg = RewardPenaltyConfig()
        >>> malformed_thinking_flags(["why</think> 4", "why</think> 4"], [[], []], cfg, [True, False])
        tensor([False,  True])
    """
    if len(texts) != len(token_ids):
        raise ValueError(f"malformed_thinking_flags: {len(texts)} texts but {len(token_ids)} token_ids")
    starts = _starts_in_think(starts_in_think_b, len(texts))
    think_ids = _think_ids(cfg, tokenizer_think_ids)
    flags = []
    for text, ids, start in zip(texts, token_ids, starts):
        bad = has_malformed_think_tags(text, cfg.think_open_tag, cfg.think_close_tag, start)
        if think_ids is not None:
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
            bad = bad or has_malformed_think_token_ids(ids, *think_ids, start)
        flags.append(bad)
    return torch.tensor(flags, dtype=torch.bool)


def apply_reward_penalties(
    rewards: torch.Tensor,
    texts: Sequence[str],
    token_ids: Sequence[Sequence[int] | torch.Tensor],
    cfg: RewardPenaltyConfig,
    tokenizer_think_ids: Optional[tuple[int, int]] = None,
    starts_in_think_b: Optional[Sequence[bool] | torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Set the reward to 0 where any enabled detector fires.

    ``texts[b]`` / ``token_ids[b]``: the completion of sample b (no prompt, no padding).
    Detectors (``reward_penalties.penalize_*``): duplicated_reasoning (think tags count as line
    breaks), empty_final_answer, unwanted_tokens (``token_ids.unwanted``), malformed_think_tag
    (:func:`malformed_thinking_flags`). ``starts_in_think_b[b]``: the prompt of sample b opened the
    thinking block (:func:`prompt_starts_in_think` of its prompt text), for the think-tag detectors;
    default all False.

    Returns (rewards', flags, metrics): ``flags[name]`` is a BoolTensor[B] per enabled detector;
    metrics ``reward_penalty/<name>`` is the fraction flagged and ``reward_penalty/any`` the
    fraction zeroed. GDPO's components: :func:`penalize_components` with these flags.
    """
    batch = rewards.shape[0]
    if len(texts) != batch or len(token_ids) != batch:
        raise ValueError(f"apply_reward_penalties: {batch} rewards but {len(texts)} texts, {len(token_ids)} token_ids")
    starts = _starts_in_think(starts_in_think_b, batch)
    open_tag, close_tag = cfg.think_open_tag, cfg.think_close_tag

    def per_sample(detect) -> torch.Tensor:
        return torch.tensor([detect(t, i, s) for t, i, s in zip(texts, token_ids, starts, strict=True)],
                            dtype=torch.bool)

    flags: dict[str, torch.Tensor] = {}
    if cfg.penalize_duplicated_reasoning:
        flags["duplicated_reasoning"] = per_sample(lambda t, i, s: has_duplicated_reasoning(
            t.replace(open_tag, "\n").replace(close_tag, "\n"), cfg.duplicate_min_chars, cfg.duplicate_min_repeats))
    if cfg.penalize_empty_final_answer:
        flags["empty_final_answer"] = per_sample(lambda t, i, s: has_empty_final_answer(t, open_tag, close_tag, s))
    if cfg.penalize_unwanted_tokens:
        flags["unwanted_tokens"] = per_sample(lambda t, i, s: has_unwanted_tokens(i, cfg.token_ids.unwanted))
    if cfg.penalize_malformed_think_tag:
        flags["malformed_think_tag"] = malformed_thinking_flags(texts, token_ids, cfg, starts, tokenizer_think_ids)
    any_b = penalized(flags, batch)
    metrics = {f"reward_penalty/{name}": flag_b.float().mean().item() if batch else 0.0
               for name, flag_b in flags.items()}
    metrics["reward_penalty/any"] = any_b.float().mean().item() if batch else 0.0
    any_b = any_b.to(rewards.device)
    return torch.where(any_b, torch.zeros_like(rewards), rewards), flags, metrics


def penalized(flags: dict[str, torch.Tensor], batch: int) -> torch.Tensor:
    """BoolTensor[B]: any detector of ``flags`` (as :func:`apply_reward_penalties` returns them) fired."""
    any_b = torch.zeros(batch, dtype=torch.bool)
    for flag_b in flags.values():
        any_b |= flag_b.cpu()
    return any_b


def penalize_components(components_bk: torch.Tensor, flags: dict[str, torch.Tensor]) -> torch.Tensor:
    """GDPO's reward components ``[B, K]`` with every component of a penalised sample set to 0.

    The penalties zero the sample's reward; zeroing each component keeps NeMo-RL's multi-reward contract
    reward = Σ_k components (NeMo-RL's own penalties zero only the scalar reward, and its
    ``validate_reward_components_match_scalar`` then stops the run).

        >>> flags = {"empty_final_answer": torch.tensor([True, False])}
        >>> penalize_components(torch.tensor([[1.0, 0.5], [1.0, 0.5]]), flags)
        tensor([[0.0000, 0.0000],
                [1.0000, 0.5000]])
    """
    any_b = penalized(flags, components_bk.shape[0]).to(components_bk.device)
    return torch.where(any_b[:, None], torch.zeros_like(components_bk), components_bk)
