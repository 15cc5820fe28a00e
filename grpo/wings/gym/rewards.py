"""Reward penalties and effort levels on NeMo-Gym results, exactly as NeMo-RL applies them.

NeMo-RL shapes a Gym prompt group's rewards in its rollout (``nemo_rl/experience/rollouts.py``,
``_postprocess_single_nemo_gym_group``), in this order, before GRPO's own scaling and shaping:

    1. effort levels   reward' = r + r·max(ℓ, 0) + low_penalty·min(ℓ, 0),  ℓ = min(1, low_weight·(1 − len/low_ub))
                       for samples whose last user message holds ``env.nemo_gym.effort_levels.low_string``
                       (len: the last message's tokens when it is the assistant's, else 0)
    2. penalties       reward' = 0 where an enabled ``reward_penalties.penalize_*`` detector fires

The detectors read what a Gym result holds (``apply_reward_penalties`` there), not the text re-split:

- duplicated_reasoning: a ``reasoning`` output item's summary text equals, stripped, the next item's content text;
- empty_final_answer: the last output item with content has no text (skipped when the last item is a
  ``function_call``: the agent was mid-loop);
- unwanted_tokens: an assistant message holds a token of ``reward_penalties.token_ids.unwanted``;
- malformed_think_tag: (a) an assistant message flagged ``malformed_thinking`` by the Gym detector
  (`gym_message_flags`), or (b) when the think tags are one token each (or ``token_ids.think_open/close`` are
  set), a (user, assistant) message pair whose counts break the rule: prompt open == close → the reply holds no
  tag; open == close + 1 → the reply holds exactly one close and no open; any other prompt is a violation; or
  (c) an output item's ``generation_str`` holds an open tag, or more than one close tag.

Per message, the Gym detector (NeMo-RL's ``_detect_invalid_tool_call_and_malformed_thinking``) flags the last
output item of each model call: ``invalid_tool_call`` when its text holds one of
``env.nemo_gym.invalid_tool_call_patterns`` (a tool call written as text, never executed), ``malformed_thinking``
when a content message holds any thinking tag or a reasoning summary holds one tag more than once. Those flags
feed ``grpo.invalid_tool_call_advantage`` / ``malformed_thinking_advantage`` (`grpo.step.step_advantages`) and
detector (a) above.

What the core Gym path hands over (`gym_sample`): a `grpo.trajectory.Trajectory` whose ``messages`` are NeMo-RL's
message log (per model call an untrained ``user`` message of its new prompt tokens and a trained ``assistant``
message, its ``flags`` from `annotate_gym_items`), ``metadata["nemo_gym_result"]`` the result without token fields
(its ``response.output`` items; each item that carried generated tokens with ``generation_str``, their decoded
text, as NeMo-RL sets it: `annotate_gym_items` again, called before the token fields are stripped) and
``metadata["meta"]`` the data row (``responses_create_params.input``).
"""

from __future__ import annotations

import statistics
from typing import Any, NamedTuple, Optional, Sequence

import torch

from grpo.config import EffortLevelsConfig, RewardPenaltyConfig
from grpo.rewards import PENALTY_METRICS, has_repeated_lines, penalized

DEFAULT_INVALID_TOOL_CALL_PATTERNS = ("<tool_call>", "</tool_call>", "<function_call>", "</function_call>")
DEFAULT_THINKING_TAGS = ("<think>", "</think>")
RESULT_KEY, ROW_KEY = "nemo_gym_result", "meta"  # where the core Gym path keeps a sample's result and row


# --------------------------------------------------------------------------------------------------
# Per message: the Gym detector
# --------------------------------------------------------------------------------------------------
def _first_text(parts) -> Optional[str]:
    """``parts[0]["text"]`` when ``parts`` is a non-empty list whose first part is a dict with a str text."""
    if isinstance(parts, list) and parts and isinstance(parts[0], dict) and isinstance(parts[0].get("text"), str):
        return parts[0]["text"]
    return None


