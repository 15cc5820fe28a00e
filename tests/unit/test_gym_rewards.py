"""NeMo-RL's shaping of NeMo-Gym results (grpo/wings/gym/rewards.py): hand-made cases with NeMo-RL's expected values
(its tests/unit/test_effort_shaping.py and tests/unit/experience/test_reward_penalties.py cases, re-derived), and,
with a NeMo-RL checkout (NEMO_RL_CHECKOUT, its nemo_rl/ sources at 7ea279a), NeMo-RL's own functions run on
hundreds of generated cases beside ours: the same rewards, the same detector counts, the same errors."""

from __future__ import annotations

import ast
import os
import random
from pathlib import Path

import pytest
import torch

from grpo.config import EffortLevelsConfig, MasterConfig, RewardPenaltyConfig, reward_penalties_without_nemo_gym
from grpo.wings.gym.rewards import (
    GymSample, annotate_gym_items, apply_effort_shaping, apply_gym_reward_penalties, detect_invalid_tool_call_and_malformed_thinking,
    effort_levels_of, gym_message_flags, has_duplicated_reasoning, has_empty_final_answer, has_malformed_think_tag,
    last_user_prompt, resolve_think_ids, shape_gym_rewards, thinking_tags_of,
)
from grpo.trajectory import Failure, Message, Trajectory

TAGS = ["<think>", "</think>"]
OPEN, CLOSE = 7, 8  # the think tags' ids in these tests


def user(ids):
    return Message("user", "", list(ids))


def asst(ids, flags=(), text=""):
    return Message("assistant", text, list(ids), [0.0] * len(ids), list(flags))


def reasoning(text):
    return {"type": "reasoning", "summary": [{"type": "summary_text", "text": text}]}


def message(text, generation_str=None):
    item = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}
    if generation_str is not None:
        item["generation_str"] = generation_str
    return item


class OneTokenTags:
    """A tokenizer whose think tags are one token each (Qwen3's); every other text is two tokens."""

    def encode(self, text, add_special_tokens=False):
        return {"<think>": [OPEN], "</think>": [CLOSE]}.get(text, [1, 2])


class SplitTags:
    def encode(self, text, add_special_tokens=False):
        return [1, 2, 3]


# --------------------------------------------------------------------------------------------------
# The per-message detector
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("item, expected", [
    (message("<tool_call>{}</tool_call>"), (True, False)),
    (message("The answer is 4"), (False, False)),
    (message("<think>leak</think> 4"), (False, True)),        # any tag in the final content is malformed
    (reasoning("plan <function_call> x"), (True, False)),
    (reasoning("a <think> b"), (False, False)),              # one tag in a reasoning summary is fine ...
    (reasoning("a <think> b <think>"), (False, True)),       # ... a repeated one is not
    ({"type": "function_call", "name": "f", "arguments": "{}"}, (False, False)),
    ({"type": "message", "content": []}, (False, False)),
])
def test_detector_default_patterns_and_tags(item, expected):
    assert detect_invalid_tool_call_and_malformed_thinking(item) == expected


def test_detector_configured_patterns_and_tags_replace_the_defaults():
    item = message("[TOOL] f() <think>")
    assert detect_invalid_tool_call_and_malformed_thinking(item, ["[TOOL]"], ["<reason>"]) == (True, False)
    assert gym_message_flags(item, ["nope"], ["<think>"]) == ["malformed_thinking"]
    assert gym_message_flags(item, [], None) == ["malformed_thinking"]  # empty list: NeMo-RL's defaults
    assert thinking_tags_of({"thinking_tags": ["<r>", "</r>"]}) == ["<r>", "</r>"]
    assert thinking_tags_of({"thinking_tags": []}) == TAGS and thinking_tags_of(None) == TAGS


def test_annotate_sets_generation_str_and_flags_per_model_call_in_order():
    gen = lambda text, ids: {**message(text), "generation_token_ids": ids, "prompt_token_ids": [1]}  # noqa: E731
    result = {"response": {"output": [reasoning("plan"), gen("<think>a</think>", [5]),
                                      {"type": "function_call_output", "output": "3"}, gen("4", [6, 7]),
                                      {**message("no tokens"), "generation_token_ids": []}]}}
    flags = annotate_gym_items(result, lambda ids: "|".join(map(str, ids)), None, None)
    assert flags == [["malformed_thinking"], []]
    assert [item.get("generation_str") for item in result["response"]["output"]] == [None, "5", None, "6|7", None]


