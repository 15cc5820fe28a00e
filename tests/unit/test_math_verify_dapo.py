"""DAPO's math verifier (env.math_verify_impl=dapo_math_verify, NeMo-RL's env.math.math_verify_impl).

Every expected value below is what NeMo-RL's own ``compute_score`` (nemo_rl/environments/dapo_math_verifier.py at
7ea279a) returns on the same input: its ``score`` and its ``pred`` (the normalised answer it extracted).
"""

from __future__ import annotations

import pytest

from grpo.config import EnvConfig, MasterConfig
from grpo.tasks.factory import build_environment
from grpo.tasks.math import dapo_answer, dapo_math_reward, math_reward

# (completion, gold, NeMo-RL's score, NeMo-RL's pred)
NEMO_RL_CASES = [
    ("Answer: 42", "42", 1.0, "42"),
    ("answer:42", "42", 1.0, "42"),  # case-insensitive, spaces optional
    ("ANSWER :  42 ", "42", 1.0, "42"),
    ("Answer: 43", "42", 0.0, "43"),  # wrong: 0.0, not a negative reward
    ("The answer is 42", "42", 0.0, "[INVALID]"),  # no "Answer:" line
    ("\\boxed{42}", "42", 0.0, "[INVALID]"),  # a box alone is not an answer line
    ("Answer: \\boxed{42}", "42", 1.0, "42"),
    ("Answer: $42$", "42", 1.0, "42"),
    ("Answer: 1,000", "1000", 1.0, "1000"),  # thousands commas
    ("Answer: 1000", "1,000", 1.0, "1000"),
    ("Answer: x = 5", "5", 1.0, "5"),  # the text after the last "="
    ("Answer: 5 dollars", "5", 1.0, "5"),  # units
    ("Answer: \\$5", "5", 1.0, "5"),
    ("Answer: 90^\\circ", "90", 1.0, "90"),
    ("Answer: 90^{\\circ}", "90", 1.0, "90"),
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0, "\\frac{1}{2}"),  # shorthand TeX
    ("Answer: 1/2", "\\frac{1}{2}", 0.0, "1/2"),  # strings, not values
    ("Answer: \\sqrt2", "\\sqrt{2}", 1.0, "\\sqrt{2}"),
    ("Answer: \\text{(A)}", "(A)", 1.0, "(A)"),
    ("Answer: \\textbf{B}", "B", 1.0, "B"),
    ("Answer: 3\\text{ cm}", "3", 1.0, "3"),
    ("Answer: an apple", "apple", 1.0, "apple"),  # the substrings "an " and "a " are dropped
    ("Answer: 1\nAnswer: 2", "2", 1.0, "2"),  # the last answer line counts
    ("Answer: 1\nAnswer: 2", "1", 0.0, "2"),
    ("x" * 400 + "Answer: 7", "7", 1.0, "7"),
    ("Answer: 7" + "x" * 300, "7", 0.0, "[INVALID]"),  # only the last 300 characters are read
    ("Answer: 7" + " " * 291, "7", 1.0, "7"),
    ("Answer: 7" + " " * 292, "7", 0.0, "[INVALID]"),
    ("Answer: 7.", "7", 0.0, "7."),
    ("Answer: $7$.", "7", 1.0, "7"),
    ("Answer: 2,\\!000", "2000", 1.0, "2000"),
    ("Answer: 2{,}000", "2000", 1.0, "2000"),
    ("Answer: 12 \\text{and} 13", "12,13", 1.0, "1213"),
    ("Answer: $\\frac{3}{4}$ and $5$", "\\frac{3}{4}", 1.0, "\\frac{3}{4}"),  # the first $...$
    ("answer: 0.5", ".5", 0.0, "0.5"),
    ("Final Answer: 17", "17", 1.0, "17"),
    ("Answer: 17\n", "#### 17", 0.0, "17"),  # no GSM8K "####" handling in DAPO's verifier
    ("", "", 0.0, "[INVALID]"),
]


@pytest.mark.parametrize("completion,gold,score,pred", NEMO_RL_CASES)
def test_dapo_matches_nemo_rl(completion, gold, score, pred):
    assert dapo_math_reward("q", completion, gold, {}) == score
    assert dapo_answer(completion) == pred


def test_dapo_env_scores_in_worker_processes():
    spec = EnvConfig(name="math", math_verify_impl="dapo_math_verify", num_workers=1, timeout_s=30)
    with build_environment(spec) as env:
        assert env.spec == "grpo.tasks.math:dapo_math_reward" and env._pool is not None
        result = env.score([{"question": "q", "completion": c, "answer": g, "meta": {}}
                            for c, g, _, _ in NEMO_RL_CASES[:6]])
    assert result.rewards == [s for _, _, s, _ in NEMO_RL_CASES[:6]] and result.num_errors == 0


def test_default_is_math_verify_and_other_envs_refuse_the_field():
    assert build_environment(EnvConfig(name="math")).spec == "grpo.tasks.math:math_reward"
    with pytest.raises(ValueError, match="env.math_verify_impl='dapo_math_verify' picks the verifier"):
        EnvConfig(name="arithmetic", math_verify_impl="dapo_math_verify")
    with pytest.raises(ValueError, match="math_verify_impl"):
        EnvConfig(name="math", math_verify_impl="sympy")
    cfg = MasterConfig.model_validate({"env": {"name": "math", "tasks": {
        "dapo": {"name": "math", "math_verify_impl": "dapo_math_verify"}}}})
    assert cfg.env.tasks["dapo"].math_verify_impl == "dapo_math_verify"


def test_hf_math_verify_reads_an_escaped_dollar_gold_as_nemo_rl_does():
    # NeMo-RL's hf_math_verify parses the gold as \boxed{gold}: "\$5" is 5 there (a gold with "$" but no $...$)
    assert math_reward("q", "so \\boxed{5}", "\\$5", {}) == 1.0
    assert math_reward("q", "so \\boxed{6}", "\\$5", {}) == 0.0