def detect_invalid_tool_call_and_malformed_thinking(
    item: dict, invalid_tool_call_patterns: Optional[Sequence[str]] = None,
    thinking_tags: Optional[Sequence[str]] = None,
) -> tuple[bool, bool]:
    """(is_invalid_tool_call, has_malformed_thinking) of the last output item of a model call (NeMo-RL's
    ``_detect_invalid_tool_call_and_malformed_thinking``). A content message (``content[0].text``): invalid when
    it holds a pattern, malformed when it holds any thinking tag. A reasoning item (``summary[0].text``): invalid
    when it holds a pattern, malformed when a tag occurs more than once. Empty / null patterns or tags: NeMo-RL's
    defaults.

        >>> detect_invalid_tool_call_and_malformed_thinking({"content": [{"text": "<tool_call>f()</tool_call>"}]})
        (True, False)
        >>> detect_invalid_tool_call_and_malformed_thinking({"type": "reasoning", "summary": [{"text": "a<think>b"}]})
        (False, False)
    """
    patterns = invalid_tool_call_patterns or DEFAULT_INVALID_TOOL_CALL_PATTERNS
    tags = thinking_tags or DEFAULT_THINKING_TAGS
    content = _first_text(item.get("content"))
    if content is not None:
        return any(p in content for p in patterns), any(t in content for t in tags)
    summary = _first_text(item.get("summary")) if item.get("type") == "reasoning" else None
    if summary is not None:
        return any(p in summary for p in patterns), any(summary.count(t) > 1 for t in tags)
    return False, False


def gym_message_flags(item: dict, invalid_tool_call_patterns: Optional[Sequence[str]] = None,
                      thinking_tags: Optional[Sequence[str]] = None) -> list[str]:
    """`grpo.trajectory.Message.flags` of the assistant message a model call's last output item makes.

        >>> gym_message_flags({"content": [{"text": "<think>x</think> <function_call>"}]})
        ['invalid_tool_call', 'malformed_thinking']
    """
    invalid, malformed = detect_invalid_tool_call_and_malformed_thinking(item, invalid_tool_call_patterns,
                                                                        thinking_tags)
    return [name for name, on in (("invalid_tool_call", invalid), ("malformed_thinking", malformed)) if on]


def annotate_gym_items(result: dict, decode, invalid_tool_call_patterns: Optional[Sequence[str]] = None,
                       thinking_tags: Optional[Sequence[str]] = None) -> list[list[str]]:
    """What NeMo-RL's postprocess adds to a Gym result (``_postprocess_nemo_gym_to_nemo_rl_result``), in place:
    every output item that carries generated tokens (a non-empty ``generation_token_ids``: one model call) gets
    ``generation_str``, their decoded text (what penalty 4c reads). Returns, per model call in order, the
    `gym_message_flags` of its assistant message. Call it on the result before its token fields are stripped:

        flags = annotate_gym_items(result, decode, nemo_gym.invalid_tool_call_patterns, nemo_gym.thinking_tags)
        for message, f in zip([m for m in messages if m.role == "assistant"], flags):
            message.flags = f

        >>> res = {"response": {"output": [{"type": "message", "content": [{"text": "<tool_call>"}],
        ...                                 "generation_token_ids": [5, 6]}, {"type": "function_call_output"}]}}
        >>> annotate_gym_items(res, decode=lambda ids: "x" * len(ids)), res["response"]["output"][0]["generation_str"]
        ([['invalid_tool_call']], 'xx')
    """
    flags = []
    for item in result["response"]["output"]:
        if isinstance(item, dict) and item.get("generation_token_ids"):
            item["generation_str"] = decode(list(item["generation_token_ids"]))
            flags.append(gym_message_flags(item, invalid_tool_call_patterns, thinking_tags))
    return flags