# --------------------------------------------------------------------------------------------------
# Effort levels
# --------------------------------------------------------------------------------------------------
def test_effort_defaults_and_off_switches():
    assert EffortLevelsConfig().model_dump() == {"low_weight": 0.0, "low_penalty": 1.0, "low_ub": 64000,
                                                 "low_string": ""}
    r = torch.tensor([1.0])
    for cfg in (None, EffortLevelsConfig(low_weight=0.0, low_string="<b>"), EffortLevelsConfig(low_weight=1.0)):
        out, metrics = apply_effort_shaping(r, [100], ["<b> go"], cfg)
        assert out.tolist() == [1.0] and metrics == {}


def test_effort_formula_short_long_and_capped():
    cfg = EffortLevelsConfig(low_weight=1.0, low_penalty=2.0, low_ub=1000, low_string="<budget>")
    out, m = apply_effort_shaping(torch.tensor([1.0, 1.0, 0.5]), [100, 3000, 7], ["<budget> a", "<budget> b", "c"], cfg)
    # 100/1000 -> l = 0.9 -> 1 + 0.9 = 1.9;  3000/1000 -> l = -2 -> 1 + 2 * -2 = -3;  no low_string: unchanged
    assert out.tolist() == pytest.approx([1.9, -3.0, 0.5])
    assert m == pytest.approx({"mean_length_reward_low": (0.9 - 2.0) / 2, "mean_reward_low": (1.9 - 3.0) / 2,
                               "mean_length_low": 1550.0, "median_length_low": 1550.0, "mean_length_high": 7.0,
                               "median_length_high": 7.0})
    capped = EffortLevelsConfig(low_weight=100.0, low_ub=1000, low_string="<budget>")
    assert apply_effort_shaping(torch.tensor([1.0]), [1], ["<budget>"], capped)[0].item() == pytest.approx(2.0)
    # a zero reward gains nothing from a short answer but still pays for a long one
    assert apply_effort_shaping(torch.tensor([0.0, 0.0]), [1, 2000], ["<budget>"] * 2, cfg)[0].tolist() == \
        pytest.approx([0.0, -2.0])


def test_effort_prompt_is_the_last_user_message_and_config_validates():
    rows = [{"role": "user", "content": "<budget> first"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "second"}]
    assert last_user_prompt(rows) == "second" and last_user_prompt("plain") == ""
    assert effort_levels_of({"effort_levels": {"low_weight": 0.1, "low_string": "{e}"}}).low_weight == 0.1
    assert effort_levels_of({}) is None
    with pytest.raises(ValueError, match="low_ub"):
        effort_levels_of({"effort_levels": {"low_ub": 0}})
    with pytest.raises(ValueError, match="low_wieght"):
        effort_levels_of({"effort_levels": {"low_wieght": 0.1}})


# --------------------------------------------------------------------------------------------------
# Reward penalties
# --------------------------------------------------------------------------------------------------
def test_duplicated_reasoning_and_empty_final_answer_read_output_items():
    assert has_duplicated_reasoning([reasoning(" 42\n"), message("42")])
    assert not has_duplicated_reasoning([reasoning("think"), message("42")])
    assert not has_duplicated_reasoning([reasoning(""), message("")])
    assert has_duplicated_reasoning([reasoning("x"), {"type": "message", "content": "x "}])  # a plain string
    assert not has_duplicated_reasoning([message("42"), reasoning("42")])  # order matters
    assert has_empty_final_answer([reasoning("r"), message("  \n")])
    assert has_empty_final_answer([reasoning("r")])                           # no content item at all
    assert not has_empty_final_answer([message("4"), {"type": "function_call_output", "output": "x"}])
    assert not has_empty_final_answer([reasoning("r"), {"type": "function_call", "name": "f"}])
    assert not has_empty_final_answer([message("4"), {"type": "reasoning", "content": None}])  # walks past it


def test_malformed_think_tag_token_rule_per_user_assistant_pair():
    ids = (OPEN, CLOSE)
    ok_on = [user([1, OPEN]), asst([5, CLOSE, 6])]             # thinking on: the reply closes the block once
    ok_off = [user([1, OPEN, 3, CLOSE]), asst([5, 6])]        # thinking off: both tags in the prompt, none generated
    assert not has_malformed_think_tag(GymSample(ok_on, []), ids, TAGS)
    assert not has_malformed_think_tag(GymSample(ok_off + ok_on, []), ids, TAGS)
    assert has_malformed_think_tag(GymSample([user([1, OPEN]), asst([5, 6])], []), ids, TAGS)       # never closed
    assert has_malformed_think_tag(GymSample([user([1]), asst([OPEN, 5, CLOSE])], []), ids, TAGS)   # opened itself
    assert has_malformed_think_tag(GymSample([user([OPEN, OPEN]), asst([CLOSE])], []), ids, TAGS)   # odd prompt
    assert has_malformed_think_tag(GymSample([user([1, OPEN]), asst([CLOSE], ["malformed_thinking"])], []),
                                   (None, None), TAGS)   # the Gym detector's flag
    with pytest.raises(ValueError, match="must both be set"):
        has_malformed_think_tag(GymSample(ok_on, []), (OPEN, None), TAGS)


