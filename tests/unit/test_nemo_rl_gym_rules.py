"""NeMo-RL's NeMo-Gym recipes, key by key (grpo/config/nemo_rl/gym_rules.py): the Gym keys kept, NemoGymDataset specs as
grpo-ds's data keys, what cannot be read refused naming the key, and NeMo-RL's refusal of its penalties without
NeMo-Gym. With a NeMo-RL checkout (NEMO_RL_CHECKOUT) and the env.nemo_gym config in place, its Gym GRPO recipes
load as `--check-config` loads them."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

from grpo.config import EnvConfig
from grpo.config.load import ConfigError
from grpo.config.nemo_rl.recipe import load_nemo_rl, load_recipe
from grpo.config.nemo_rl.rules import translate

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "nemo_rl"
BASE = FIX / "base_math.yaml"
HAS_GYM_CONFIG = "should_use_nemo_gym" in EnvConfig.model_fields  # the core Gym path's env section


def gym_recipe(tmp_path, **nemo_gym) -> dict:
    """The fixture recipe turned into a NeMo-Gym one, as NeMo-RL's examples/nemo_gym recipes are written."""
    nrl = copy.deepcopy(load_nemo_rl(BASE))
    for name in ("train.jsonl", "val.jsonl"):
        (tmp_path / name).write_text('{"responses_create_params": {"input": "2+2?"}, "agent_ref": {"name": "a"}}\n')
    nrl["data"] = {"max_input_seq_length": nrl["data"].get("max_input_seq_length"), "shuffle": True,
                   "default": {"dataset_name": "NemoGymDataset", "env_name": "nemo_gym", "prompt_file": None,
                               "system_prompt_file": None, "processor": "nemo_gym_data_processor"},
                   "train": {"data_path": str(tmp_path / "train.jsonl")},
                   "validation": {"data_path": str(tmp_path / "val.jsonl"), "repeat": 2}}
    nrl["data"] = {k: v for k, v in nrl["data"].items() if v is not None}
    nrl["env"] = {"should_use_nemo_gym": True, "should_log_nemo_gym_responses": True,
                  "should_mask_flagged_samples": True, "math": {"num_workers": 8},
                  "nemo_gym": {"config_paths": ["resources_servers/x/configs/x.yaml"], "x": {"resources_servers": {}},
                               **nemo_gym}}
    nrl["grpo"].update(use_best_at_k=False, best_at_k_k=8, max_val_samples=None, val_batch_size=None)
    nrl["reward_penalties"] = {"penalize_empty_final_answer": True, "token_ids": {"think_open": 12}}
    nrl["sif_dir"] = "/path/to/sif"
    return nrl


def test_gym_recipe_translates_key_by_key(tmp_path):
    effort = {"low_string": "{reasoning effort: efficient}", "low_weight": 0.1, "low_penalty": 1, "low_ub": 15000}
    out, table = translate(gym_recipe(tmp_path, effort_levels=effort, thinking_tags=["<think>", "</think>"]), FIX)
    env, data = out["env"], out["data"]
    assert env["should_use_nemo_gym"] and env["should_log_nemo_gym_responses"] and env["should_mask_flagged_samples"]
    assert env["nemo_gym"]["effort_levels"] == effort and env["nemo_gym"]["config_paths"]
    assert env["nemo_gym"]["x"] == {"resources_servers": {}}  # Gym's own keys pass through untouched
    assert "math" not in env
    assert data["train_data_path"] == str(tmp_path / "train.jsonl") and data["input_key"] == "responses_create_params"
    assert data["val_data_path"] == str(tmp_path / "val.jsonl") and data["val_repeat"] == 2
    assert out["reward_penalties"] == {"penalize_empty_final_answer": True, "token_ids": {"think_open": 12}}
    ignored = {key: why for kind, key, why in table if kind == "ignored"}
    assert "stale key" in ignored["grpo.use_best_at_k"] and "download_swe_images" in ignored["sif_dir"]
    assert "unused" in ignored["env.math"]


def test_gym_recipe_without_validation_turns_validation_off(tmp_path):
    nrl = gym_recipe(tmp_path)
    nrl["data"]["validation"] = None
    out, _ = translate(nrl, FIX)
    assert (out["grpo"]["val_period"], out["grpo"]["val_at_start"], out["grpo"]["val_at_end"]) == (0, False, False)