def thinking_tags_of(nemo_gym) -> list[str]:
    """NeMo-RL's ``get_nemo_gym_thinking_tags``: ``env.nemo_gym.thinking_tags`` when set and non-empty, else
    ``<think>``, ``</think>``. ``nemo_gym``: the section (a dict or a model with the attribute) or None."""
    tags = nemo_gym.get("thinking_tags") if isinstance(nemo_gym, dict) else getattr(nemo_gym, "thinking_tags", None)
    return list(tags) if tags else list(DEFAULT_THINKING_TAGS)


# --------------------------------------------------------------------------------------------------
# Effort levels
# --------------------------------------------------------------------------------------------------
def effort_levels_of(nemo_gym) -> Optional[EffortLevelsConfig]:
    """NeMo-RL's ``_get_effort_config``: ``env.nemo_gym.effort_levels`` validated, or None when unset."""
    value = nemo_gym.get("effort_levels") if isinstance(nemo_gym, dict) else getattr(nemo_gym, "effort_levels", None)
    if value is None or isinstance(value, EffortLevelsConfig):
        return value
    return EffortLevelsConfig.model_validate(value.model_dump() if hasattr(value, "model_dump") else value)


def last_user_prompt(prompt_input) -> Any:
    """The ``content`` of the last ``user`` message of ``responses_create_params.input`` that has one, else ""
    (NeMo-RL's lookup in ``_apply_effort_shaping``; a string input has no messages: "")."""
    if not isinstance(prompt_input, list):
        return ""
    return next((m["content"] for m in reversed(prompt_input)
                 if isinstance(m, dict) and m.get("role") == "user" and "content" in m), "")


def effort_length_reward(length: int, cfg: EffortLevelsConfig) -> float:
    """ℓ = min(1, low_weight · (1 − length / low_ub)).

        >>> effort_length_reward(100, EffortLevelsConfig(low_weight=1.0, low_ub=1000))
        0.9
    """
    return min(1.0, cfg.low_weight * (1.0 - length / cfg.low_ub))


def apply_effort_shaping(rewards_b: torch.Tensor, lengths: Sequence[int], prompts: Sequence[Any],
                         cfg: Optional[EffortLevelsConfig]) -> tuple[torch.Tensor, dict[str, float]]:
    """NeMo-RL's ``_apply_effort_shaping`` on ``[B]`` rewards: for sample b whose prompt (`last_user_prompt`)
    contains ``low_string``, with ℓ = `effort_length_reward` (lengths[b]),

        r'_b = r_b + r_b · max(ℓ, 0) + low_penalty · min(ℓ, 0)

    Others keep r_b. Off (rewards unchanged, no metrics) without cfg, with low_weight <= 0 or an empty
    low_string. Metrics (NeMo-RL's names): ``mean_length_reward_low``, ``mean_reward_low``, ``mean_length_low``,
    ``median_length_low`` over the shaped samples, ``mean_length_high``, ``median_length_high`` over the others.

        >>> cfg = EffortLevelsConfig(low_weight=1.0, low_penalty=2.0, low_ub=100, low_string="<budget>")
        >>> apply_effort_shaping(torch.tensor([1.0, 1.0]), [50, 200], ["<budget> go", "go"], cfg)[0]
        tensor([1.5000, 1.0000])
    """
    if cfg is None or cfg.low_weight <= 0 or not cfg.low_string:
        return rewards_b, {}
    out = rewards_b.clone()
    length_rewards, shaped, low, high = [], [], [], []
    for b, (length, prompt) in enumerate(zip(lengths, prompts, strict=True)):
        if cfg.low_string in prompt:
            ell, r = effort_length_reward(length, cfg), float(rewards_b[b])
            out[b] = r + r * max(ell, 0.0) + cfg.low_penalty * min(ell, 0.0)
            length_rewards.append(ell)
            shaped.append(float(out[b]))
            low.append(length)
        else:
            high.append(length)
    metrics: dict[str, float] = {}
    if low:
        metrics.update(mean_length_reward_low=sum(length_rewards) / len(low), mean_reward_low=sum(shaped) / len(low),
                       mean_length_low=sum(low) / len(low), median_length_low=float(statistics.median(low)))
    if high:
        metrics.update(mean_length_high=sum(high) / len(high), median_length_high=float(statistics.median(high)))
    return out, metrics


