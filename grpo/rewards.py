"""Reward post-processing: penalties (reward zeroing), linear scaling, DAPO overlong shaping.

Order in the loop: ``apply_reward_penalties`` -> ``scale_rewards`` -> ``shape_overlong_rewards``.
Rewards are ``[B]`` float tensors; GDPO's reward components ``[B, K]`` go through the same steps
(``penalize_components`` -> ``scale_rewards`` -> ``shape_overlong_components``). Inputs are never modified.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple, Optional, Sequence

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
# Penalty detectors. A sample is the list of its generated assistant messages (turns); NeMo-RL checks
# each assistant message (`nemo_rl/experience/rollouts.py`, ``apply_reward_penalties``), so do these.
# --------------------------------------------------------------------------------------------------
class Turn(NamedTuple):
    """One generated assistant message of a sample: its text, its token ids, and ``starts_in_think``: the
    text just before it (the prompt, or an observation and the next generation prompt) left a think block
    open (:func:`prompt_starts_in_think`)."""

    text: str
    token_ids: Sequence[int] | torch.Tensor = ()
    starts_in_think: bool = False


def split_turn(text: str, open_tag: str, close_tag: str, starts_in_think: bool = False
               ) -> tuple[Optional[str], Optional[str]]:
    """(reasoning, content) of one assistant message, as a reasoning parser splits it (vLLM's, behind
    NeMo-Gym's ``reasoning`` and ``message`` output items).

    content = the text after the first close tag; reasoning = the text before it (after the open tag).
    Without a close tag: all reasoning when a think block was opened (in the message or before it,
    ``starts_in_think``: the thinking never ended), else all content. None where the part is absent
    (nothing at all: NeMo-Gym makes no item of it); whitespace is kept.

        >>> split_turn("<think>a</think> 4", "<think>", "</think>")
        ('a', ' 4')
        >>> split_turn("a</think>", "<think>", "</think>", starts_in_think=True)
        ('a', None)
        >>> split_turn("4", "<think>", "</think>"), split_turn("<think>a", "<think>", "</think>")
        ((None, '4'), ('a', None))
    """
    if close_tag in text:
        head, _, content = text.partition(close_tag)
        reasoning = head.partition(open_tag)[2] if open_tag in head else head
    elif starts_in_think or open_tag in text:
        reasoning, content = (text.partition(open_tag)[2] if open_tag in text else text), ""
    else:
        reasoning, content = "", text
    return reasoning or None, content or None


def has_duplicated_reasoning(turns: Sequence[Turn], open_tag: str, close_tag: str) -> bool:
    """True when some turn's reasoning, stripped, equals its content, stripped (both non-empty): the model
    copied its thinking into its answer verbatim.

    NeMo-RL's ``penalize_duplicated_reasoning`` (`nemo_rl/experience/rollouts.py`, ``apply_reward_penalties``,
    penalty 1): a ``reasoning`` output item's summary text equal, after strip, to the next item's content
    text, in any turn.

        >>> has_duplicated_reasoning([Turn("<think> It is 42</think>It is 42\\n")], "<think>", "</think>")
        True
        >>> has_duplicated_reasoning([Turn("<think>Let me think</think>42")], "<think>", "</think>")
        False
    """
    for turn in turns:
        reasoning, content = split_turn(turn.text, open_tag, close_tag, turn.starts_in_think)
        if reasoning is not None and content is not None and reasoning.strip() and reasoning.strip() == content.strip():
            return True
    return False


def final_answer(turns: Sequence[Turn], open_tag: str, close_tag: str) -> Optional[str]:
    """The content of the last turn that has content (:func:`split_turn`), stripped; None when no turn has.

    NeMo-RL's final answer (``apply_reward_penalties``, penalty 2) is the text of the last output item that
    carries content, found walking back: a turn that only thought (or whose thinking never ended) has no
    content item and is passed over.
    """
    for turn in reversed(turns):
        content = split_turn(turn.text, open_tag, close_tag, turn.starts_in_think)[1]
        if content is not None:
            return content.strip()
    return None


def has_empty_final_answer(turns: Sequence[Turn], open_tag: str, close_tag: str) -> bool:
    """True when :func:`final_answer` is missing or blank (NeMo-RL's ``penalize_empty_final_answer``).

        >>> has_empty_final_answer([Turn("<think>a</think> 4"), Turn("<think>b</think>")], "<think>", "</think>")
        False
        >>> has_empty_final_answer([Turn("<think>a</think>\\n\\n")], "<think>", "</think>")
        True
    """
    return not final_answer(turns, open_tag, close_tag)


_SEGMENT_SPLIT = re.compile(r"\n+|(?<=[.!?])\s+")


def has_repeated_lines(text: str, min_chars: int, min_repeats: int) -> bool:
    """True when some line or sentence (stripped, >= min_chars characters) occurs >= min_repeats times
    (grpo-ds's own ``penalize_repeated_lines``: a model stuck in a loop).

        >>> has_repeated_lines("Let me check this again.\\n" * 3, min_chars=10, min_repeats=3)
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
    """True unless one assistant message has no think tags or exactly one ``open … close`` pair.

    Catches unbalanced, nested, close-before-open and repeated blocks. ``starts_in_think``: the text
    before the message already ends with the open tag (chat templates that open the thinking block), so
    the message must hold exactly one close tag and no open tag. Per message: a conversation that thinks
    once in each of its turns is well formed (NeMo-RL checks each (user, assistant) pair).
    """
    return not _well_formed(_tag_events(text, open_tag, close_tag), starts_in_think)


def has_malformed_think_token_ids(
    token_ids: Sequence[int], open_id: int, close_id: int, starts_in_think: bool = False
) -> bool:
    """:func:`has_malformed_think_tags` on token ids (the tags as single special tokens)."""
    events = ["open" if t == open_id else "close" for t in token_ids if t in (open_id, close_id)]
    return not _well_formed(events, starts_in_think)


def has_unwanted_tokens(token_ids: Sequence[int] | torch.Tensor, unwanted: Sequence[int]) -> bool:
    """True when any token id is in ``unwanted``."""
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


def _think_ids(cfg: RewardPenaltyConfig, tokenizer_think_ids: Optional[tuple[int, int]]) -> Optional[tuple[int, int]]:
    """The configured ``token_ids.think_open`` / ``think_close`` when both are set (NeMo-RL: explicit ids win),
    else the tokenizer's (:func:`single_token_think_ids`)."""
    ids_cfg = cfg.token_ids
    if ids_cfg is not None and None not in (ids_cfg.think_open, ids_cfg.think_close):
        return ids_cfg.think_open, ids_cfg.think_close
    return tokenizer_think_ids


def single_token_think_ids(tokenizer, open_tag: str, close_tag: str) -> Optional[tuple[int, int]]:
    """(open id, close id) when each think tag encodes to exactly one token (Qwen3's ``<think>``), else None:
    NeMo-RL's inference of the think ids (`nemo_rl/experience/rollouts.py`, ``resolve_reward_penalty_config``),
    which then checks the tags on the token ids too."""
    ids = [tokenizer.encode(tag, add_special_tokens=False) for tag in (open_tag, close_tag)]
    return (int(ids[0][0]), int(ids[1][0])) if all(len(i) == 1 for i in ids) else None


def malformed_thinking_flags(
    turns: Sequence[Turn],
    cfg: RewardPenaltyConfig,
    tokenizer_think_ids: Optional[tuple[int, int]] = None,
) -> torch.Tensor:
    """BoolTensor[N]: assistant message n has malformed think tags (:func:`has_malformed_think_tags` on its
    text with ``cfg.think_open_tag`` / ``think_close_tag``, and :func:`has_malformed_think_token_ids` when
    think ids are known: ``tokenizer_think_ids`` or ``cfg.token_ids.think_open`` / ``think_close``).

    One entry per message: the messages of one sample for ``penalize_malformed_think_tag`` (any flagged
    zeroes it), or every message to flag for ``grpo.malformed_thinking_advantage``. Reads no ``penalize_*``
    switch and changes no reward.

        >>> cfg = RewardPenaltyConfig()
        >>> malformed_thinking_flags([Turn("why</think> 4", starts_in_think=True), Turn("why</think> 4")], cfg)
        tensor([False,  True])
    """
    think_ids = _think_ids(cfg, tokenizer_think_ids)
    flags = []
    for turn in turns:
        bad = has_malformed_think_tags(turn.text, cfg.think_open_tag, cfg.think_close_tag, turn.starts_in_think)
        if think_ids is not None:
            ids = turn.token_ids.tolist() if isinstance(turn.token_ids, torch.Tensor) else turn.token_ids
            bad = bad or has_malformed_think_token_ids(ids, *think_ids, turn.starts_in_think)
        flags.append(bad)
    return torch.tensor(flags, dtype=torch.bool)


# Detector -> (its reward_penalties switch, its rate's metric name: NeMo-RL's where NeMo-RL has the detector,
# `nemo_rl/experience/rollouts.py`, _PENALTY_METRICS).
PENALTY_METRICS = {
    "duplicated_reasoning": ("penalize_duplicated_reasoning", "reasoning_equal_to_final_answer_rate"),
    "empty_final_answer": ("penalize_empty_final_answer", "empty_final_answer_rate"),
    "unwanted_tokens": ("penalize_unwanted_tokens", "unwanted_token_rate"),
    "malformed_think_tag": ("penalize_malformed_think_tag", "malformed_think_tag_rate"),
    "repeated_lines": ("penalize_repeated_lines", "repeated_lines_rate"),
}


def apply_reward_penalties(
    rewards: torch.Tensor,
    turns: Sequence[Sequence[Turn]],
    cfg: RewardPenaltyConfig,
    tokenizer_think_ids: Optional[tuple[int, int]] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Set the reward to 0 where any enabled detector fires (NeMo-RL's ``apply_reward_penalties``).

    ``turns[b]``: the generated assistant messages of sample b (:class:`Turn`: text and token ids without
    prompt or padding, and whether a think block was open before it). Detectors
    (``reward_penalties.penalize_*``), each over the sample's turns:

    - duplicated_reasoning: a turn's reasoning equals its content (:func:`has_duplicated_reasoning`);
    - empty_final_answer: the last content is missing or blank (:func:`has_empty_final_answer`);
    - unwanted_tokens: a turn holds a token of ``token_ids.unwanted``;
    - malformed_think_tag: a turn's think tags are malformed (:func:`malformed_thinking_flags`);
    - repeated_lines (grpo-ds's own): a line or sentence repeats in the sample's text, think tags counting
      as line breaks (:func:`has_repeated_lines`).

    Returns (rewards', flags, metrics): ``flags[name]`` is a BoolTensor[B] per enabled detector; metrics
    hold each enabled detector's rate over samples under NeMo-RL's name (``PENALTY_METRICS``) and
    ``reward_penalty_rate``, the fraction zeroed (none without an enabled detector). GDPO's components:
    :func:`penalize_components` with these flags.

        >>> cfg = RewardPenaltyConfig(penalize_malformed_think_tag=True)
        >>> two_turns = [Turn("<think>a</think>x"), Turn("<think>b</think>y")]
        >>> apply_reward_penalties(torch.tensor([1.0, 1.0]), [two_turns, [Turn("<think>a</think>x</think>")]], cfg)[0]
        tensor([1., 0.])
    """
    batch = rewards.shape[0]
    if len(turns) != batch:
        raise ValueError(f"apply_reward_penalties: {batch} rewards but turns of {len(turns)} samples")
    open_tag, close_tag = cfg.think_open_tag, cfg.think_close_tag

    def per_sample(detect) -> torch.Tensor:
        return torch.tensor([bool(detect(sample)) for sample in turns], dtype=torch.bool)

    flags: dict[str, torch.Tensor] = {}
    if cfg.penalize_duplicated_reasoning:
        flags["duplicated_reasoning"] = per_sample(lambda ts: has_duplicated_reasoning(ts, open_tag, close_tag))
    if cfg.penalize_empty_final_answer:
        flags["empty_final_answer"] = per_sample(lambda ts: has_empty_final_answer(ts, open_tag, close_tag))
    if cfg.penalize_unwanted_tokens:
        flags["unwanted_tokens"] = per_sample(lambda ts: any(has_unwanted_tokens(t.token_ids, cfg.token_ids.unwanted)
                                                             for t in ts))
    if cfg.penalize_malformed_think_tag:
        flags["malformed_think_tag"] = per_sample(
            lambda ts: bool(malformed_thinking_flags(ts, cfg, tokenizer_think_ids).any()))
    if cfg.penalize_repeated_lines:
        flags["repeated_lines"] = per_sample(lambda ts: has_repeated_lines(
            "\n".join(t.text for t in ts).replace(open_tag, "\n").replace(close_tag, "\n"),
            cfg.repeated_line_min_chars, cfg.repeated_line_min_repeats))
    any_b = penalized(flags, batch)
    metrics = {PENALTY_METRICS[name][1]: flag_b.float().mean().item() if batch else 0.0
               for name, flag_b in flags.items()}
    if flags:
        metrics["reward_penalty_rate"] = any_b.float().mean().item() if batch else 0.0
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


# ---- reward transforms a wing registers ------------------------------------------------------------
# (applies(trajectories) -> bool, transform(rewards_b, trajectories, reward_penalties, env_cfg, tokenizer) ->
# (rewards_b', flags, metrics)), in registration order: the first whose ``applies`` holds for a batch replaces the
# built-in penalties on it (`grpo.step.penalize`; NeMo-Gym's effort levels and penalties on its results).
_REWARD_TRANSFORMS: list[tuple[Callable, Callable]] = []


def register_reward_transform(applies: Callable, transform: Callable) -> None:
    """Make ``transform`` the penalty stage of the batches ``applies`` claims (a wing calls it when imported)."""
    _REWARD_TRANSFORMS.append((applies, transform))


def reward_transform(trajectories: Sequence) -> Optional[Callable]:
    """The registered transform that claims these trajectories, or None (the built-in penalties apply)."""
    return next((transform for applies, transform in _REWARD_TRANSFORMS if applies(trajectories)), None)
