"""Gaps of the recipe translation that refused NeMo-RL recipes NeMo-RL runs (issue 48): each case is checked
against what NeMo-RL 7ea279a does with the same keys. The recipes are written here, on top of our fixture
tests/fixtures/nemo_rl/base_math.yaml (NeMo-RL's format, our values)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config.load import ConfigError
from grpo.config.nemo_rl.recipe import load_recipe

REPO = Path(__file__).resolve().parents[2]
FIX = REPO / "tests" / "fixtures" / "nemo_rl"
BASE = FIX / "base_math.yaml"
GYM = FIX / "examples" / "nemo_gym" / "grpo_workplace_assistant_nemotron_nano_v2_9b.yaml"
# The fixture's tool parser is the one NeMo-RL's plugin file registers (nemotron_json); a parser vLLM has instead.
GYM_PARSER = "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.tool_parser=hermes"


def rows(table, kind):
    return {key: why for k, key, why in table if k == kind}


def recipe(tmp_path, text: str, parent: Path = BASE) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"defaults: {parent}\n{text}")
    return path


# --------------------------------------------------------------------------------------------------
# ProRLv2: stop_properly_penalty_coef beside DAPO's inherited overlong buffer
# --------------------------------------------------------------------------------------------------
PRORL = """grpo:
  reward_shaping:
    enabled: true
    overlong_buffer_length: 8
    overlong_buffer_penalty: 1
    max_response_length: 24
    stop_properly_penalty_coef: 0.25
"""


def test_stop_properly_penalty_coef_ignores_the_inherited_overlong_buffer_as_nemo_rl_does(tmp_path):
    """NeMo-RL's apply_reward_shaping uses stop_properly_penalty_coef alone when it is set and warns that the
    overlong keys are ignored (ProRLv2's recipes inherit them from DAPO's): the same, with one table row each."""
    cfg, table = load_recipe(recipe(tmp_path, PRORL))
    shaping = cfg.grpo.reward_shaping
    assert shaping.enabled and shaping.stop_properly_penalty_coef == 0.25
    assert (shaping.overlong_buffer_length, shaping.overlong_buffer_penalty, shaping.max_response_length) == (
        None, None, None)
    ignored = rows(table, "ignored")
    for key in ("overlong_buffer_length", "overlong_buffer_penalty", "max_response_length"):
        assert "stop_properly_penalty_coef=0.25 is set" in ignored[f"grpo.reward_shaping.{key}"]
    # Without the coefficient the buffer is DAPO's, as before.
    cfg, table = load_recipe(recipe(tmp_path, PRORL), ["grpo.reward_shaping.stop_properly_penalty_coef=null"])
    assert cfg.grpo.reward_shaping.overlong_buffer_length == 8 and not rows(table, "ignored").keys() & {
        "grpo.reward_shaping.overlong_buffer_length"}


# --------------------------------------------------------------------------------------------------
# checkpointing.metric_name: "val:total_reward/mean" (NeMo-Gym recipes)
# --------------------------------------------------------------------------------------------------
def test_gym_val_total_reward_mean_is_validation_accuracy():
    """NeMo-RL's validate reports the NeMo-Gym rollout's total_reward/mean beside accuracy (the mean of the same
    rewards over the validation batch, the whole set with val_batch_size=null): it ranks by val:accuracy here."""
    cfg, table = load_recipe(GYM, ["checkpointing.metric_name=val:total_reward/mean", GYM_PARSER])
    assert cfg.checkpointing.metric_name == "val:accuracy"
    assert "val:accuracy" in rows(table, "translated")["checkpointing.metric_name"]


def test_val_total_reward_mean_without_nemo_gym_is_still_refused():
    """Without NeMo-Gym NeMo-RL's validation has no total_reward/mean (its first save raises 'Metric ... not
    found'): refused at load, naming the key, as before."""
    with pytest.raises(ConfigError, match="checkpointing.metric_name='val:total_reward/mean'"):
        load_recipe(BASE, ["checkpointing.metric_name=val:total_reward/mean"])