# --------------------------------------------------------------------------------------------------
# Reward penalties
# --------------------------------------------------------------------------------------------------
class GymSample(NamedTuple):
    """What NeMo-RL's penalties read of one Gym sample: its message log (`grpo.trajectory.Message`s: ``role``,
    ``token_ids``, ``flags``), its result's ``response.output`` items and its row's
    ``responses_create_params.input``."""

    messages: list
    output_items: list[dict]
    prompt_input: Any = None


def gym_sample(traj) -> Optional[GymSample]:
    """A core-path Trajectory as a `GymSample` (module docstring), or None for a failed sample (no result)."""
    result = (traj.metadata or {}).get(RESULT_KEY)
    if not traj.scored or not isinstance(result, dict):
        return None
    row = (traj.metadata or {}).get(ROW_KEY) or {}
    return GymSample(list(traj.messages), list((result.get("response") or {}).get("output") or []),
                     (row.get("responses_create_params") or {}).get("input"))


def _item_text(content) -> Optional[str]:
    """The text of an item's ``content`` as NeMo-RL's penalties read it: ``content[0].text`` or a plain string,
    stripped; None for anything else."""
    if isinstance(content, list) and content and isinstance(content[0], dict) and "text" in content[0]:
        return content[0]["text"].strip()
    if isinstance(content, str):
        return content.strip()
    return None


def has_duplicated_reasoning(output_items: Sequence[dict]) -> bool:
    """Penalty 1: a ``reasoning`` item whose ``summary[0].text``, stripped, equals the next item's content text
    (both non-empty).

        >>> has_duplicated_reasoning([{"type": "reasoning", "summary": [{"text": " 42 "}]},
        ...                           {"type": "message", "content": [{"text": "42"}]}])
        True
    """
    for item, following in zip(output_items, output_items[1:]):
        if item.get("type") != "reasoning":
            continue
        summary = item.get("summary", [])
        if not summary or "text" not in summary[0]:
            continue
        reasoning, chat = summary[0]["text"].strip(), _item_text(following.get("content", ""))
        if chat is not None and reasoning and chat and reasoning == chat:
            return True
    return False


def has_empty_final_answer(output_items: Sequence[dict]) -> bool:
    """Penalty 2: walking back over the items that have ``content``, the first readable one (`_item_text`) is
    empty, or there is none; never when the last item is a ``function_call``.

        >>> has_empty_final_answer([{"type": "message", "content": [{"text": "  "}]}])
        True
        >>> has_empty_final_answer([{"type": "reasoning", "summary": []}, {"type": "function_call"}])
        False
    """
    if output_items and output_items[-1].get("type") == "function_call":
        return False
    for item in reversed(output_items):
        if "content" in item:
            text = _item_text(item["content"])
            if text is not None:
                return text == ""
    return True


def has_unwanted_token(messages: Sequence, unwanted: Sequence[int]) -> bool:
    """Penalty 3: an assistant message holds a token of ``unwanted`` (its last position included)."""
    bad = set(unwanted)
    return any(m.role == "assistant" and not bad.isdisjoint(m.token_ids) for m in messages)


def resolve_think_ids(rp: RewardPenaltyConfig, tokenizer, tags: Sequence[str]) -> tuple[Optional[int], Optional[int]]:
    """(think_open, think_close) token ids as NeMo-RL's ``resolve_reward_penalty_config`` resolves them: the
    configured ``token_ids.think_open`` / ``think_close``; a missing one is inferred from the tokenizer when its
    tag encodes to exactly one token, and inferred ids are kept only when an id was configured or both infer.
    (None, None): the token check is skipped; exactly one None: `malformed_think_tag` raises, as NeMo-RL does."""
    ids = rp.token_ids
    open_id, close_id = (ids.think_open, ids.think_close) if ids is not None else (None, None)
    if len(tags) < 2:
        return open_id, close_id

    def infer(tag):
        if tokenizer is None:
            return None
        encoded = tokenizer.encode(tag, add_special_tokens=False)
        return int(encoded[0]) if len(encoded) == 1 else None

    inferred_open = None if open_id is not None else infer(tags[0])
    inferred_close = None if close_id is not None else infer(tags[1])
    if open_id is not None or close_id is not None or (inferred_open is not None and inferred_close is not None):
        open_id = inferred_open if inferred_open is not None else open_id
        close_id = inferred_close if inferred_close is not None else close_id
    return open_id, close_id


