"""grpo.tasks.math_multi_reward against NeMo-RL's own component functions (HFMultiRewardVerifyWorker.verify's inner
functions in nemo_rl/environments/math_environment.py at 7ea279a, quoted below under its Apache-2.0 licence) on
hand-made completions, and the task wired as NeMo-RL's env_name."""

from __future__ import annotations

import re

import pytest

from grpo.tasks.math_multi_reward import COMPONENTS, math_multi_reward


# -- NeMo-RL's functions, verbatim (Copyright (c) 2025, NVIDIA CORPORATION; Apache License 2.0) -----------------
def extract_xml_answer(text: str) -> str:
    answer = text.split("<answer>")[-1]
    answer = answer.split("</answer>")[0]
    return answer.strip()


def correctness_reward_func(completions, answer, **kwargs) -> list[float]:
    extracted_responses = [extract_xml_answer(r) for r in completions]
    return [1.0 if r == a else 0.0 for r, a in zip(extracted_responses, answer)]


def int_reward_func(completions, **kwargs) -> list[float]:
    extracted_responses = [extract_xml_answer(r) for r in completions]
    return [1.0 if r.isdigit() else 0.0 for r in extracted_responses]


def format_reward_func(completions, **kwargs) -> list[float]:
    """Reward function that checks if the completion has a specific format."""
    rewards = []
    for response in completions:
        pattern = r"^<think>.*?</think>\n<answer>.*?</answer>$"

        if (
            re.search(pattern, response, re.DOTALL)
            and response.count("<answer>") == 1
            and response.count("</answer>") == 1
        ):
            rewards.append(1.0)
        else:
            rewards.append(0.0)

    return rewards
# -- end of NeMo-RL's functions ---------------------------------------------------------------------------------


COMPLETIONS = [
    "<think>3 + 4 = 7</think>\n<answer>7</answer>",          # all three
    "<think>3 + 4 = 7</think>\n<answer> 7 </answer>",        # stripped: still correct
    "<think>3 + 4</think><answer>7</answer>",                # no newline between the blocks: format 0
    "<think>a</think>\n<answer>7</answer>\n",                # a trailing newline: format 0 ($ before \n matches!)
    "<think>a</think>\n<answer>8</answer>",                  # wrong, integer, formatted
    "<think>a</think>\n<answer>7.0</answer>",                # string equality: 7.0 is wrong and not an integer
    "<think>a</think>\n<answer>-7</answer>",                 # isdigit: a sign is not a digit
    "the answer is 7",                                       # no tags: the whole text is the answer
    "7",                                                     # the whole text, and it is the gold
    "<answer>1</answer> then <answer>7</answer>",            # the last block counts; two blocks: format 0
    "<think>x\ny\n</think>\n<answer>7</answer>",             # DOTALL: a multi-line think block
    "<think>a</think>\n<answer>7",                           # unclosed: the text after <answer>
    " <think>a</think>\n<answer>7</answer>",                 # a leading space: format 0
    "<think>a</think>\n<answer>७</answer>",                  # a Devanagari digit: isdigit says yes
    "",
]


@pytest.mark.parametrize("completion", COMPLETIONS)
@pytest.mark.parametrize("gold", ["7", "8"])
def test_components_equal_nemo_rl_s_functions(completion, gold):
    ours = math_multi_reward("q", completion, gold, {})
    theirs = {"reward/correctness": correctness_reward_func([completion], [gold])[0],
              "reward/integer": int_reward_func([completion])[0],
              "reward/format": format_reward_func([completion])[0]}
    assert ours == theirs
    assert tuple(ours) == COMPONENTS


def test_gsm8k_gold_is_the_text_after_the_hashes_as_nemo_rl_s_dataset_extracts_it():
    assert math_multi_reward("q", "<think>a</think>\n<answer>72</answer>", "48/2 = 24\n48+24 = 72\n#### 72", {}) == {
        "reward/correctness": 1.0, "reward/integer": 1.0, "reward/format": 1.0}


def test_the_task_is_a_built_in_environment_with_nemo_rl_s_name():
    from grpo.config import EnvSpec
    from grpo.tasks.catalogue import ENV_NAMES, TASKS

    assert "math_multi_reward" in ENV_NAMES
    assert TASKS["math_multi_reward"].reward_fn == "grpo.tasks.math_multi_reward:math_multi_reward"
    assert EnvSpec(name="math_multi_reward").name == "math_multi_reward"


def test_the_environment_returns_the_components_for_gdpo():
    from grpo.tasks.reward import RewardEnvironment

    env = RewardEnvironment("grpo.tasks.math_multi_reward:math_multi_reward", in_process=True)
    logs = [[{"role": "user", "content": "3+4="}, {"role": "assistant", "content": c}]
            for c in ("<think>a</think>\n<answer>7</answer>", "<answer>8</answer>")]
    ret = env.step(logs, [{"question": "3+4=", "answer": "7"}] * 2)
    assert ret.rewards.tolist() == [3.0, 1.0]  # the scalar reward is the components' sum
    assert [m["reward_components"] for m in ret.metadata] == [
        {"reward/correctness": 1.0, "reward/integer": 1.0, "reward/format": 1.0},
        {"reward/correctness": 0.0, "reward/integer": 1.0, "reward/format": 0.0}]
