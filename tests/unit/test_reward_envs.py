"""NeMo-RL's reward-model and multi-reward recipes translate (grpo.config.nemo_rl.rules): gdpo_math_1B.yaml's and
grpo_rm_1B.yaml's keys, in recipes written in NeMo-RL's format under tests/fixtures/nemo_rl/."""

from __future__ import annotations

from pathlib import Path

import pytest

from grpo.config.load import ConfigError
from grpo.config.nemo_rl.recipe import load_recipe

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


def test_reward_model_recipe_keeps_nemo_rl_s_section_and_names_what_it_ignores():
    cfg, rows = load_recipe(FIX / "grpo_rm.yaml")
    rm = cfg.env.reward_model
    assert cfg.env.name == "reward_model"
    assert (rm.model_name, rm.tokenizer.name, rm.precision, rm.max_model_len, rm.checkpoint_path) == (
        "a-bradley-terry-reward-model", "a-bradley-terry-reward-model", "bfloat16", 1024, None)
    assert rm.batch_size == cfg.policy.train_micro_batch_size  # NeMo-RL's interpolation
    assert rm.reward_model_cfg.reward_model_type == "bradley_terry"
    ignored = table_of(rows, "ignored")
    assert "shares the one rank" in ignored["env.reward_model.resources"]
    assert "frozen copy per rank" in ignored["env.reward_model.dtensor_cfg"]
    assert "unused, as in NeMo-RL" in ignored["env.math"]


@pytest.mark.parametrize("override, key", [
    ("env.reward_model.dtensor_cfg.enabled=false", "env.reward_model.dtensor_cfg.enabled"),
    ("env.reward_model.dtensor_cfg.activation_checkpointing=true", "env.reward_model.dtensor_cfg.activation_checkpointing"),
    ("env.reward_model.dynamic_batching.enabled=true", "env.reward_model.dynamic_batching.enabled"),
    ("env.reward_model.sequence_packing.enabled=true", "env.reward_model.sequence_packing.enabled"),
    ("env.reward_model.max_grad_norm=1.0", "env.reward_model.max_grad_norm"),
    ("++env.reward_model.tokenizer.chat_template=x", "env.reward_model.tokenizer.chat_template"),
])
def test_reward_model_recipe_keeps_nemo_rl_s_asserts(override, key):
    with pytest.raises(ConfigError) as err:
        load_recipe(FIX / "grpo_rm.yaml", [override])
    assert any(line.strip().startswith(key + "=") for line in str(err.value).splitlines()), str(err.value)


def test_reward_model_type_and_enabled_are_checked_as_nemo_rl_does():
    with pytest.raises(ConfigError, match="reward_model_type"):
        load_recipe(FIX / "grpo_rm.yaml", ["env.reward_model.reward_model_cfg.reward_model_type=regression"])
    with pytest.raises(ConfigError, match="reward_model_cfg.enabled"):
        load_recipe(FIX / "grpo_rm.yaml", ["env.reward_model.reward_model_cfg.enabled=false"])


def test_the_recipe_check_covers_nemo_rl_s_gdpo_recipes(tmp_path):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    import check_nemo_rl_recipes as check

    configs = tmp_path / "examples" / "configs"
    (configs / "recipes" / "llm").mkdir(parents=True)
    for name in ("grpo_math_1B.yaml", "gdpo_math_1B.yaml", "grpo_rm_1B.yaml", "sft.yaml", "recipes/llm/gdpo-x.yaml",
                 "recipes/llm/grpo-vlm-y.yaml"):
        (configs / name).write_text("{}")
    assert [p.name for p in check.recipes(tmp_path)] == ["grpo_math_1B.yaml", "grpo_rm_1B.yaml", "gdpo_math_1B.yaml",
                                                         "gdpo-x.yaml"]
