"""The config system: NeMo-RL names and defaults, YAML inheritance, dotted overrides, load-time checks."""

import subprocess
import sys
from pathlib import Path

import pytest

from grpo.config import ClusterConfig, MasterConfig, cluster_mismatch, resolve_skip_flags
from grpo.config_load import ConfigError, apply_overrides, build_config, load_config, load_yaml

REPO = Path(__file__).resolve().parents[2]


def bad(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        build_config(apply_overrides({}, list(overrides)))
    return str(e.value)


def test_defaults_are_nemo_rl_defaults():
    c = MasterConfig()
    assert (c.grpo.num_prompts_per_step, c.grpo.num_generations_per_prompt) == (32, 16)
    assert c.grpo.use_leave_one_out_baseline and c.grpo.normalize_rewards
    assert c.grpo.dynamic_sampling_max_gen_batches == 10 and c.grpo.batch_multiplier == 1.0
    assert c.grpo.async_grpo.max_trajectory_age_steps == 1 and c.grpo.async_grpo.max_generation_failures == 0
    loss = c.loss_fn
    assert (loss.ratio_clip_min, loss.ratio_clip_max, loss.ratio_clip_c) == (0.2, 0.2, None)
    assert (loss.reference_policy_kl_penalty, loss.reference_policy_kl_type) == (0.01, "k3")
    assert (loss.kl_input_clamp_value, loss.kl_output_clamp_value) == (20.0, 10.0)
    assert loss.token_level_loss and not loss.use_importance_sampling_correction
    assert c.grpo.reward_scaling.model_dump() == dict(enabled=False, source_min=0.0, source_max=1.0,
                                                      target_min=0.0, target_max=1.0)
    # the estimator inherits the top-level (legacy NeMo-RL) switches unless set itself
    assert c.grpo.adv_estimator.normalize_rewards is True
    assert load_config(None, ["grpo.use_leave_one_out_baseline=false"]).grpo.adv_estimator.use_leave_one_out_baseline \
        is False


def test_dotted_overrides_parse_yaml_values(tmp_path):
    c = load_config(None, ["grpo.num_prompts_per_step=8", "loss_fn.ratio_clip_max=0.28", "policy.generation.top_k=null",
                           "policy.generation.stop_strings=['</answer>', 'END']", "grpo.val_at_start=true",
                           "policy.train_global_batch_size=128"])
    assert c.grpo.num_prompts_per_step == 8 and c.loss_fn.ratio_clip_max == 0.28
    assert c.policy.generation.top_k is None and c.policy.generation.stop_strings == ["</answer>", "END"]
    assert c.grpo.val_at_start is True


def test_recipe_inheritance_merges_deeply(tmp_path):
    (tmp_path / "base.yaml").write_text("grpo:\n  num_prompts_per_step: 4\n  seed: 1\npolicy:\n"
                                        "  train_global_batch_size: 64\n")
    (tmp_path / "mid.yaml").write_text("defaults: base.yaml\ngrpo:\n  seed: 2\n")
    (tmp_path / "top.yaml").write_text("defaults: mid.yaml\ngrpo:\n  num_generations_per_prompt: 16\n")
    c = load_config(tmp_path / "top.yaml", ["grpo.seed=3"])
    assert (c.grpo.num_prompts_per_step, c.grpo.num_generations_per_prompt, c.grpo.seed) == (4, 16, 3)
    (tmp_path / "loop.yaml").write_text("defaults: loop.yaml\n")
    with pytest.raises(ConfigError, match="loops"):
        load_yaml(tmp_path / "loop.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


@pytest.mark.parametrize("path", sorted(str(p.relative_to(REPO)) for p in (REPO / "configs").glob("*.yaml")))
def test_every_shipped_recipe_loads(path):
    load_config(REPO / path)


@pytest.mark.parametrize("overrides, key, expected", [
    (["grpo.num_prompt_per_step=4"], "grpo.num_prompt_per_step", "unknown key"),
    (["policy.optimizer.lrr=1"], "policy.optimizer.lrr", "unknown key"),
    (["grpo.num_prompts_per_step=abc"], "grpo.num_prompts_per_step", "valid integer"),
    (["grpo.num_generations_per_prompt=0"], "grpo.num_generations_per_prompt", "greater than 0"),
    (["policy.precision=fp8"], "policy.precision", "'float32', 'bfloat16' or 'float16'"),
    (["loss_fn.reference_policy_kl_type=k4"], "loss_fn.reference_policy_kl_type", "'k1', 'k2' or 'k3'"),
    (["grpo.adv_estimator.name=ppo"], "grpo.adv_estimator.name", "['gdpo', 'grpo', 'reinforce_plus_plus'"),
    (["grpo.advantage_clip_low=2", "grpo.advantage_clip_high=1"], "grpo.advantage_clip_low", "expected <"),
    (["grpo.async_grpo.enabled=true"], "grpo.async_grpo.enabled", "use_importance_sampling_correction=true"),
    (["reward_penalties.penalize_unwanted_tokens=true"], "reward_penalties.token_ids.unwanted", "list of token ids"),
    (["loss_fn.truncated_importance_sampling_type=icepop", "loss_fn.use_importance_sampling_correction=true",
      "loss_fn.truncated_importance_sampling_ratio=2"], "truncated_importance_sampling_ratio_min", "expected a number"),
    (["loss_fn.sequence_level_importance_ratios=true"], "loss_fn.token_level_loss=false", "GSPO"),
    (["policy.train_global_batch_size=100"], "policy.train_global_batch_size=100", "divisor"),
    (["grpo.stop_at_validation_metric=reward_mean"], "grpo.stop_at_validation_threshold", "set together"),
    (["env.name=function"], "env.reward_fn", "package.module:function"),
    (["checkpointing.checkpoint_must_save_by=3:45:00"], "checkpointing.checkpoint_must_save_by", "DD:HH:MM:SS"),
    (["checkpointing.checkpoint_must_save_by=1:00:00:00"], "checkpointing.checkpoint_must_save_by='216000'",
     "base-60"),
    (["checkpointing.checkpoint_must_save_by=00:03:45:00", "checkpointing.enabled=false"],
     "checkpointing.checkpoint_must_save_by='00:03:45:00'", "checkpointing.enabled=true"),
    (["loss_fn.use_kl_in_reward=true", "loss_fn.force_on_policy_ratio=true", "grpo.adv_estimator.name=reinforce_plus_plus",
      "policy.train_global_batch_size=512"], "loss_fn.use_kl_in_reward", "force_on_policy_ratio"),
])
def test_bad_values_name_the_key_and_what_was_expected(overrides, key, expected):
    msg = bad(*overrides)
    assert key in msg and expected in msg, msg


@pytest.mark.parametrize("nodes, gpus, world, local, expected", [
    (None, None, 16, 8, None),                              # unset: whatever the launcher started
    (2, 8, 16, 8, None),
    (1, 8, 2, 2, "cluster.num_nodes=1 x cluster.gpus_per_node=8 = 8 ranks, but the launcher started 2"),
    (None, 8, 16, 4, "cluster.gpus_per_node=8, but the launcher started 4 ranks on this node"),
    (None, 8, 8, None, None),                               # a launcher that does not say LOCAL_WORLD_SIZE
    (3, None, 8, 4, "cluster.num_nodes=3 does not divide the 8 ranks"),
])
def test_cluster_is_checked_against_the_launcher(nodes, gpus, world, local, expected):
    msg = cluster_mismatch(ClusterConfig(num_nodes=nodes, gpus_per_node=gpus), world, local)
    assert msg == expected if expected is None else expected in msg


def test_kl_in_reward_with_force_on_policy_is_allowed_when_its_inputs_exist():
    base = ["loss_fn.use_kl_in_reward=true", "loss_fn.force_on_policy_ratio=true",
            "grpo.adv_estimator.name=reinforce_plus_plus", "policy.train_global_batch_size=512"]
    build_config(apply_overrides({}, base + ["grpo.seq_logprob_error_threshold=2.0"]))
    build_config(apply_overrides({}, base + ["loss_fn.reference_policy_kl_penalty=0"]))


@pytest.mark.parametrize("overrides, flags", [
    ([], (True, False)),                                      # one optimizer step per rollout: exact
    (["policy.train_global_batch_size=8"], (False, False)),   # several optimizer steps: its own pass
    (["loss_fn.reference_policy_kl_penalty=0"], (True, True)),
    (["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=512"], (True, False)),
    (["loss_fn.force_on_policy_ratio=true", "policy.train_global_batch_size=512",
      "grpo.seq_logprob_error_threshold=2"], (False, False)),
    (["loss_fn.reference_policy_kl_penalty=0", "loss_fn.use_kl_in_reward=true",
      "grpo.adv_estimator.name=reinforce_plus_plus"], (True, False)),   # a 0-weighted reward KL reads none
])
def test_skip_flag_resolution(overrides, flags):
    assert resolve_skip_flags(build_config(apply_overrides({}, overrides))) == flags


def test_skipping_a_reference_the_loss_needs_is_rejected():
    assert "grpo.skip_reference_policy_logprobs_calculation=true" in bad(
        "grpo.skip_reference_policy_logprobs_calculation=true")


def test_config_module_imports_nothing_heavy():
    code = "import sys, grpo.config; print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