def test_malformed_think_tag_string_rule_on_generation_str():
    msgs = [user([1]), asst([5])]
    assert not has_malformed_think_tag(GymSample(msgs, [message("a", "plan</think>a")]), (None, None), TAGS)
    assert has_malformed_think_tag(GymSample(msgs, [message("a", "<think>plan</think>a")]), (None, None), TAGS)
    assert has_malformed_think_tag(GymSample(msgs, [message("a", "p</think>q</think>")]), (None, None), TAGS)
    assert not has_malformed_think_tag(GymSample(msgs, [message("a")]), (None, None), TAGS)  # no generation_str


def test_think_ids_are_configured_or_inferred_from_single_token_tags():
    rp = RewardPenaltyConfig(penalize_malformed_think_tag=True)
    assert resolve_think_ids(rp, OneTokenTags(), TAGS) == (OPEN, CLOSE)
    assert resolve_think_ids(rp, SplitTags(), TAGS) == (None, None)
    explicit = RewardPenaltyConfig(penalize_malformed_think_tag=True, token_ids={"think_open": 12})
    assert resolve_think_ids(explicit, OneTokenTags(), TAGS) == (12, CLOSE)
    assert resolve_think_ids(explicit, SplitTags(), TAGS) == (12, None)  # then the detector raises, as NeMo-RL's


def test_apply_penalties_zeroes_counts_and_leaves_failed_samples():
    rp = RewardPenaltyConfig(penalize_duplicated_reasoning=True, penalize_empty_final_answer=True,
                             penalize_unwanted_tokens=True, token_ids={"unwanted": [9]})
    good = GymSample([user([1]), asst([5, 6])], [reasoning("r"), message("4")])
    dup = GymSample([user([1]), asst([5])], [reasoning("4"), message("4")])
    unwanted = GymSample([user([1]), asst([5, 9])], [message("4")])  # the last position counts too
    empty = GymSample([user([1]), asst([5])], [reasoning("r")])
    out, flags, m = apply_gym_reward_penalties(torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0]),
                                               [good, dup, unwanted, empty, None], rp)
    assert out.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert flags["duplicated_reasoning"].tolist() == [False, True, False, False, False]
    assert m == {"reasoning_equal_to_final_answer_rate": 0.25, "empty_final_answer_rate": 0.25,
                 "unwanted_token_rate": 0.25, "reward_penalty_rate": 0.75}
    assert apply_gym_reward_penalties(torch.tensor([1.0]), [good], RewardPenaltyConfig())[2] == {}
    with pytest.raises(ValueError, match="roles"):
        apply_gym_reward_penalties(torch.tensor([1.0]), [GymSample([Message("tool", "", [1]), asst([5])], [])], rp)


def gym_traj(reward, messages, output, prompt, error=None):
    return Trajectory(group_id=0, prompt_index=0, task_name="nemo_gym", question="", answer="", messages=messages,
                      metadata={"nemo_gym_result": {"reward": reward, "response": {"output": output}},
                                "meta": {"responses_create_params": {"input": prompt}}},
                      reward=None if error else reward, failure=error and Failure.of(error))


def test_shape_gym_rewards_runs_effort_then_penalties_and_step_penalize_dispatches():
    from grpo.step import penalize

    nemo_gym = {"effort_levels": {"low_weight": 1.0, "low_penalty": 1.0, "low_ub": 10, "low_string": "[low]"}}
    rp = RewardPenaltyConfig(penalize_empty_final_answer=True)
    trajs = [gym_traj(1.0, [user([1]), asst([5] * 5)], [message("4")], [{"role": "user", "content": "[low] 2+2"}]),
             gym_traj(1.0, [user([1]), asst([5] * 5)], [message(" ")], [{"role": "user", "content": "[low] 2+2"}]),
             gym_traj(1.0, [user([1]), asst([5] * 5)], [message("4")], [{"role": "user", "content": "2+2"}])]
    out, flags, m = shape_gym_rewards(torch.tensor([1.0, 1.0, 1.0]), trajs, rp, nemo_gym, OneTokenTags())
    assert out.tolist() == pytest.approx([1.5, 0.0, 1.0])  # l = 0.5 -> 1.5; zeroed after shaping
    assert m["empty_final_answer_rate"] == pytest.approx(1 / 3) and m["mean_length_low"] == 5.0

    class Env:
        nemo_gym = None

    out2, _, _, turns, _ = penalize(torch.tensor([1.0, 1.0, 1.0]), trajs, rp, OneTokenTags(), Env())
    assert out2.tolist() == [1.0, 0.0, 1.0] and turns is None  # no effort_levels: penalties alone