def has_malformed_think_tag(sample: GymSample, think_ids: tuple[Optional[int], Optional[int]],
                            tags: Sequence[str]) -> bool:
    """Penalty 4 (module docstring: (a) the message flag, (b) token counts per (user, assistant) pair when both
    think ids are known, (c) ``generation_str`` per output item: no open tag, at most one close tag).

        >>> from grpo.trajectory import Message
        >>> msgs = [Message("user", "", [1, 7]), Message("assistant", "", [5, 8, 6], [0.0] * 3)]
        >>> has_malformed_think_tag(GymSample(msgs, []), (7, 8), ["<think>", "</think>"])  # open in prompt, one close
        False
        >>> has_malformed_think_tag(GymSample(msgs, [{"generation_str": "a</think>b</think>"}]), (None, None),
        ...                         ["<think>", "</think>"])
        True
    """
    open_id, close_id = think_ids
    if (open_id is None) != (close_id is None):
        raise ValueError("reward_penalties.token_ids.think_open and reward_penalties.token_ids.think_close must both "
                         "be set")
    msgs = sample.messages
    if any(m.role == "assistant" and "malformed_thinking" in m.flags for m in msgs):
        return True
    if open_id is not None:
        for user, reply in zip(msgs, msgs[1:]):
            if user.role != "user" or reply.role != "assistant":
                continue
            p_open, p_close = user.token_ids.count(open_id), user.token_ids.count(close_id)
            if p_open == p_close:
                expected = (0, 0)  # thinking off: both tags in the prompt, none generated
            elif p_open == p_close + 1:
                expected = (0, 1)  # thinking on: the prompt opened the block, the reply closes it
            else:
                return True
            if (reply.token_ids.count(open_id), reply.token_ids.count(close_id)) != expected:
                return True
    if len(tags) < 2:
        raise ValueError("reward_penalties.thinking_tags must contain open and close tags")
    open_tag, close_tag = tags[0], tags[1]
    for item in sample.output_items:
        text = item.get("generation_str", "")
        if text and (text.count(open_tag) > 0 or text.count(close_tag) > 1):
            return True
    return False