def test_split_keys_a_gym_recipe_inherits_are_ignored_as_nemo_rl_warns(tmp_path):
    """A NeMo-Gym recipe over grpo_math_1B.yaml inherits its math dataset's split_validation_size and seed into
    data.train (NeMo-RL's MOPD recipe, mopd-qwen3-1.7b-3n8g-megatron-pack.yaml, ranking by val:total_reward/mean).
    NemoGymDataset takes data_path and repeat: NeMo-RL's load_response_dataset warns that it ignores the others and
    runs. The same here, one ignored row each, where they were refused."""
    path = recipe(tmp_path, "data:\n  train:\n    split_validation_size: 0.05\n    seed: 42\n    subset: null\n",
                  parent=GYM)
    cfg, table = load_recipe(path, ["checkpointing.metric_name=val:total_reward/mean", GYM_PARSER])
    ignored = rows(table, "ignored")
    assert "NeMo-RL warns that it ignores split_validation_size=0.05" in ignored["data.train.split_validation_size"]
    assert "seed=42" in ignored["data.train.seed"] and "data.train.subset" not in ignored  # null: no warning
    assert cfg.data.train_data_path.endswith("workplace_assistant/train.jsonl") and cfg.data.split_validation_size == 0
    assert cfg.checkpointing.metric_name == "val:accuracy"
    with pytest.raises(ConfigError, match="data.train.video_target_num_patches=1024: a NemoGymDataset key"):
        load_recipe(recipe(tmp_path, "data:\n  train:\n    video_target_num_patches: 1024\n", parent=GYM),
                    [GYM_PARSER])  # a key NeMo-RL's processors read is still refused