def test_penalties_need_nemo_gym_message_names_the_key():
    assert reward_penalties_without_nemo_gym(RewardPenaltyConfig(), False) is None
    assert reward_penalties_without_nemo_gym(RewardPenaltyConfig(penalize_unwanted_tokens=True,
                                                                 token_ids={"unwanted": [1]}), True) is None
    msg = reward_penalties_without_nemo_gym(RewardPenaltyConfig(penalize_malformed_think_tag=True), False)
    assert msg.startswith("reward_penalties.penalize_malformed_think_tag=true: ")
    # grpo-ds's own detector is not NeMo-RL's: it needs no Gym
    assert reward_penalties_without_nemo_gym(RewardPenaltyConfig(penalize_repeated_lines=True), False) is None
    assert MasterConfig().reward_penalties == RewardPenaltyConfig()


# --------------------------------------------------------------------------------------------------
# NeMo-RL's own functions beside ours (a NeMo-RL checkout)
# --------------------------------------------------------------------------------------------------
CHECKOUT = Path(os.environ["NEMO_RL_CHECKOUT"]) if os.environ.get("NEMO_RL_CHECKOUT") else None
NEEDED = {
    "nemo_rl/experience/rollouts.py": (
        "EffortLevelsConfig", "_EffortShapingMetrics", "_apply_effort_shaping", "_get_reward_penalty_config_value",
        "_get_reward_penalty_token_id", "_get_required_reward_penalty_token_id", "_get_reward_penalty_token_ids",
        "_get_required_reward_penalty_token_ids", "_infer_single_token_id", "resolve_reward_penalty_config",
        "apply_reward_penalties"),
    "nemo_rl/environments/nemo_gym.py": (
        "DEFAULT_INVALID_TOOL_CALL_PATTERNS", "DEFAULT_THINKING_TAGS", "_detect_invalid_tool_call_and_malformed_thinking"),
}