@pytest.mark.parametrize("edit, key", [
    (lambda n: n["env"]["nemo_gym"].update(effort_levels={"low_ub": 0}), "env.nemo_gym.effort_levels"),
    (lambda n: n["env"]["nemo_gym"].update(effort_levels={"low_wieght": 1}), "env.nemo_gym.effort_levels"),
    (lambda n: n["data"]["train"].update(data_path=None), "data.train.data_path=None"),
    (lambda n: n["data"]["train"].update(prompt_file="p.txt"), "data.train.prompt_file='p.txt'"),
    (lambda n: n["data"]["train"].update(dataset_name="DAPOMath17K"), "data.train.dataset_name='DAPOMath17K'"),
    (lambda n: n["data"]["train"].update(repeat=3), "data.train.repeat=3"),
    (lambda n: n["data"]["train"].update(num_frames=8), "data.train.num_frames=8"),  # split keys: ignored, as
    # NeMo-RL warns (test_nemo_rl_recipe_gaps.py::test_split_keys_a_gym_recipe_inherits_are_ignored_as_nemo_rl_warns)
    (lambda n: n["data"].update(train=[n["data"]["train"]] * 2), "data.train="),
    (lambda n: n["grpo"].update(max_val_samples=16), "grpo.max_val_samples=16"),
])
def test_gym_recipe_refusals_name_the_key(tmp_path, edit, key):
    nrl = gym_recipe(tmp_path)
    edit(nrl)
    with pytest.raises(ConfigError) as err:
        translate(nrl, FIX)
    assert f"\n  {key}" in str(err.value)


@pytest.mark.parametrize("override, key", [
    ("++reward_penalties.penalize_empty_final_answer=true", "reward_penalties.penalize_empty_final_answer=True"),
    ("++reward_penalties={penalize_malformed_think_tag: true}", "reward_penalties.penalize_malformed_think_tag=True"),
    ("++grpo.invalid_tool_call_advantage=-1.0", "grpo.invalid_tool_call_advantage=-1.0"),
])
def test_penalties_without_nemo_gym_are_refused_as_nemo_rl_refuses_them(override, key):
    with pytest.raises(ConfigError, match="require the NeMo-Gym path") as err:
        load_recipe(BASE, [override])
    assert f"\n  {key}: " in str(err.value)


def test_reward_penalty_token_ids_are_honored():
    cfg, _ = load_recipe(BASE, ["++reward_penalties.token_ids={think_open: 12, think_close: 13}"])
    assert (cfg.reward_penalties.token_ids.think_open, cfg.reward_penalties.token_ids.think_close) == (12, 13)


@pytest.mark.skipif(not HAS_GYM_CONFIG, reason="env.should_use_nemo_gym is the core Gym path's config (not merged)")
def test_gym_recipe_loads_into_the_config(tmp_path):
    import yaml

    path = tmp_path / "grpo_gym.yaml"
    nrl = gym_recipe(tmp_path, effort_levels={"low_weight": 0.1, "low_string": "{e}"})
    path.write_text(yaml.safe_dump(nrl))
    cfg, _ = load_recipe(path)
    assert cfg.env.should_use_nemo_gym and cfg.env.nemo_gym.effort_levels.low_weight == 0.1
    assert cfg.data.input_key == "responses_create_params" and cfg.grpo.val_batch_size is None


CHECKOUT = Path(os.environ["NEMO_RL_CHECKOUT"]) if os.environ.get("NEMO_RL_CHECKOUT") else None
# NeMo-RL's Gym GRPO recipes that load (7ea279a), with the overrides they need; the others name what grpo-ds cannot
# do for another reason. grpo_qwen3_30ba3b_instruct's tensor-parallel vLLM is colocated with the endpoint, refused
# at load since issue 52 (the check's own line names the key): with tensor_parallel_size=1 the rest loads.
LOADING = [("examples/configs/recipes/llm/gdpo-qwen2.5-1.5b-1n8g-gym-multireward.yaml", []),
           ("examples/nemo_gym/grpo_qwen3_30ba3b_instruct.yaml", ["policy.generation.vllm_cfg.tensor_parallel_size=1"])]
# Asynchronous Gym recipes: they load for train_async_grpo.py, which serves the endpoint too.
ASYNC = ["examples/nemo_gym/grpo_qwen3_30ba3b_thinking_swe1.yaml", "examples/nemo_gym/grpo_qwen3_30ba3b_thinking_swe2.yaml",
         "examples/swe_bench/grpo_qwen3_30b_async_swe_trtllm.yaml"]


@pytest.mark.skipif(CHECKOUT is None, reason="needs NEMO_RL_CHECKOUT")
@pytest.mark.parametrize("rel", ASYNC)
def test_asynchronous_gym_recipes_load_for_the_async_loop(rel, monkeypatch):
    monkeypatch.setenv("HF_HOME", os.environ.get("HF_HOME", "~/.cache/huggingface"))
    cfg, _ = load_recipe(CHECKOUT / rel)
    assert cfg.grpo.async_grpo.enabled and cfg.env.should_use_nemo_gym


@pytest.mark.skipif(CHECKOUT is None or not HAS_GYM_CONFIG,
                    reason="needs NEMO_RL_CHECKOUT and the core Gym path's env config")
@pytest.mark.parametrize("rel, overrides", LOADING)
def test_nemo_rl_gym_recipes_load(rel, overrides, monkeypatch):
    monkeypatch.setenv("HF_HOME", os.environ.get("HF_HOME", "~/.cache/huggingface"))
    cfg, table = load_recipe(CHECKOUT / rel, overrides)
    assert cfg.env.should_use_nemo_gym and cfg.env.nemo_gym.config_paths
    assert cfg.data.input_key == "responses_create_params"