def apply_gym_reward_penalties(
    rewards_b: torch.Tensor, samples: Sequence[Optional[GymSample]], rp: RewardPenaltyConfig,
    think_ids: tuple[Optional[int], Optional[int]] = (None, None),
    thinking_tags: Sequence[str] = DEFAULT_THINKING_TAGS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """NeMo-RL's ``apply_reward_penalties`` on Gym samples: r'_b = 0 where an enabled detector fires on sample
    b (module docstring), else r_b. ``samples[b]`` None (a failed sample) is never flagged.

    Returns (rewards', flags, metrics) as `grpo.rewards.apply_reward_penalties` does, so GDPO's components follow
    (`grpo.rewards.penalize_components`): ``flags[name]`` a BoolTensor[B] per enabled detector; metrics each
    enabled detector's rate over the scored samples under NeMo-RL's name (``empty_final_answer_rate``, ...) and
    ``reward_penalty_rate``. grpo-ds's own ``penalize_repeated_lines`` reads the generated messages' text.
    A message log with a role other than user / assistant is a ValueError (NeMo-RL asserts it).
    """
    batch = rewards_b.shape[0]
    if len(samples) != batch:
        raise ValueError(f"apply_gym_reward_penalties: {batch} rewards but {len(samples)} samples")
    scored = [s for s in samples if s is not None]
    enabled = [name for name, (flag, _) in PENALTY_METRICS.items() if getattr(rp, flag)]
    if enabled:
        for s in scored:
            roles = {m.role for m in s.messages}
            if not roles <= {"user", "assistant"}:
                raise ValueError(f"NeMo-Gym reward penalties need a message log of user and assistant messages, got "
                                 f"roles {sorted(roles)}")
    detectors = {
        "duplicated_reasoning": lambda s: has_duplicated_reasoning(s.output_items),
        "empty_final_answer": lambda s: has_empty_final_answer(s.output_items),
        "unwanted_tokens": lambda s: has_unwanted_token(s.messages, rp.token_ids.unwanted),
        "malformed_think_tag": lambda s: has_malformed_think_tag(s, think_ids, thinking_tags),
        "repeated_lines": lambda s: has_repeated_lines(
            "\n".join(m.content for m in s.messages if m.role == "assistant"),
            rp.repeated_line_min_chars, rp.repeated_line_min_repeats),
    }
    flags = {name: torch.tensor([s is not None and bool(detectors[name](s)) for s in samples], dtype=torch.bool)
             for name in enabled}
    any_b = penalized(flags, batch)
    metrics = {PENALTY_METRICS[name][1]: flag_b.sum().item() / max(len(scored), 1) for name, flag_b in flags.items()}
    if flags:
        metrics["reward_penalty_rate"] = any_b.sum().item() / max(len(scored), 1)
    return torch.where(any_b.to(rewards_b.device), torch.zeros_like(rewards_b), rewards_b), flags, metrics


# --------------------------------------------------------------------------------------------------
# The batch: what the core path (and grpo.step.penalize) calls
# --------------------------------------------------------------------------------------------------
def response_length(sample: GymSample) -> int:
    """NeMo-RL's effort length: the last message's tokens when it is the assistant's, else 0."""
    last = sample.messages[-1] if sample.messages else None
    return len(last.token_ids) if last is not None and last.role == "assistant" else 0


def shape_gym_rewards(
    rewards_b: torch.Tensor, trajectories: Sequence, rp: RewardPenaltyConfig, nemo_gym, tokenizer,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Effort levels, then reward penalties, on a batch of Gym samples, as NeMo-RL's Gym rollout applies them:

        rewards' = apply_gym_reward_penalties(apply_effort_shaping(rewards))

    ``rewards_b``: ``[B]`` raw rewards (the results' ``reward``); ``trajectories``: the core path's Trajectories
    (`gym_sample`; failed ones are left as they are); ``rp``: ``reward_penalties``; ``nemo_gym``: the
    ``env.nemo_gym`` section (``thinking_tags``, ``effort_levels``; a dict, a model or None); ``tokenizer``: the
    policy's (think ids of single-token tags). Returns (rewards', flags, metrics) like
    `grpo.rewards.apply_reward_penalties`, with the effort metrics added.
    """
    samples = [gym_sample(t) for t in trajectories]
    effort = effort_levels_of(nemo_gym)
    live = [b for b, s in enumerate(samples) if s is not None]
    shaped_b, metrics = apply_effort_shaping(
        rewards_b[live], [response_length(samples[b]) for b in live],
        [last_user_prompt(samples[b].prompt_input) for b in live], effort)
    rewards_b = rewards_b.clone()
    rewards_b[live] = shaped_b
    tags = thinking_tags_of(nemo_gym)
    think_ids = resolve_think_ids(rp, tokenizer, tags) if rp.penalize_malformed_think_tag else (None, None)
    out_b, flags, penalty_metrics = apply_gym_reward_penalties(rewards_b, samples, rp, think_ids, tags)
    return out_b, flags, {**metrics, **penalty_metrics}


def is_gym_batch(trajectories: Sequence) -> bool:
    """True when the samples come from the NeMo-Gym path (a sample carries ``metadata["nemo_gym_result"]``)."""
    return any(RESULT_KEY in (t.metadata or {}) for t in trajectories)
