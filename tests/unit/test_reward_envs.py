"""NeMo-RL's reward-model and multi-reward recipes translate (grpo.nemo_rl_rules): gdpo_math_1B.yaml's and
grpo_rm_1B.yaml's keys, in recipes written in NeMo-RL's format under tests/fixtures/nemo_rl/."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.config_load import ConfigError
from grpo.nemo_rl_recipe import load_recipe

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_rl"


def table_of(rows, kind):
    return {key: why for k, key, why in rows if k == kind}


def test_gdpo_math_recipe_is_gdpo_over_math_multi_reward():
    cfg, rows = load_recipe(FIX / "gdpo_math.yaml")
    assert cfg.env.name == "math_multi_reward" and cfg.grpo.adv_estimator.name == "gdpo"
    assert cfg.env.num_workers == 2
    assert "reward/correctness, reward/integer, reward/format" in table_of(rows, "translated")["env.math_multi_reward"]
    assert cfg.data.system_prompt_file.endswith("configs/prompts/gsm8k.txt")  # grpo-ds's wording of NeMo-RL's prompt


def test_math_multi_reward_has_hf_math_verify_alone():
    with pytest.raises(ConfigError, match=r"env.math_multi_reward.math_verify_impl=.*hf_math_verify alone"):
        load_recipe(FIX / "gdpo_math.yaml", ["env.math_multi_reward.math_verify_impl=dapo_math_verify"])
