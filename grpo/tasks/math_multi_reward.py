"""NeMo-RL's ``math_multi_reward`` environment (``MathMultiRewardEnvironment``, the reward of its GDPO recipe
``gdpo_math_1B.yaml``): three named reward components per sample, each 0.0 or 1.0, for GDPO.

- ``reward/correctness``: the text of the last ``<answer>...</answer>`` block (everything after the last
  ``<answer>``, cut at the next ``</answer>``, stripped) equals the gold answer as a string;
- ``reward/integer``: that text is a string of digits (``str.isdigit``);
- ``reward/format``: the whole completion is ``<think>...</think>\\n<answer>...</answer>`` with exactly one
  ``<answer>`` and one ``</answer>``.

These are NeMo-RL's ``HFMultiRewardVerifyWorker`` functions (nemo_rl/environments/math_environment.py at
7ea279a): string equality, no math-verify. The gold answer is NeMo-RL's ``ground_truth``: for GSM8K the text after
``####`` (NeMo-RL's gsm8k dataset extracts it; `grpo.tasks.math.gold_text` here). The scalar reward is the sum of
the components (`grpo.tasks.function.to_reward`); GDPO (``grpo.adv_estimator.name: gdpo``) reads them sorted by
name: correctness, format, integer.
"""

from __future__ import annotations

import re

from grpo.tasks.math import gold_text

COMPONENTS = ("reward/correctness", "reward/integer", "reward/format")
FORMAT = re.compile(r"^<think>.*?</think>\n<answer>.*?</answer>$", re.DOTALL)


def extract_xml_answer(text: str) -> str:
    """The text after the last ``<answer>``, up to the next ``</answer>``, stripped (the whole text without tags).

        >>> extract_xml_answer("<think>..</think>\\n<answer> 42 </answer>"), extract_xml_answer("just 7")
        ('42', 'just 7')
    """
    return text.split("<answer>")[-1].split("</answer>")[0].strip()


def correctness_reward(completion: str, gold: str) -> float:
    """1.0 when the extracted answer equals ``gold`` as a string.

        >>> correctness_reward("<answer>42</answer>", "42"), correctness_reward("<answer>42.0</answer>", "42")
        (1.0, 0.0)
    """
    return 1.0 if extract_xml_answer(completion) == gold else 0.0


def integer_reward(completion: str) -> float:
    """1.0 when the extracted answer is made of digits only.

        >>> integer_reward("<answer>42</answer>"), integer_reward("<answer>-3</answer>")
        (1.0, 0.0)
    """
    return 1.0 if extract_xml_answer(completion).isdigit() else 0.0


def format_reward(completion: str) -> float:
    """1.0 when the completion is exactly ``<think>...</think>\\n<answer>...</answer>`` (one answer block).

        >>> format_reward("<think>a</think>\\n<answer>1</answer>"), format_reward("<think>a</think><answer>1</answer>")
        (1.0, 0.0)
    """
    ok = FORMAT.search(completion) and completion.count("<answer>") == 1 and completion.count("</answer>") == 1
    return 1.0 if ok else 0.0


def math_multi_reward(question: str, completion: str, answer: str, meta: dict) -> dict[str, float]:
    """The three components of one completion against the row's gold answer (its GSM8K ``####`` tail).

        >>> math_multi_reward("q", "<think>4+3</think>\\n<answer>7</answer>", "4 + 3 = 7\\n#### 7", {})
        {'reward/correctness': 1.0, 'reward/integer': 1.0, 'reward/format': 1.0}
    """
    gold = gold_text(answer)
    return {"reward/correctness": correctness_reward(completion, gold), "reward/integer": integer_reward(completion),
            "reward/format": format_reward(completion)}