# --------------------------------------------------------------------------------------------------
# NeMo-RL's seed fields; deleting a key with an override (hydra's ~key)
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [False, True])
def test_seed_fields_pass_either_way(tmp_path, value):
    """grpo.deduplicate_multimodal_data (honored) and grpo.debug_payload_metrics (Ray payload telemetry: ignored),
    NeMo-RL's seed fields of grpo_math_1B.yaml, at false as its recipes set them and at true."""
    text = f"grpo:\n  deduplicate_multimodal_data: {str(value).lower()}\n  debug_payload_metrics: {str(value).lower()}\n"
    cfg, table = load_recipe(recipe(tmp_path, text))
    assert cfg.grpo.deduplicate_multimodal_data is value
    assert "grpo.debug_payload_metrics" in rows(table, "ignored")
    p = subprocess.run([sys.executable, "train_grpo.py", "--check-config", "--config", str(tmp_path / "recipe.yaml")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and f"deduplicate_multimodal_data: {str(value).lower()}" in p.stdout, p.stderr


def test_a_refused_key_is_deleted_with_the_override_its_error_names(tmp_path):
    """The advice of an unknown key's error is an override that works: ``~key`` deletes it."""
    path = recipe(tmp_path, "grpo:\n  some_future_key: 1\npolicy:\n  some_section: {a: 1, b: 2}\n")
    with pytest.raises(ConfigError, match=r"grpo.some_future_key=1: .*delete it with the override ~grpo.some_fut"):
        load_recipe(path)
    cfg, _ = load_recipe(path, ["~grpo.some_future_key", "~policy.some_section"])  # a leaf, a whole section
    assert cfg.grpo.seed == 7
    # ~key=value: only while it holds that value
    cfg, _ = load_recipe(path, ["~grpo.some_future_key=1", "~policy.some_section={a: 1, b: 2}"])


def test_deleting_a_key_interpolations_follow(tmp_path):
    """The deletion is on the recipe before interpolation, as hydra's: what named the key no longer resolves."""
    with pytest.raises(ConfigError, match="cannot interpolate.*grpo.seed"):
        load_recipe(BASE, ["~grpo.seed"])
    cfg, _ = load_recipe(BASE, ["~grpo.reward_shaping"])
    assert cfg.grpo.reward_shaping.enabled is False and cfg.grpo.reward_shaping.overlong_buffer_length is None


@pytest.mark.parametrize("override, message", [
    ("~grpo.no_such_key", "override ~grpo.no_such_key: the recipe has no such key to delete"),
    ("~policy.tokenizer.nope.deeper", "override ~policy.tokenizer.nope.deeper: the recipe has no such key"),
    ("~", "override ~: the recipe has no such key"),
    ("~grpo.seed=8", r"override ~grpo.seed=8: the recipe's grpo.seed is 7, not 8; nothing deleted"),
])
def test_deleting_a_missing_key_or_another_value_names_it(override, message):
    with pytest.raises(ConfigError, match=message):
        load_recipe(BASE, [override])


def test_native_config_deletes_a_key_back_to_its_default():
    from grpo.config.load import load_config

    tiny = REPO / "tests" / "configs" / "tiny.yaml"
    assert load_config(tiny).grpo.num_prompts_per_step == 4
    assert load_config(tiny, ["~grpo.num_prompts_per_step"]).grpo.num_prompts_per_step == 32  # the default
    with pytest.raises(ConfigError, match="override ~grpo.nope: the config sets no such key to delete"):
        load_config(tiny, ["~grpo.nope"])
    assert load_config(tiny, ["~grpo.num_prompts_per_step=4"]).grpo.num_prompts_per_step == 32
    with pytest.raises(ConfigError, match="override ~grpo.num_prompts_per_step=5: the config's "
                                          "grpo.num_prompts_per_step is 4; nothing deleted"):
        load_config(tiny, ["~grpo.num_prompts_per_step=5"])


def test_check_config_takes_a_delete_override():
    p = subprocess.run([sys.executable, "train_grpo.py", "--check-config", "--config", str(BASE),
                        "~grpo.reward_shaping", "~grpo.nope"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "override ~grpo.nope: the recipe has no such key to delete" in p.stderr, p.stderr
    assert "unrecognized arguments" not in p.stderr


# --------------------------------------------------------------------------------------------------
# checkpointing.ft_* (fault tolerance) and vLLM parser plugins
# --------------------------------------------------------------------------------------------------
def test_fault_tolerance_checkpoint_keys_are_ignored_with_the_reason(tmp_path):
    """NeMo-RL's ft_save_period / ft_keep_latest_k add crash-recovery saves and keep the newest of them: no effect on
    samples or updates, so they are named and ignored (grpo-ds's save_period is the way to save more often)."""
    cfg, table = load_recipe(recipe(tmp_path, "checkpointing:\n  ft_save_period: 1\n  ft_keep_latest_k: 1\n"))
    ignored = rows(table, "ignored")
    for key in ("checkpointing.ft_save_period", "checkpointing.ft_keep_latest_k"):
        assert "fault-tolerance checkpoints" in ignored[key] and "save_period" in ignored[key]
    assert cfg.checkpointing.save_period == 10


@pytest.mark.parametrize("kind, parser", [("reasoning", "nano_v3"), ("tool", "nemotron_json")])
def test_a_parser_plugin_is_refused_naming_it_and_its_parser(tmp_path, kind, parser):
    """NeMo-RL imports the plugin file into vLLM's registry so the recipe can name its parser; grpo-ds imports no
    plugin, so the key is refused at load (it was ignored with vLLM's internals: with vLLM not installed here the
    parser's name went unchecked and the run failed when the endpoint started)."""
    plugin = f"nemo_rl/models/generation/vllm/{kind}_parsers/x.py"
    path = recipe(tmp_path, f"policy:\n  generation:\n    vllm_cfg:\n      {kind}_parser_plugin: {plugin}\n"
                            f"      http_server_serving_chat_kwargs:\n        {kind}_parser: {parser}\n")
    with pytest.raises(ConfigError) as err:
        load_recipe(path)
    line = next(x for x in str(err.value).splitlines() if f"{kind}_parser_plugin" in x)
    assert f"policy.generation.vllm_cfg.{kind}_parser_plugin='{plugin}'" in line and f"{kind}_parser={parser!r}" in line
    assert f"~policy.generation.vllm_cfg.{kind}_parser_plugin" in line
    # Deleted, with a parser grpo-ds and vLLM have, the recipe loads.
    ours = "deepseek_r1" if kind == "reasoning" else "hermes"
    cfg, _ = load_recipe(path, [f"~policy.generation.vllm_cfg.{kind}_parser_plugin",
                                f"policy.generation.vllm_cfg.http_server_serving_chat_kwargs.{kind}_parser={ours}"])
    assert getattr(cfg.policy.generation.vllm_cfg.http_server_serving_chat_kwargs, f"{kind}_parser") == ours


# --------------------------------------------------------------------------------------------------
# --check-config lists every problem of a config in one run
# --------------------------------------------------------------------------------------------------
THREE = ["policy.draft.enabled=true",  # refused by the translation
         "policy.train_global_batch_size=24",  # a rule across sections: not a divisor of 8 x 4
         "+loss_fn.use_kl_in_reward=true"]  # another one: the reward KL is reinforce_plus_plus's
THREE_LINES = ["policy.draft.enabled=True: trains a speculative-decoding draft model",
               "policy.train_global_batch_size=24: expected a divisor of",
               "loss_fn.use_kl_in_reward=true is only used by grpo.adv_estimator.name='reinforce_plus_plus'"]


def test_check_config_shows_every_error_of_a_recipe_at_once():
    """A refused key no longer hides the translated config's own errors, and the rules across sections are all
    checked, not only the first broken one."""
    p = subprocess.run([sys.executable, "train_grpo.py", "--check-config", "--config", str(BASE), *THREE], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    lines = p.stderr.splitlines()
    for expected in THREE_LINES:
        assert sum(expected in line for line in lines) == 1, (expected, p.stderr)


def test_native_config_reports_every_broken_rule_across_sections():
    from grpo.config.load import load_config

    with pytest.raises(ConfigError) as err:
        load_config(REPO / "tests" / "configs" / "tiny.yaml",
                    ["policy.train_global_batch_size=24", "loss_fn.use_kl_in_reward=true", "grpo.batch_multiplier=2"])
    lines = str(err.value).splitlines()
    assert lines[0] == "invalid config:" and len(lines) == 4, lines
    assert [x.strip().split("=")[0].split(" ")[0] for x in lines[1:]] == [
        "policy.train_global_batch_size", "loss_fn.use_kl_in_reward", "grpo.batch_multiplier"]


def test_every_bad_override_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        load_recipe(BASE, ["loss_fn.nope=1", "~grpo.gone", "+grpo.seed=3"])
    text = str(err.value)
    assert text.startswith("overrides that cannot apply:")
    for key in ("override loss_fn.nope:", "override ~grpo.gone:", "override +grpo.seed:"):
        assert key in text, text


def test_both_bad_parser_names_are_reported():
    from grpo.config import MasterConfig
    from grpo.config.load import build_config

    serving = {"tool_parser": "no_such_tool_parser", "reasoning_parser": "no_such_reasoning_parser"}
    raw = {"policy": {"generation": {"backend": "hf", "vllm_cfg": {"http_server_serving_chat_kwargs": serving}}}}
    with pytest.raises(ConfigError) as err:
        build_config(raw, MasterConfig)
    assert "tool_parser='no_such_tool_parser'" in str(err.value)
    assert "reasoning_parser='no_such_reasoning_parser'" in str(err.value)


# --------------------------------------------------------------------------------------------------
# env.should_log_nemo_gym_responses: NeMo-RL's meaning
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, local_dump", [("true", False), ("false", True)])
def test_should_log_nemo_gym_responses_true_means_nemo_gym_logs_them(value, local_dump):
    """NeMo-RL's _should_log_nemo_gym_responses: true says NeMo-Gym is responsible for the full responses, so the
    run skips its local per-step dump; false (the default) writes it. grpo-ds's local dump follows the same rule."""
    from grpo.wings.gym import gym_environment

    cfg, _ = load_recipe(GYM, [GYM_PARSER, f"env.should_log_nemo_gym_responses={value}"])
    assert gym_environment(cfg.env, "train", None).log_responses is local_dump


# --------------------------------------------------------------------------------------------------
# NeMo-RL's own recipes (a checkout at 7ea279a, NEMO_RL_CHECKOUT; not copied here)
# --------------------------------------------------------------------------------------------------
CHECKOUT = Path(os.environ["NEMO_RL_CHECKOUT"]) if os.environ.get("NEMO_RL_CHECKOUT") else None
PRORL_RECIPES = ["examples/configs/prorlv2.v2.yaml",
                 "examples/configs/recipes/llm/prorlv2-qwen2.5-math-1.5b-instruct-1n8g-fsdp2tp1.v2.yaml",
                 "examples/configs/recipes/llm/prorlv2-qwen2.5-math-1.5b-instruct-1n8g-fsdp2tp1.v2-tq_mooncake.yaml"]
PRORL_1_MOE = "examples/configs/prorlv2_1_moe.v2.yaml"
MOPD_RECIPE = "examples/configs/recipes/llm/mopd-qwen3-1.7b-3n8g-megatron-pack.yaml"
# NeMo-Gym recipes ranking checkpoints by val:total_reward/mean whose every other key grpo-ds can do.
VAL_REWARD_RECIPES = ["examples/configs/recipes/llm/grpo-qwen3-1.7b-1n8g-megatron-super-swe1.yaml",
                      "examples/configs/recipes/llm/grpo-qwen3-1.7b-2n8g-megatron-super-rlhf.yaml",
                      "examples/configs/recipes/llm/grpo-qwen3-1.7b-6n8g-megatron-super-rlvr.yaml",
                      "examples/configs/recipes/llm/grpo-nanov3-30ba3b-3n8g-megatron-dynamo-swe1.yaml"]
SUPER = [f"examples/nemo_gym/nemotron-3-super/{name}.yaml"
         for name in ("stage1_rlvr", "stage2_swe1", "stage2_swe2", "stage3_rlhf")]
# What grpo-ds cannot do in them (each refused, naming it), deleted so that the rest is checked.
SUPER_CAPABILITIES = ["~policy.megatron_cfg.mtp_loss_scaling_factor",
                      "~policy.generation.vllm_cfg.reasoning_parser_plugin",
                      "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.reasoning_parser=deepseek_r1"]


def prorl_shaping(cfg) -> bool:
    return cfg.grpo.reward_shaping.stop_properly_penalty_coef == 0.0 and \
        cfg.grpo.reward_shaping.overlong_buffer_length is None


def ranks_by_val_reward(cfg) -> bool:
    return cfg.checkpointing.metric_name == "val:accuracy" and cfg.env.should_use_nemo_gym


@pytest.mark.skipif(CHECKOUT is None, reason="needs NEMO_RL_CHECKOUT (a NeMo-RL checkout at 7ea279a)")
@pytest.mark.parametrize("rel, check", [(r, prorl_shaping) for r in PRORL_RECIPES]
                         + [(r, ranks_by_val_reward) for r in VAL_REWARD_RECIPES])
def test_nemo_rl_recipes_load(rel, check, monkeypatch):
    monkeypatch.setenv("HF_HOME", os.environ.get("HF_HOME", "~/.cache/huggingface"))
    monkeypatch.setenv("PERSISTENT_CACHE", os.environ.get("PERSISTENT_CACHE", "~/.cache"))
    cfg, _ = load_recipe(CHECKOUT / rel)
    assert check(cfg)


@pytest.mark.skipif(CHECKOUT is None, reason="needs NEMO_RL_CHECKOUT (a NeMo-RL checkout at 7ea279a)")
@pytest.mark.parametrize("rel", SUPER)
def test_nemo_rl_super_gym_recipes_rank_by_validation_reward(rel, monkeypatch):
    monkeypatch.setenv("PERSISTENT_CACHE", os.environ.get("PERSISTENT_CACHE", "~/.cache"))
    with pytest.raises(ConfigError) as err:  # as they are: only what grpo-ds cannot do, every one named
        load_recipe(CHECKOUT / rel)
    refused = [line.strip().split("=")[0] for line in str(err.value).splitlines()[1:]]
    assert refused == ["policy.megatron_cfg.mtp_loss_scaling_factor",
                       "policy.generation.vllm_cfg.reasoning_parser_plugin",
                       "policy.generation.vllm_cfg.http_server_serving_chat_kwargs.reasoning_parser"], refused
    cfg, _ = load_recipe(CHECKOUT / rel, SUPER_CAPABILITIES)
    assert ranks_by_val_reward(cfg)


@pytest.mark.skipif(CHECKOUT is None, reason="needs NEMO_RL_CHECKOUT (a NeMo-RL checkout at 7ea279a)")
def test_prorl_v2_1_is_refused_for_what_nemo_rl_asserts_and_loads_without_it(monkeypatch):
    """The fourth ProRLv2 recipe, prorlv2_1_moe.v2.yaml, turns dynamic sampling off and inherits
    batch_multiplier=1.5: NeMo-RL's setup asserts "batch_multiplier>1 can only be used if use_dynamic_sampling=True"
    (grpo.py at 7ea279a), so NeMo-RL does not run it as written either. Refused for that alone; with the multiplier
    at 1 it loads with ProRLv2's shaping."""
    monkeypatch.setenv("HF_HOME", os.environ.get("HF_HOME", "~/.cache/huggingface"))
    with pytest.raises(ConfigError) as err:
        load_recipe(CHECKOUT / PRORL_1_MOE)
    assert [line.strip().split("=")[0] for line in str(err.value).splitlines()[1:]] == ["grpo.batch_multiplier"]
    cfg, _ = load_recipe(CHECKOUT / PRORL_1_MOE, ["grpo.batch_multiplier=1"])
    assert prorl_shaping(cfg) and cfg.loss_fn.force_on_policy_ratio


@pytest.mark.skipif(CHECKOUT is None, reason="needs NEMO_RL_CHECKOUT (a NeMo-RL checkout at 7ea279a)")
def test_the_mopd_recipe_ranks_by_validation_reward(monkeypatch):
    """The fifth recipe ranking by val:total_reward/mean is NeMo-RL's LLM MOPD recipe: it loads as it is (its
    inherited data.train split keys ignored as NeMo-RL warns) and ranks by val:accuracy, its teacher on a node of
    its own as NeMo-RL's worker group (default_teacher_cfg: 8 GPUs x 1 node, micro_batch_size 1; the Megatron sizes
    ignored), beside the generation node and one training node of the three."""
    from grpo.config import teacher_ranks

    monkeypatch.setenv("HF_HOME", os.environ.get("HF_HOME", "~/.cache/huggingface"))
    cfg, table = load_recipe(CHECKOUT / MOPD_RECIPE)
    assert ranks_by_val_reward(cfg) and cfg.grpo.adv_estimator.name == "opd"
    assert {"data.train.split_validation_size", "data.train.seed"} <= rows(table, "ignored").keys()
    opd = cfg.on_policy_distillation
    assert opd.teacher_model_by_agent_name == {"default_teacher": "Qwen/Qwen3-1.7B"}
    assert opd.non_colocated_teachers.enabled and opd.non_colocated_teachers.default_teacher_cfg.micro_batch_size == 1
    assert teacher_ranks(opd) == 8 and cfg.cluster.num_nodes == 3
    assert "Megatron parallel sizes" in rows(table, "ignored")[
        "on_policy_distillation.non_colocated_teachers.default_teacher_cfg"]


def test_time_limit_with_checkpointing_off_is_ignored_as_nemo_rl_saves_nothing(tmp_path):
    """NeMo-RL stops at checkpoint_must_save_by whether or not it checkpoints; with checkpointing off it saves nothing
    (the NeMo-Gym SWE recipes): ignored, with why, where grpo-ds's own config refuses a deadline it cannot save at."""
    off = "checkpointing:\n  enabled: false\n  checkpoint_must_save_by: 00:03:30:00\n"
    cfg, table = load_recipe(recipe(tmp_path, off))
    assert cfg.checkpointing.checkpoint_must_save_by is None and not cfg.checkpointing.enabled
    assert "NeMo-RL stops the run at this time limit" in rows(table, "ignored")["checkpointing.checkpoint_must_save_by"]
    cfg, _ = load_recipe(recipe(tmp_path, "checkpointing:\n  checkpoint_must_save_by: 00:03:30:00\n"))
    assert cfg.checkpointing.checkpoint_must_save_by == "00:03:30:00"  # checkpointing on: honored