def nemo_rl_functions() -> dict:
    """NeMo-RL's definitions named in NEEDED, cut out of its sources with ast and run in one namespace (its
    modules import Ray and vLLM, so they cannot be imported here)."""
    from dataclasses import dataclass
    from typing import Any, Optional

    from pydantic import BaseModel

    ns = {"torch": torch, "Any": Any, "Optional": Optional, "BaseModel": BaseModel, "dataclass": dataclass,
          "__name__": __name__}  # a module in sys.modules (dataclasses look it up)
    for rel in ("nemo_rl/environments/nemo_gym.py", "nemo_rl/experience/rollouts.py"):
        path = CHECKOUT / rel
        if not path.exists():
            pytest.skip(f"{path} is missing (NEMO_RL_CHECKOUT needs NeMo-RL's sources)")
        source = path.read_text()
        for node in ast.parse(source).body:
            names = [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else \
                [getattr(node, "name", None)]
            if any(n in NEEDED[rel] for n in names):
                exec(compile(ast.Module([node], []), rel, "exec"), ns)
    return ns


ITEMS = [reasoning("42"), reasoning(" plan "), reasoning("a<think>b<think>"), reasoning(""), message("42"),
         message("  "), message("<tool_call>f</tool_call>"), message("x", "p</think>x"),
         message("y", "<think>p</think>y"), message("z", "a</think>b</think>"), {"type": "function_call", "name": "f"},
         {"type": "function_call_output", "output": "3"}, {"type": "message", "content": "plan"},
         {"type": "reasoning", "summary": [{"text": "plan"}], "content": None}]


def random_case(rng: random.Random):
    msgs = []
    for _ in range(rng.randint(1, 3)):
        msgs.append(user([rng.choice([1, 2, OPEN, CLOSE]) for _ in range(rng.randint(0, 3))]))
        msgs.append(asst([rng.choice([3, 4, 9, OPEN, CLOSE]) for _ in range(rng.randint(1, 4))],
                         ["malformed_thinking"] if rng.random() < 0.1 else []))
    items = [dict(rng.choice(ITEMS)) for _ in range(rng.randint(0, 4))]
    return GymSample(msgs, items, [{"role": "user", "content": rng.choice(["[low] q", "q"])}])


def as_nemo_rl(sample: GymSample, reward: float) -> dict:
    log = [{"role": m.role, "token_ids": torch.tensor(m.token_ids, dtype=torch.long),
            "has_malformed_thinking": "malformed_thinking" in m.flags} for m in sample.messages]
    return {"message_log": log, "full_result": {"reward": reward, "response": {"output": sample.output_items}}}


@pytest.mark.skipif(CHECKOUT is None, reason="NEMO_RL_CHECKOUT (a NeMo-RL checkout at 7ea279a) is not set")
def test_equal_to_nemo_rl_on_generated_cases():
    nrl = nemo_rl_functions()
    rng = random.Random(0)
    names = {"duplicated_reasoning": "duplicated_reasoning", "empty_final_answer": "empty_final_answer",
             "unwanted_tokens": "unwanted_token", "malformed_think_tag": "malformed_think_tag"}
    compared = 0
    for _ in range(400):
        samples = [random_case(rng) for _ in range(rng.randint(1, 4))]
        rewards = [rng.choice([0.0, 0.5, 1.0]) for _ in samples]
        token_ids = {k: v for k, v in (("unwanted", [9]), ("think_open", OPEN), ("think_close", CLOSE))
                     if rng.random() < 0.4}
        flags = {f: rng.random() < 0.5 for f in ("penalize_duplicated_reasoning", "penalize_empty_final_answer",
                                                  "penalize_malformed_think_tag")}
        flags["penalize_unwanted_tokens"] = "unwanted" in token_ids and rng.random() < 0.5
        rp = RewardPenaltyConfig(**flags, token_ids=token_ids or None)
        tokenizer = rng.choice([OneTokenTags(), SplitTags()])
        tags = rng.choice([TAGS, ["<r>", "</r>"]])

        results = [as_nemo_rl(s, r) for s, r in zip(samples, rewards)]
        nrl_error = ours_error = None
        try:
            resolved = nrl["resolve_reward_penalty_config"](rp.model_dump(include={*flags, "token_ids"}), tokenizer,
                                                            thinking_tags=tags)
            counts = nrl["apply_reward_penalties"](results, resolved)
        except ValueError as err:
            nrl_error = str(err)
        try:
            think_ids = resolve_think_ids(rp, tokenizer, tags) if rp.penalize_malformed_think_tag else (None, None)
            out, ours, _ = apply_gym_reward_penalties(torch.tensor(rewards), samples, rp, think_ids, tags)
        except ValueError as err:
            ours_error = str(err)
        assert (nrl_error is None) == (ours_error is None), (nrl_error, ours_error)
        if nrl_error is not None:
            assert nrl_error == ours_error
            continue
        assert out.tolist() == [r["full_result"]["reward"] for r in results]
        for name, flag_b in ours.items():
            assert int(flag_b.sum()) == counts[names[name]], name
        compared += 1

        effort = EffortLevelsConfig(low_weight=rng.choice([0.0, 0.1, 1.0]), low_penalty=rng.choice([0.5, 1.0, 2.0]),
                                    low_ub=rng.choice([2, 5, 100]), low_string=rng.choice(["", "[low]"]))
        results = [as_nemo_rl(s, r) for s, r in zip(samples, rewards)]
        rows = [{"responses_create_params": {"input": s.prompt_input}} for s in samples]
        nrl["_apply_effort_shaping"](results, rows, nrl["EffortLevelsConfig"](**effort.model_dump()))
        lengths = [len(s.messages[-1].token_ids) for s in samples]
        shaped, _ = apply_effort_shaping(torch.tensor(rewards, dtype=torch.float64), lengths,
                                         [last_user_prompt(s.prompt_input) for s in samples], effort)
        assert shaped.tolist() == pytest.approx([r["full_result"]["reward"] for r in results], abs=1e-12)

        for item in (s.output_items for s in samples):
            for it in item:
                for patterns, tg in ((None, None), (["f"], ["<r>"])):
                    assert detect_invalid_tool_call_and_malformed_thinking(it, patterns, tg) == \
                        nrl["_detect_invalid_tool_call_and_malformed_thinking"](it, patterns, tg)
    assert compared > 200
